"""
Policy mode: a robot policy folds observations into the state and yields action chunks.

An observation is a dict in LeRobot's naming: 'observation.state' (the joint vector,
[obs_dim] or a history [T, obs_dim]) and one 'observation.images.<camera>' per camera of
the policy ([3, H, W] float32 in [0, 1]). A plain vector is taken as 'observation.state'.

position counts control steps and every act() is a committed boundary. The action chunk
and its queue of not-yet-executed actions are arena state (kind "actions"): `left` counts
down as actions are taken and is 0 after a reset or a drop, so a capsule, a restore or a
rollback carries the queue like the rest of the state; interrupt() drops it.
A preempting restore or rollback abandons a running act(), encode() or sample() at its next
module call and replaces the state on that call's thread (writer.py); the call raises
PreemptedError. should_stop, asked under the step lock before a control step starts, lets
a caller drop an observation that a restore has made stale while it waited.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
import time

import torch

from .base import Driver
from ..errors import FlashRTError, InvalidRequestError, PreemptedError
from ..models.base import PolicyAdapter, PolicySpec
from ..preemption import guarded_forward, StepAborted
from ..state.arena import StateSpec

STATE_KEY = 'observation.state'
IMAGE_PREFIX = 'observation.images.'
STALE = ('the control step did not start: a restore or rollback replaced the state while it '
         'waited; no actions were produced')
ABANDONED = ('the control step was abandoned: a restore or rollback replaced the state while '
             'it ran; no actions were produced')
HISTORY_CHUNK = 2048  # observations per forward: bounds activation memory for long histories
# ROS image encodings taken, as (channels, the order that gives RGB).
ENCODINGS = {'rgb8': (3, (0, 1, 2)), 'bgr8': (3, (2, 1, 0)), 'mono8': (1, (0, 0, 0)),
             'rgba8': (4, (0, 1, 2)), 'bgra8': (4, (2, 1, 0))}


@dataclass(frozen=True, eq=False)
class ActionChunk:
    step: int  # observations consumed into the state (the committed boundary it ends at)
    actions: torch.Tensor  # [horizon, action_dim] float32 on the host; a copy
    names: tuple[str, ...]  # joint / axis name of each action dimension (may be empty)
    latency_s: float  # wall time of the control step


def image_from_bytes(data, height: int, width: int, encoding: str, step: int,
                     shape: tuple[int, int, int]) -> torch.Tensor:
    """
    Decode an 8-bit image (a sensor_msgs/Image's fields) to float32 [3, H, W] in [0, 1].

    It is resized (bilinear, antialiased) to the policy's `shape` when its size differs.
    Raises InvalidRequestError for an encoding it does not take or a buffer that does not
    hold height x step bytes.
    """
    if encoding not in ENCODINGS:
        raise InvalidRequestError(
            f"image encoding {encoding!r} is not taken; use one of {', '.join(ENCODINGS)}")
    channels, order = ENCODINGS[encoding]
    if height < 1 or width < 1 or step < width * channels or len(data) != height * step:
        raise InvalidRequestError(
            f'image of {width}x{height} {encoding} with step {step} must hold '
            f'{height} x {step} bytes (step >= {width * channels}); it holds {len(data)}')
    rows = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(height, step)
    pixels = rows[:, :width * channels].reshape(height, width, channels)  # [H, W, C]
    rgb = pixels[:, :, list(order)].permute(2, 0, 1).float().div_(255.0)  # [3, H, W]
    if tuple(rgb.shape) != tuple(shape):
        rgb = torch.nn.functional.interpolate(rgb[None], size=tuple(shape[1:]), mode='bilinear',
                                              align_corners=False, antialias=True)[0]
    return rgb.contiguous()


class PolicyDriver(Driver):
    """Runs a policy adapter over its bound state; the chunk and its queue live in the arena."""

    name = 'policy'
    kind = 'a robot policy'
    calls = 'call act(observation)'
    CHUNK, LEFT = 'policy.actions', 'policy.actions_left'
    # As the engine, for stats(): no graph.
    graph, replays, graph_error = None, 0, 'policy steps run eagerly (no CUDA graph capture yet)'

    def __init__(self, rt, adapter: PolicyAdapter):
        super().__init__(rt, adapter)
        self.spec = adapter.spec
        self.chunk: torch.Tensor | None = None  # [H, A] fp32 arena view: the last chunk
        self.left: torch.Tensor | None = None  # [] int64 arena view: its actions queued
        self.control_step_s = 0.0  # the last act()

    @staticmethod
    def serves(adapter) -> bool:
        return isinstance(adapter, PolicyAdapter)

    def state_specs(self) -> list[StateSpec]:
        spec = self.spec
        return [StateSpec(self.CHUNK, 'actions', (spec.horizon, spec.action_dim), torch.float32),
                StateSpec(self.LEFT, 'actions', (), torch.int64)]

    def bind(self, views: dict[str, torch.Tensor]) -> PolicyDriver:
        """Take the chunk and queue views; the driver steps the policy itself (the engine)."""
        self.chunk, self.left = views[self.CHUNK], views[self.LEFT]
        self.engine = self
        return self

    @property
    def vocab_size(self) -> None:
        return None

    @property
    def policy_spec(self) -> PolicySpec:
        return self.spec

    def close(self) -> None:
        self.chunk = self.left = None
        super().close()

    def stats(self) -> dict:
        return dict(super().stats(), control_step_s=self.control_step_s)

    @property
    def keys(self) -> tuple[str, ...]:
        """Return the observation keys this policy takes."""
        images = tuple(key for key, _ in self.spec.images)
        return ((STATE_KEY,) if self.spec.obs_dim else ()) + images

    def check_observation(self, observation) -> dict[str, torch.Tensor]:
        """Return the observation as a dict of float32 host tensors, or raise."""
        if not isinstance(observation, dict):
            observation = {STATE_KEY: observation}
        unknown = sorted(set(observation) - set(self.keys))
        missing = [k for k in self.keys if k not in observation]
        if unknown or missing:
            raise InvalidRequestError(
                f'observation has keys {sorted(observation)}; this policy takes exactly '
                f'{list(self.keys)} (missing {missing}, unknown {unknown})')
        out = {}
        if self.spec.obs_dim:
            out[STATE_KEY] = self._check_state(observation[STATE_KEY])
        for key, shape in self.spec.images:
            out[key] = self._check_image(key, observation[key], shape)
        if self.spec.images and out.get(STATE_KEY, torch.empty(1)).shape[0] != 1:
            raise InvalidRequestError('a history of observations is taken for state-only '
                                      'policies; send one observation with its images')
        return out

    def _check_state(self, state) -> torch.Tensor:
        d = self.spec.obs_dim
        try:
            x = torch.as_tensor(state, dtype=torch.float32, device='cpu')
        except (TypeError, ValueError, RuntimeError) as exc:
            message = f'observation must be a vector of {d} numbers ({exc})'
            raise InvalidRequestError(message) from exc
        shape = list(x.shape)
        x = x.unsqueeze(0) if x.dim() == 1 else x  # [T, obs_dim]
        if x.dim() != 2 or x.shape[0] == 0 or x.shape[1] != d:
            raise InvalidRequestError(
                f'observation has shape {shape}; expected [{d}] (or [T, {d}] for a history '
                'of T observations)')
        _check_finite(x, 'observation')
        dtype = getattr(self.adapter, 'dtype', torch.float32)
        if dtype.is_floating_point and x.abs().max() > torch.finfo(dtype).max:
            raise InvalidRequestError(
                f'observation value {x.abs().max().item():g} overflows the model dtype '
                f'{dtype} (largest {torch.finfo(dtype).max:g}); scale the observation or run '
                'the model in float32')
        return x

    @staticmethod
    def _check_image(key: str, image, shape: tuple[int, ...]) -> torch.Tensor:
        try:
            x = torch.as_tensor(image, device='cpu')
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidRequestError(f'{key} is not an image tensor ({exc})') from exc
        if x.dtype == torch.uint8:
            x = x.float() / 255.0
        x = x.to(torch.float32)
        if tuple(x.shape) != tuple(shape):
            raise InvalidRequestError(
                f'{key} has shape {list(x.shape)}; this policy takes {list(shape)} '
                '([channels, height, width], values in [0, 1])')
        _check_finite(x, key)
        return x

    @torch.no_grad()  # the adapter picks its own mode; the chunk handed out is a plain tensor
    def step(self, observation: dict[str, torch.Tensor], position: int,
             generator: torch.Generator) -> torch.Tensor:
        """Fold a checked observation in; the new chunk [H, A] becomes the queue."""
        device = self.chunk.device
        x = {k: v.to(device) for k, v in observation.items()}
        steps = x[STATE_KEY].shape[0] if STATE_KEY in x else 1
        for start in range(0, steps, HISTORY_CHUNK):
            part = dict(x)
            if STATE_KEY in x:
                part[STATE_KEY] = x[STATE_KEY][start:start + HISTORY_CHUNK]
            actions = self.adapter.act(part, position + start, generator)  # [H, A]
        self._queue(actions)
        return self.chunk.to('cpu', copy=True)  # never hand out the arena view itself

    def _queue(self, actions: torch.Tensor) -> None:
        """Make a new chunk [H, A] the queue (NaN or Inf: none is, and the caller raises)."""
        if not torch.isfinite(actions).all():  # never queued for a robot: the caller's guard
            raise FlashRTError(                # puts the last committed state back
                'the policy produced NaN or Inf actions; none were queued and the state is '
                'back at the last committed boundary; check the observation scale and the '
                'model (dtype, weights)')
        self.chunk.copy_(actions)
        self.left.fill_(self.spec.horizon)

    def steps_of(self, observation: dict[str, torch.Tensor]) -> int:
        """Return how many control steps (positions) a checked observation takes."""
        return observation[STATE_KEY].shape[0] if STATE_KEY in observation else 1

    def blank(self, steps: int = 1) -> dict[str, torch.Tensor]:
        """Return an all-zero observation of `steps` steps (warm-up)."""
        out = {key: torch.zeros(shape) for key, shape in self.spec.images}
        if self.spec.obs_dim:
            out[STATE_KEY] = torch.zeros(steps, self.spec.obs_dim)
        return out

    def warm(self) -> None:
        """Throwaway steps (a private RNG: the live one must not move)."""
        scratch = torch.Generator(device=self.rt.device)
        multi = 1 if self.spec.images else 2
        self.step(self.blank(multi), 0, scratch)
        self.step(self.blank(1), multi, scratch)

    # ---- calls (Runtime's say what they do) --------------------------------------------

    def act(self, observation, should_stop=None) -> ActionChunk:
        rt = self.rt
        observations = self.check_observation(observation)  # float32 host tensors
        t0 = time.perf_counter()
        with rt.writer.lock:
            rt._check_idle()
            if should_stop is not None and should_stop():
                raise PreemptedError(STALE)
            return self.control_step(observations, t0)

    def _begin(self, steps: int) -> None:
        """Check that `steps` more observations fit; mark the rows a forward may write."""
        rt, cursor = self.rt, self.rt.cursor
        if rt.arena.rows and cursor.position + steps > rt.config.max_seq_len:
            raise InvalidRequestError(
                f'episode is full: position {cursor.position} + {steps} '
                f'observations > max_seq_len {rt.config.max_seq_len}; reset() or '
                'restore a capsule first, or raise max_seq_len')
        cursor.extent = max(cursor.extent, cursor.position + steps)

    @contextlib.contextmanager
    def _guarded(self):
        """
        Run a forward over the state (lock held); if it fails, put the queue back too.

        A waiting restore or rollback abandons the forward and replaces the state here, on
        this thread, before anything else can take the lock (PreemptedError follows).
        """
        rt = self.rt
        left = int(self.left)  # next_action/drop_actions change it, uncommitted
        try:
            with rt.writer.abortable(), guarded_forward(rt), torch.no_grad():
                yield
        except StepAborted:
            rt.writer.serve(None, torn=True)
            raise PreemptedError(ABANDONED) from None
        except BaseException:
            if rt.ring.depth > 0:  # (else the state was reset)
                self.left.fill_(left)  # the queue as it was before the call
            raise

    def control_step(self, observation: dict[str, torch.Tensor], t0: float) -> ActionChunk:
        """Fold a checked observation into the state (lock held)."""
        rt, cursor = self.rt, self.rt.cursor
        steps = self.steps_of(observation)
        self._begin(steps)
        with self._guarded():
            actions = self.step(observation, cursor.position, rt.generator)
        cursor.position += steps
        rt.writer.commit()
        if rt.device.type == 'cuda':  # the commit's copy is queued, not done: bill it here
            torch.cuda.synchronize(rt.device)
        self.control_step_s = time.perf_counter() - t0
        return ActionChunk(cursor.position, actions, self.spec.joint_names,
                           self.control_step_s)

    def instruct(self, text: str) -> None:
        rt = self.rt
        if not self.adapter.takes_instruction:
            raise InvalidRequestError(f'model {rt.config.model!r} takes no instruction (a '
                                      'vision-language-action policy such as SmolVLA does)')
        if not isinstance(text, str) or '\0' in text:
            raise InvalidRequestError('an instruction is a text without NUL characters')
        with rt.writer.lock:
            rt._check_idle()
            try:
                self.adapter.instruct(text)  # checks the text before it writes anything
            except ValueError as exc:
                raise InvalidRequestError(f'instruction refused: {exc}') from exc
            self.left.zero_()  # the queued actions were planned for the old instruction
            rt.writer.commit()

    def encode(self, observation) -> int:
        rt = self._prefixed()
        observation = self.check_observation(observation)
        with rt.writer.lock:
            rt._check_idle()
            x = {k: v.to(self.chunk.device) for k, v in observation.items()}
            self._begin(1)
            with self._guarded():
                self.adapter.prefix(x)
            self.left.zero_()  # a chunk of the old prefix is not this observation's
            rt.cursor.position += 1
            rt.writer.commit()
            return rt.cursor.position

    def sample(self) -> ActionChunk:
        rt = self._prefixed()
        t0 = time.perf_counter()
        with rt.writer.lock:
            rt._check_idle()
            if rt.cursor.position == 0:
                raise InvalidRequestError('no observation is encoded yet: encode() or act() '
                                          'first')
            with self._guarded():
                self._queue(self.adapter.sample(rt.generator))  # [H, A]
            rt.writer.commit()
            self.control_step_s = time.perf_counter() - t0
            return ActionChunk(rt.cursor.position, self.chunk.to('cpu', copy=True),
                               self.spec.joint_names, self.control_step_s)

    def _prefixed(self):
        if not self.adapter.has_prefix:
            raise InvalidRequestError(
                f'model {self.rt.config.model!r} keeps no observation prefix to sample from: '
                'call act(observation) (encode/sample are for a vision-language-action '
                'policy such as SmolVLA)')
        return self.rt

    def next_action(self) -> torch.Tensor | None:
        with self.rt.writer.lock:
            self.rt._check_idle()
            n = int(self.left)
            if n == 0:
                return None
            action = self.chunk[self.spec.horizon - n].to('cpu', copy=True)
            self.left.sub_(1)
            return action

    def pending_actions(self) -> torch.Tensor:
        with self.rt.writer.lock:
            self.rt._check_open()
            return self.chunk[self.spec.horizon - int(self.left):].to('cpu', copy=True)

    def drop_actions(self) -> int:
        with self.rt.writer.lock:
            self.rt._check_open()
            n = int(self.left)
            self.left.zero_()
            return n

    def interrupted(self) -> None:
        """Drop the pending action queue (waits for a running act() to finish)."""
        self.drop_actions()


def _check_finite(x: torch.Tensor, what: str) -> None:
    bad = (~torch.isfinite(x)).nonzero()
    if len(bad):
        raise InvalidRequestError(
            f'{what} holds NaN or Inf (first at index {bad[0].tolist()}, after float32 '
            'conversion); rejected before it reached the state')
