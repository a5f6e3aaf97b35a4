"""
What a model adapter declares so that its complete execution state lives in the arena.

An adapter owns a model and the model's view of its state; the runtime owns the bytes.
The contract, in the order the runtime uses it:

1. `state_specs()`  – every state tensor the model reads or writes between calls, with
                       its kind, shape, dtype and (for KV) the sequence axis. A tensor
                       with a sequence axis is append-only: a step at `position` writes
                       rows >= position only and rows past the live position stay zero
                       (restores rely on both; see state/arena.py).
2. `bind(views)`    – point the model's state at the arena views it was handed. After
                       this the adapter must never allocate or reassign state tensors.
3. run steps        – language models: `forward(ids)`; policies: `act(observations)`.
4. `export_meta()` / `import_meta()` / `reset_meta()` – the state that is NOT in tensors
                       but decides what the next step computes (flags, integer counters).
                       It travels inside every capsule as JSON.
5. `fingerprint()`  – identity of weights + config + dtype; capsules from another model
                       are refused by comparing it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
import itertools
from typing import Any

import torch

from ..errors import ConfigError
from ..state.arena import StateSpec


class StateAdapter(ABC):
    """Anything whose step-to-step state can be bound to a StateArena."""

    family: str = 'unknown'
    device: torch.device
    dtype: torch.dtype
    # True when export_meta returns fresh JSON data and import_meta and check_meta only
    # read their argument (never keep or change it): the runtime then skips the copies that
    # keep a capsule's meta apart from the adapter's objects.
    meta_trusted: bool = False
    kernels: tuple[str, ...] = ()  # kernel bindings in use (models/kernels.py, widen.py)

    @abstractmethod
    def state_specs(self) -> list[StateSpec]:
        """Every state tensor, so the arena can lay them out once."""

    @abstractmethod
    def bind(self, views: dict[str, torch.Tensor]) -> None:
        """Make the model read and write its state through these arena views only."""

    @abstractmethod
    def export_meta(self) -> dict[str, Any]:
        """JSON-able non-tensor state (flags, counters) needed to continue exactly."""

    @abstractmethod
    def import_meta(self, meta: dict[str, Any]) -> None:
        """Inverse of export_meta; called after the arena bytes were restored."""

    def check_meta(self, meta: dict[str, Any]) -> None:
        """
        Raise ValueError if import_meta(meta) would fail (a capsule read from disk).

        Called before a restore writes anything, so a bad capsule leaves the state as it was.
        """

    @abstractmethod
    def reset_meta(self) -> None:
        """Non-tensor state of a fresh sequence (the arena is zeroed separately)."""

    @abstractmethod
    def fingerprint(self) -> str:
        """Hex digest identifying weights, config and dtype (not the state layout)."""

    def window_writes(self) -> dict[str, tuple[int, int]]:
        """
        Return the rows of each window tensor (a spec with window_dim) the next step writes.

        {name: (first row, rows)}, counted along the window and wrapping; a rollback boundary
        keeps only those (state/ring.py), so a write outside them would not be undone.
        """
        return {}

    def check_device(self, device: torch.device) -> None:
        """Raise ConfigError unless the adapter's modules hold every tensor on `device`."""
        found = {t.device for m in vars(self).values() if isinstance(m, torch.nn.Module)
                 for t in itertools.chain(m.parameters(), m.buffers())}
        elsewhere = sorted(str(d) for d in found if d != device)
        if elsewhere:
            raise ConfigError(
                f'the model has parameters or buffers on {", ".join(elsewhere)} but the '
                f'runtime runs on {device}: move the module first (module.to({str(device)!r}))'
                ' or set the config device to where it is')
        self.device = device  # also a module without parameters runs where the runtime does

    def prepare_capture(self) -> None:
        """
        Put non-tensor state in its steady-state decode form before a CUDA graph capture.

        Python-level branches (e.g. "has previous state") are frozen into a captured graph,
        so capture must see the branch every later replay takes.
        """


class CausalLMAdapter(StateAdapter):
    """A language model: token ids in, next-token logits out, state advanced in place."""

    tokenizer: Any  # has encode(text)->ids, decode(ids)->str, eos_token_ids
    vocab_size: int

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, kv_len: int | None = None) -> torch.Tensor:
        """
        Consume input_ids [1, T] into the bound state; return last-position logits [1, V].

        kv_len, when given, is the sequence length after this call (known on the host in
        eager mode); an adapter may use it to touch only the live part of its buffers.
        None means "unknown" (a captured graph must not depend on it).
        """

    def decode_ready(self) -> bool:
        """Whether the non-tensor state matches what a captured decode graph assumed."""
        return True


@dataclass(frozen=True)
class PolicySpec:
    """What a policy consumes and produces; the node maps ROS messages with it."""

    obs_dim: int  # length of 'observation.state' (0: the policy takes no state vector)
    action_dim: int
    horizon: int  # actions per chunk
    joint_names: tuple[str, ...] = ()  # name of each action dimension (may be empty)
    # name of each observation dimension, '<joint>/position|velocity|effort' for values a
    # sensor_msgs/JointState carries (may be empty: then only plain vectors are accepted)
    observation_names: tuple[str, ...] = ()
    # ('observation.images.<camera>', (3, H, W)) of each camera the policy takes
    images: tuple[tuple[str, tuple[int, int, int]], ...] = ()
    # when a timer-stepped node runs the policy: on every observation ('every_step'), or
    # only once the queue of the last chunk is used up ('queue_empty', LeRobot's way)
    replan: str = 'every_step'
    note: str = ''  # what the loader wants said in /diagnostics (e.g. the normalization)


class PolicyAdapter(StateAdapter):
    """
    A robot policy: observations in, an action chunk out, its state bound to the arena.

    Same state contract as a language model, so capsules, rollback and the KV-only ablation
    work unchanged; the runtime drives `act` instead of `forward`. models/policy.py has the
    implementation (and the extension point for a user's own torch module).
    """

    spec: PolicySpec
    takes_instruction = False  # instruct(text): a VLA keeps its instruction as state
    has_prefix = False  # prefix(observation) once, then sample(generator) chunks from it

    @abstractmethod
    def act(self, observation: dict[str, torch.Tensor], position: int,
            generator: torch.Generator) -> torch.Tensor:
        """
        Fold an observation into the bound state; return actions [horizon, A].

        observation: 'observation.state' [T, obs_dim] (T steps: a history) and each camera's
        'observation.images.<camera>' [3, H, W] in [0, 1] (then T is 1), on the adapter's
        device. position is the number of steps already in the state; the chunk belongs to
        the last one. generator is the runtime's RNG (part of every capsule).
        """
