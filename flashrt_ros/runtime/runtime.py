"""
Runtime: the facade the ROS node, the client and the benchmarks use (the Python API).

It holds the parts and the locks and nothing else: the model adapter, the state arena and
the codec that moves it into and out of capsules (state/), the capsule store, the rollback
ring, the writer slot (writer.py) and the mode's driver (modes/), which runs the calls of
its kind of model: prefill/generate for a language model, act() for a robot policy,
feed_audio()/flush() for a speech model. Capsules, restore, fork and rollback are the same
code for every mode.

Committed boundaries: the end of a prefill, the end of a turn, reset(), every act(), every
audio frame and the state a restore/rollback lands on; the rollback ring keeps the last
`rollback_depth` of those the live sequence rows still hold (state/ring.py).

Concurrency: one writer (writer.py). Every state access holds the slot's step lock; a
generation claims the slot from generate() until it finishes, and state-changing calls made
meanwhile raise BusyError instead of waiting for an unbounded stream to end, unless they
preempt it (restore/rollback with preempt=True: WriterSlot.preempt).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import logging
import time
from typing import Callable, Sequence

import torch

from .config import RuntimeConfig, TIERS
from .errors import BusyError, CapsuleNotFoundError, ConfigError, FlashRTError
from .errors import InvalidNameError, InvalidRequestError
from .models import default_dtype, load_model
from .models.base import PolicySpec, StateAdapter
from .models.speech import SpeechSpec
from .modes import ActionChunk, driver_for, FedAudio, Generation, Sampling
from .preemption import end_turn, recover_torn
from .state.arena import dtype_from_name, dtype_name, StateArena
from .state.capsule import BOUNDARY_NAME, Capsule, CapsuleInfo, Origin, validate_name
from .state.capsule import validate_tier
from .state.codec import Cursor, StateCodec
from .state.memory import BlobPool, move_blob
from .state.ring import RollbackRing
from .state.store import CapsuleStore
from .state.transfer import check_manifest, Exports, Manifest, Staging
from .stats import RingStats, RuntimeStats, TierStats
from .writer import WriterSlot

_log = logging.getLogger(__name__)
RESTORE_MODES = ('full', 'kv_only')
KV_ONLY_SKIPS = frozenset({'conv', 'recurrent'})  # what a KV-only restore (the ablation) leaves
BUSY_MESSAGE = ('a generation is running; interrupt() it (a step in flight ends first), or '
                'restore/rollback with preempt=True')


class Runtime:
    """Model + state arena + capsule store + mode driver behind one thread-safe facade."""

    def __init__(self, config: RuntimeConfig | dict | None = None,
                 adapter: StateAdapter | None = None,
                 progress: Callable[[str], None] | None = None):
        """
        Load the model (or take `adapter`, e.g. your own policy module) and allocate the arena.

        The model's kind picks the mode (modes/): a policy model (builtin:tiny-policy or a
        policy checkpoint folder) takes act() instead of prefill()/generate(), a speech model
        feed_audio(). progress(stage) is called as loading goes on (for a log or a status).
        """
        progress = progress or (lambda stage: None)
        if config is None:
            config = RuntimeConfig()
        elif isinstance(config, dict):
            config = RuntimeConfig.from_dict(config)
        config.validate()
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == 'cuda' and not torch.cuda.is_available():
            raise ConfigError(
                f"device {config.device!r} requested but CUDA is not available; use device 'cpu'"
            )
        if self.device.type == 'cuda' and self.device.index is None:
            # With the index, tensors' devices compare equal to it (e.g. a device capsule's).
            self.device = torch.device('cuda', torch.cuda.current_device())
        self._cuda = self.device.type == 'cuda'
        self.dtype = dtype_from_name(config.dtype if config.dtype != 'auto' else (
            'float32' if adapter is not None else default_dtype(config.model)))
        self._closed = False
        if adapter is None:
            progress(f'loading {config.model} ({dtype_name(self.dtype)}) on {self.device}')
            adapter = load_model(config.model, self.device, self.dtype, config.max_seq_len,
                                 config.cpu_step)
        adapter.check_device(self.device)  # a user's module may still be elsewhere
        self.driver = driver_for(adapter)(self, adapter)
        # Speculation: the MTP head's state joins the arena (and every capsule) or the note
        # says why not; off, there is no head state at all.
        self.adapter, self.speculation_note = self.driver.attach(adapter)
        if config.speculation and self.speculation_note is not None:
            _log.warning('speculation %s; decoding runs plain', self.speculation_note)
        self.writer = WriterSlot(self._commit, end_turn, lambda: recover_torn(self),
                                 abortable_steps=self.driver.abortable_steps)
        self.tokenizer = getattr(self.adapter, 'tokenizer', None)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.seed)
        specs = self.adapter.state_specs() + self.driver.state_specs()
        progress(f'binding the state to the arena ({len(specs)} tensors)')
        # A model with no sequence state (a policy such as ACT) has no rows: its episodes
        # have no length bound.
        rows = any(s.seq_dim is not None for s in specs)
        self.arena = StateArena(specs, self.device, max_position=config.max_seq_len if rows else 0)
        # Capsule blobs on a CPU runtime reuse dropped ones' memory (no page faults).
        self._pool = BlobPool(2 * self.arena.nbytes) if self.device.type == 'cpu' else None
        self.adapter.bind(self.arena.views)
        self.engine = self.driver.bind(self.arena.views)
        self.speculator = self.driver.speculator()
        budgets = config.sized_budgets(self.arena.nbytes)
        self.ring = RollbackRing(config.rollback_depth, budgets.pop('ring'))
        self.cursor = Cursor()
        self.codec = StateCodec(
            self.arena, self.adapter, self.generator, self.cursor,
            alloc=self._pool.take if self._pool is not None else functools.partial(
                torch.empty, dtype=torch.uint8, device=self.device),
            before_alloc=self.ring.retired.clear, vocab_size=self.driver.vocab_size)
        self.fingerprint = self.codec.fingerprint
        self.store = CapsuleStore(self.device, budgets, config.eviction,
                                  config.capsule_path, self.fingerprint, config.capsule_key())
        self.exports = Exports(self.store.key)  # capsules served to other runtimes
        self._restore_times: collections.deque[float] = collections.deque(maxlen=1000)
        self._last_restore_s = 0.0
        self.reset()

    # ---- small properties -------------------------------------------------------------

    @property
    def position(self) -> int:
        """Tokens (in policy mode: observations) consumed into the live state."""
        return self.cursor.position

    @property
    def generating(self) -> bool:
        return self.writer.turn is not None

    @property
    def state_nbytes(self) -> int:
        return self.arena.nbytes

    @property
    def components(self) -> list[str]:
        return list(self.codec.components)

    @property
    def is_policy(self) -> bool:
        """Whether the model is a robot policy (act() instead of prefill/generate)."""
        return self.driver.name == 'policy'

    @property
    def is_speech(self) -> bool:
        """Whether the model is a streaming speech model (feed_audio(), flush())."""
        return self.driver.name == 'speech'

    @property
    def chat(self):
        """Return the conversation renderer (modes/lm/chat.py; None: raw text or no LM)."""
        return self.driver.chat

    # ---- checks and the commit (call with _lock held) --------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise FlashRTError('runtime is closed; build a new Runtime')

    def _check_idle(self) -> None:
        self._check_open()
        if self.writer.turn is not None:
            raise BusyError(BUSY_MESSAGE)

    def _clock(self) -> float:
        """Start a latency clock; on CUDA after the work already queued (a turn's commit)."""
        if self._cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _commit(self) -> None:
        """Mark the live state as a committed boundary (push its head on the rollback ring)."""
        if self.ring.depth > 0:
            self.ring.prune(self.arena)
            self.ring.commit(self.codec.boundary(self.ring.head_only))

    # ---- lifecycle --------------------------------------------------------------------

    def warmup(self) -> None:
        """
        Run throwaway steps (and capture the CUDA graph on CUDA); live state unchanged.

        The live state is saved as a capsule of its used prefix, not as a second arena: the
        extra memory is the used state at most, whatever max_seq_len.
        """
        with self.writer.lock:
            self._check_idle()
            saved = self.codec.capture('warmup', 'device')
            try:
                self.arena.zero_()
                self.adapter.reset_meta()
                self.driver.warm()
            finally:
                self.arena.zero_()  # whatever rows the throwaway steps wrote
                self.codec.apply(saved)  # the prefix is back: the lineage goes on
                if self._cuda:
                    torch.cuda.synchronize(self.device)

    def reset(self) -> None:
        """Zero state, position 0, sampler reseeded; a committed boundary."""
        with self.writer.lock:
            self._check_idle()
            self.arena.zero_()
            self.adapter.reset_meta()
            self.generator.manual_seed(self.config.seed)
            cursor = self.cursor
            cursor.position, cursor.pending, cursor.extent = 0, None, 0
            cursor.messages, cursor.turn_open = (), False
            self.writer.commit()

    def close(self) -> None:
        """Free the model, arena and memory capsules (disk capsules stay)."""
        with self.writer.lock:
            if self.writer.turn is not None:
                self.writer.stop.set()
                self.writer.turn.finish('interrupted')
            self._closed = True
            self.ring.drop_all()
            self.store.drop_memory_tiers()
            self.exports.close_all()
            if self._pool is not None:
                self._pool.clear()
            self.driver.close()
            self.codec.close()
            del self.adapter, self.engine, self.arena
            if self._cuda:
                with torch.cuda.device(self.device):
                    torch.cuda.empty_cache()

    # ---- a language model's calls (modes/lm/) --------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        return self.driver.tokenize(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.driver.detokenize(ids)

    @property
    def conversation(self) -> tuple:
        """Return the conversation the live state holds: ((role, content), ...); () outside one."""
        return self.cursor.messages

    def prefill(self, prompt: str | Sequence[int], raw: bool = False,
                role: str = 'system') -> int:
        """
        Consume a prompt into the state; returns the new position (a committed boundary).

        With a chat template the text is a `role` message (the system prompt, by default)
        unless raw=True; token ids are always fed as they are.
        """
        return self.driver.prefill(prompt, raw, role)

    def sampling(self, max_new_tokens: int = 64, temperature: float | None = 0.0,
                 top_k: int | None = 0, top_p: float | None = 1.0, seed: int | None = None,
                 stop: Sequence[str] = ('\n\n',), eos: bool = True) -> Sampling:
        """Return a turn's sampling parameters checked (None: the checkpoint's default)."""
        return self.driver.sampling(max_new_tokens, temperature, top_k, top_p, seed, stop, eos)

    def generate(self, prompt: str | Sequence[int] | None = None, max_new_tokens: int = 64,
                 temperature: float | None = 0.0, top_k: int | None = 0,
                 top_p: float | None = 1.0, seed: int | None = None,
                 stop: Sequence[str] = ('\n\n',), eos: bool = True,
                 raw: bool = False) -> Generation:
        """
        Start a streaming turn (iterate it for TokenEvents); claims the writer slot now.

        With a chat template, text is a user turn and the reply an assistant turn closed by
        the template's end-of-turn tokens; raw=True (or token ids) appends the prompt as it
        is. temperature/top_k/top_p None: the checkpoint's default (generation_config.json;
        greedy when it has none).
        """
        return self.driver.generate(prompt, raw, max_new_tokens, temperature, top_k, top_p,
                                    seed, stop, eos)

    def interrupt(self) -> None:
        """
        Make the running generation stop before its next step (no-op when none runs).

        A generation between steps (nobody iterating it now: left after a `break`, or never
        started) ends here and now, so the runtime is free when this returns; one in the
        middle of a step ends when the step does (a long prompt's prefill at its next chunk
        boundary: modes/lm/generation.py), and so does one met while another call (a
        snapshot, a digest) holds the runtime: this never waits. Policy mode: drop the pending
        action queue (waits for a running act() to finish).
        """
        if not self._closed:
            self.driver.interrupted()
        gen = self.writer.turn
        if gen is None:
            return
        self.writer.stop.set()
        if self.writer.lock.acquire(blocking=False):  # not inside a step
            try:
                if self.writer.turn is gen:
                    gen.finish('interrupted')
            finally:
                self.writer.lock.release()

    # ---- a robot policy's calls (modes/policy.py): observation in, action chunk out ------

    @property
    def policy_spec(self) -> PolicySpec | None:
        """obs_dim, action_dim, horizon and names of a policy model (None otherwise)."""
        return self.driver.policy_spec

    def act(self, observation,
            should_stop: Callable[[], bool] | None = None) -> ActionChunk:
        """
        Fold one observation into the state (modes/policy.py says what one is).

        observation: a dict of 'observation.state' ([obs_dim], or a history [T, obs_dim])
        and 'observation.images.<camera>' [3, H, W] in [0, 1]; a plain vector is the state.
        The new action chunk replaces the pending queue; the state after it is a committed
        boundary. A missing or unknown key, a wrong shape, NaN or Inf raises
        InvalidRequestError before the state is touched; so does a full episode (a policy
        with sequence state at position == max_seq_len: reset or restore first).
        A restore or rollback with preempt=True abandons a running act() (PreemptedError,
        the state is the one it put in place); should_stop() is asked under the step lock
        before the step starts: True raises PreemptedError with the state untouched.
        """
        return self.driver.act(observation, should_stop)

    def check_observation(self, observation) -> dict[str, torch.Tensor]:
        """Return the observation as a dict of float32 tensors, or raise InvalidRequestError."""
        return self.driver.check_observation(observation)

    def next_action(self) -> torch.Tensor | None:
        """Take the next not-yet-executed action [action_dim] of the chunk (None: empty)."""
        return self.driver.next_action()

    def pending_actions(self) -> torch.Tensor:
        """Return a copy of the queue of not-yet-executed actions [n, action_dim]."""
        return self.driver.pending_actions()

    def drop_actions(self) -> int:
        """Empty the action queue (what interrupt() does); return how many were dropped."""
        return self.driver.drop_actions()

    def instruct(self, text: str) -> None:
        """
        Give a vision-language-action policy its instruction (a committed boundary).

        The instruction is state: every later chunk is planned for it and a capsule carries
        it. The action queue is dropped. InvalidRequestError for a policy that takes none or
        a text it cannot hold (the state untouched).
        """
        self.driver.instruct(text)

    def encode(self, observation) -> int:
        """
        Encode an observation into a VLA's prefix, without sampling (a committed boundary).

        sample() then draws chunks from that prefix: each call draws new noise from the
        runtime's RNG, so n calls give n candidate chunks from one prefix, computed once
        (best-of-N); a capsule taken here replays them exactly. Returns the position.
        """
        return self.driver.encode(observation)

    def sample(self) -> ActionChunk:
        """Draw a chunk from the encoded prefix with the runtime's RNG (a committed boundary)."""
        return self.driver.sample()

    # ---- a speech model's calls (modes/speech.py): audio in, text tokens out -------------

    @property
    def speech_spec(self) -> SpeechSpec | None:
        """Sample rate, frame size and text delay of a speech model (None otherwise)."""
        return self.driver.speech_spec

    def check_audio(self, samples, sample_rate: int | None = None) -> torch.Tensor:
        """Return mono samples as float32 [N], or raise InvalidRequestError (nothing fed)."""
        return self.driver.check_audio(samples, sample_rate)

    def feed_audio(self, samples, sample_rate: int | None = None,
                   should_stop: Callable[[], bool] | None = None) -> FedAudio:
        """
        Feed int16 or float32 mono samples of any length; return the completed frames' tokens.

        Every completed frame is a committed boundary; the samples of a frame not yet
        complete wait in the arena. sample_rate None is the model's rate; another rate
        (8-48 kHz) is resampled, and the utterance's first chunk fixes it until reset.
        Bad input (rate, shape, type, NaN) or a full utterance
        raises InvalidRequestError before the state is touched; a frame that fails in the
        model puts the state back at the last completed frame (a reset with rollback_depth
        0) and raises. should_stop() is asked before each frame: True ends the call there
        (the result's `cut`), the rest of the samples untaken. A restore or rollback with
        preempt=True abandons the frame in flight and replaces the state: the result is
        `cut` and `preempted`.
        """
        return self.driver.feed_audio(samples, sample_rate, should_stop)

    def flush(self, should_stop: Callable[[], bool] | None = None) -> FedAudio:
        """Return the tokens the text delay still holds back; the live state is unchanged."""
        return self.driver.flush(should_stop)

    # ---- capsules ---------------------------------------------------------------------

    def snapshot(self, name: str, tier: str = 'device', pinned: bool = False) -> CapsuleInfo:
        """Capture the live state as capsule `name` (at the next step boundary if generating)."""
        validate_name(name)
        validate_tier(tier)
        t0 = self._clock()
        with self.writer.lock:
            self._check_open()
            if self.cursor.turn_open:
                raise BusyError('a conversation turn is being generated; a capsule holds whole '
                                "turns: snapshot after it ends (a goal's save_as does)")
            cap = self.codec.capture(name, tier, pinned=bool(pinned))
            if self._cuda:
                torch.cuda.synchronize(self.device)  # the info's latency covers the copy
        stored = self.store.put(cap)
        return stored.info(time.perf_counter() - t0)

    def restore(self, name: str, mode: str = 'full', preempt: bool = False,
                stages: dict | None = None) -> CapsuleInfo:
        """
        Make capsule `name` the live state, all-or-nothing.

        mode 'kv_only' is the ablation: it restores everything except the recurrent and
        conv state. preempt=True ends a running generation in the middle of its step instead
        of raising BusyError (preemption.py); the capsule is fetched and checked before
        anything is stopped, so a bad one leaves the generation running. stages: see
        WriterSlot.preempt (filled only with preempt=True).
        """
        t0 = self._clock()
        if mode not in RESTORE_MODES:
            raise InvalidRequestError(
                f"restore mode {mode!r} is not valid; use one of {', '.join(RESTORE_MODES)}"
            )
        if preempt and mode != 'full':
            raise InvalidRequestError('preempt needs a full restore (mode kv_only would '
                                      'keep the recurrent state of the abandoned step)')
        self._check_open()
        if not preempt and self.writer.turn is not None:  # (checked again under the lock)
            self.store.check_name(name)  # a bad name says so, busy or not
            raise BusyError(BUSY_MESSAGE)  # before any disk read or LRU clock
        # Fetched and checked outside the step lock: a bad name or capsule fails at once, and
        # a disk capsule is read and verified while steps go on.
        try:
            cap = self.store.get(name)
            meta = self.codec.check(cap)
        except (AttributeError, CapsuleNotFoundError):
            self._check_open()  # close() ran meanwhile: say that, not what it took away
            raise
        if preempt:
            return self.writer.preempt(lambda _: self._restore_checked(cap, meta, mode, t0),
                                       stages, replaces=True)
        with self.writer.lock:
            self._check_idle()
            return self._restore_checked(cap, meta, mode, t0)

    def _restore_checked(self, cap: Capsule, meta: dict, mode: str, t0: float) -> CapsuleInfo:
        """Apply a checked capsule, push the boundary it lands on, time it (lock held)."""
        self._check_open()
        kinds = None if mode == 'full' else set(self.arena.kinds) - KV_ONLY_SKIPS
        entry = self.codec.restore(cap, meta, kinds, self.ring.depth > 0, self.ring.head_only)
        if entry is not None:
            self.ring.prune(self.arena)  # boundaries of a branch left behind
            self.ring.push(entry)
        if self._cuda:
            torch.cuda.synchronize(self.device)  # the info's latency covers the copy itself
        dt = time.perf_counter() - t0
        self._last_restore_s = dt
        self._restore_times.append(dt)
        return cap.info(dt)

    def fork(self, source: str, target: str, tier: str | None = None) -> CapsuleInfo:
        """Copy capsule `source` to a new name (optionally another tier); live state untouched."""
        validate_name(source)
        validate_name(target)
        if source == target:
            raise InvalidNameError('fork target must differ from the source name')
        t0 = time.perf_counter()
        self._check_open()
        cap = self.store.get(source)
        tier = validate_tier(tier or cap.tier)
        try:
            self.codec.check(cap)  # as restore does: a capsule of another model is no fork
        except AttributeError:
            self._check_open()  # close() ran meanwhile: say that
            raise
        self.ring.retired.clear()  # it allocates: free what the ring dropped first
        blob = move_blob(cap.blob, tier, self.device,
                         None if self._pool is None else self._pool.take)  # CPU: one memory
        stored = self.store.put(cap.with_blob(target, tier, blob))
        if self._cuda:
            torch.cuda.synchronize(self.device)  # the info's latency covers the copy
        return stored.info(time.perf_counter() - t0)

    # ---- transfer between runtimes (state/transfer.py); the live state is untouched ---

    def export_capsule(self, name: str, local: bool = False) -> Manifest:
        """
        Open an export of capsule `name`; exports.chunk() serves its bytes by offset.

        local: the receiver runs on this host; the bytes are also shared in memory there
        (Manifest.local_path, state/transfer.py).
        """
        validate_name(name)
        self._check_open()
        return self.exports.add(self.store.get(name), local)

    def begin_import(self, manifest: Manifest, name: str, tier: str) -> Staging:
        """Check that the announced capsule fits here (model, layout, name, budget); stage it."""
        validate_name(name)
        validate_tier(tier)
        self._check_open()
        check_manifest(manifest, self.fingerprint, self.arena.manifest, self.arena.nbytes)
        size = manifest.total_bytes if tier == 'disk' else manifest.state_bytes
        self.store.check_room(tier, size, name)
        return Staging(manifest)

    def finish_import(self, staging: Staging, name: str, tier: str,
                      origin: Origin) -> CapsuleInfo:
        """Verify a complete staging buffer and store its capsule (visible from now on)."""
        t0 = time.perf_counter()
        self._check_open()
        cap = staging.capsule(name, self.store.key, origin)
        self.codec.check(cap)  # as restore would: a capsule that cannot be restored is refused
        self.ring.retired.clear()  # it allocates: free what the ring dropped first
        if tier == 'disk' or (tier == 'host' and not self._cuda):
            blob = cap.blob  # host memory already: the staging buffer is the capsule's now
        else:
            blob = move_blob(cap.blob, tier, self.device,
                             None if self._pool is None else self._pool.take)
        stored = self.store.put(cap.with_blob(name, tier, blob, created=cap.created,
                                              pinned=False, checksum=''))
        if self._cuda:
            torch.cuda.synchronize(self.device)  # the info's latency covers the copy
        return stored.info(time.perf_counter() - t0)

    def rollback(self, boundaries: int = 1, preempt: bool = False,
                 stages: dict | None = None) -> CapsuleInfo:
        """
        Return to the committed boundary `boundaries` back on the ring; drop newer ones.

        preempt=True ends a running generation mid-step instead of raising BusyError; its
        uncommitted tokens are not a boundary, so rollback(1) lands on the newest committed
        one (the end of the turn's prompt), as it does after a plain interrupt. A prompt cut
        in the middle of its prefill was never committed: that turn lands before it.
        """
        if isinstance(boundaries, bool) or not isinstance(boundaries, int) or boundaries < 1:
            raise InvalidRequestError('boundaries must be an integer >= 1')
        t0 = time.perf_counter()
        if preempt:
            self._check_rollback(boundaries)  # the ring only grows until the lock is ours
            return self.writer.preempt(
                lambda from_newest: self._rollback_locked(boundaries, t0, from_newest), stages)
        with self.writer.lock:
            self._check_idle()
            return self._rollback_locked(boundaries, t0, from_newest=False)

    def _check_rollback(self, boundaries: int) -> None:
        if self.ring.depth <= 0:
            raise InvalidRequestError('rollback is disabled (rollback_depth is 0)')
        # The ring's newest entry is the live state's own boundary (every change ends in a
        # commit).
        if boundaries >= len(self.ring):
            raise InvalidRequestError(
                f'only {len(self.ring) - 1} earlier boundaries are kept; '
                f'raise rollback_depth (or ring_budget_bytes) to go further back'
            )

    def _rollback_locked(self, boundaries: int, t0: float, from_newest: bool) -> CapsuleInfo:
        """
        Roll back (lock held).

        from_newest: the turn just ended committed no end of its own (cut mid-step: the live
        state is past the newest boundary; or claimed and never started), so count from the
        newest boundary rather than from the live state's own.
        """
        self._check_open()
        newer = boundaries - 1 if from_newest else boundaries  # ring entries past the target
        self.ring.prune(self.arena)  # none, unless the lineage was forgotten
        self._check_rollback(newer)
        index = len(self.ring) - 1 - newer
        target = self.ring[index]
        self.codec.apply(target, path=self.ring.path(index, self.arena.descends))
        self.ring.retire_newest(newer)
        if self._cuda:
            torch.cuda.synchronize(self.device)  # the info's latency covers the copy
        dt = time.perf_counter() - t0
        # Reported as the boundary it is (the state's size), whatever entry the ring held.
        return target.info(dt, tier='device')._replace(
            name=BOUNDARY_NAME.format(target.position), pinned=False,
            nbytes=target.packing.nbytes)

    def list_capsules(self, tier: str | None = None, unreadable: list[str] | None = None,
                      foreign: list[str] | None = None) -> list[CapsuleInfo]:
        """
        Capsules of every tier (or one), oldest first.

        Disk files that cannot be read (damaged, or written by a release with another
        capsule format) are not listed; pass a list as `unreadable` to get their names.
        restore or verify_capsule says what is wrong with one, delete_capsule removes it.
        Files in capsule_dir that are not capsules (no capsule header, symbolic links) are
        left alone and not listed; pass a list as `foreign` to get their names.
        """
        if tier is not None:
            validate_tier(tier)
        return self.store.infos(tier, unreadable, foreign)

    def delete_capsule(self, name: str) -> CapsuleInfo:
        t0 = time.perf_counter()
        info = self.store.delete(name)
        self.ring.retired.clear()  # a deleted capsule may be all that kept them shared
        return info._replace(latency_s=time.perf_counter() - t0)

    def drain_evictions(self) -> list[CapsuleInfo]:
        """Capsules the lru policy evicted since the last call, for telemetry."""
        return self.store.drain_evicted()

    def verify_capsule(self, name: str) -> CapsuleInfo:
        t0 = time.perf_counter()
        info = self.store.verify(name)
        return info._replace(latency_s=time.perf_counter() - t0)

    # ---- introspection ----------------------------------------------------------------

    def state_digest(self) -> str:
        """sha256 over every arena byte and the non-tensor state (RNG state included)."""
        with self.writer.lock:
            self._check_open()
            h = hashlib.sha256()
            self.arena.digest(h)
            h.update(self.codec.live_meta_json().encode())
            return h.hexdigest()

    def stats(self) -> RuntimeStats:
        """Sizes, tiers, the rollback ring and latency figures (RuntimeStats.to_dict: JSON)."""
        times = sorted(self._restore_times)
        closed, ring = self._closed, self.ring
        usage, temp_bytes = self.store.usage()
        return RuntimeStats(
            model=self.config.model,
            family='' if closed else self.adapter.family,
            device=str(self.device),
            dtype=dtype_name(self.dtype),
            state_nbytes=0 if closed else self.state_nbytes,
            position=self.cursor.position,
            tiers={t: TierStats(*usage[t], self.store.budgets[t]) for t in TIERS},
            rollback_ring=RingStats(len(ring), ring.nbytes(), ring.depth, len(ring.retired),
                                    ring.retired_nbytes(self.store.memory_capsules()),
                                    ring.budget, ring.last_commit_bytes, ring.lineage_drops),
            last_restore_s=self._last_restore_s,
            last_restore_copied_bytes=self.codec.last_copied_bytes,
            blob_pool_idle_bytes=0 if self._pool is None else self._pool.idle_bytes,
            p99_restore_s=times[min(len(times) - 1, int(0.99 * len(times)))] if times else 0.0,
            decode_fastpath_note=None if closed else getattr(
                self.adapter, 'fastpath_note', 'this adapter has no decode fast path'),
            cpu_step_note=None if closed else getattr(
                self.adapter, 'cpu_step_note', 'this adapter has no compiled CPU step'),
            kernels=() if closed else tuple(self.adapter.kernels),
            disk_temp_bytes=temp_bytes,
            **self.driver.stats(),
        )
