"""
Runtime: the facade the ROS node, client and benchmarks use (see the API contract).

Live state = the arena bytes + a small JSON of non-tensor state:
  * position  – tokens consumed into the state (for pure-SSM models the only token count);
  * pending   – the last sampled token, not yet fed to the model. A turn ends right after
                sampling, so the next turn (or the next step) starts by feeding it; this
                saves one forward per turn and keeps every step boundary consistent;
  * adapter   – per-layer has_previous_state flags, sliding-window counters.
  * rng       – the sampler generator's state (host bytes for CPU and CUDA generators alike,
                so neither snapshot nor restore needs a device sync for it).
The last logits and the committed token history live IN the arena (kinds "logits" and
"tokens"), so they are covered by the same copies as the model state.

Committed boundaries: the end of a prefill, the end of a turn, reset(), and the state a
restore/rollback lands on. The rollback ring keeps the last `rollback_depth` of them as
device-resident capsules OUTSIDE the user's device budget: the ring is the runtime's own
undo history, its size is bounded by rollback_depth x the used state, and stats() reports
its bytes separately. A restored device capsule goes on the ring by reference (capsules are
immutable), so deleting it frees its memory only once it has left the ring; so does the
device-side blob a full host restore copied from (the host blob itself on a CPU runtime).

Concurrency: one writer. Every state access holds `_lock` (the step lock); a generation
claims the writer slot from generate() until it finishes, and state-changing calls made
meanwhile raise BusyError instead of waiting for an unbounded stream to end.

Preemption: restore(..., preempt=True) and rollback(..., preempt=True) end a running
generation and replace the state in one go. The capsule is checked first; then the step in
flight is abandoned at its next module call (a global forward pre-hook, armed only while a
preemption waits, raises on the generation thread, so the wait is a small fraction of a
step, and a long prefill is cut short too) and the generation thread itself writes the
capsule over the half-updated state (the rows the abandoned forward may have written are
zeroed with the rest of the stale tail). The turn ends with stop_reason "interrupted" and
is not committed. A captured CUDA graph replays as one launch, so there the wait is up to
one step.

Policy mode (a robot policy model, models/policy.py): act(observation) replaces prefill and
generate. position counts observations; every act() is a committed boundary; the action
chunk and its queue of not-yet-executed actions are arena state (kind "actions"), taken
with next_action(); interrupt() drops the queue. Snapshot/restore/fork/rollback/kv_only
are the same code for both modes.
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass
import functools
import hashlib
import json
import sys
import threading
import time
from typing import Iterator, Sequence

import torch

from .arena import StateArena, StateSpec
from .capsule import (
    BlobPool, Capsule, CapsuleInfo, CapsuleStore, host_blob, move_blob, validate_name,
    validate_tier,
)
from .config import RuntimeConfig
from .engine import Engine, PolicyEngine, StepAborted
from .errors import (
    BusyError,
    CapsuleNotFoundError,
    ConfigError,
    CorruptCapsuleError,
    FingerprintMismatchError,
    FlashRTError,
    InvalidNameError,
    InvalidRequestError,
)
from .models.base import PolicyAdapter, PolicySpec, StateAdapter
from .models.hf import load_adapter
from .models.policy import is_policy_model, load_policy

_DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}


KV_ONLY_SKIPS = frozenset(
    {'conv', 'recurrent'}
)  # what a KV-only restore (the ablation) leaves alone
BUSY_MESSAGE = ('a generation is running; interrupt() it (a step in flight ends first), or '
                'restore/rollback with preempt=True')
STOP_REASONS = ('max_tokens', 'eos', 'stop_string', 'interrupted', 'max_seq_len', 'error')


@dataclass(frozen=True)
class TokenEvent:
    index: int
    token_id: int
    text: str  # decoded piece (may be "" while a multi-byte character is incomplete)


@dataclass(frozen=True, eq=False)
class ActionChunk:
    step: int  # observations consumed into the state (the committed boundary it ends at)
    actions: torch.Tensor  # [horizon, action_dim] float32 on the host; a copy
    names: tuple[str, ...]  # joint / axis name of each action dimension (may be empty)
    latency_s: float  # wall time of the control step


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]
    text: str
    stop_reason: str
    ttft_s: float
    tokens_per_s: float
    prompt_tokens: int


class _Preemption:
    """A restore or rollback waiting to replace the state of a running generation."""

    def __init__(self, run):
        self.run = run  # run(torn: bool) -> CapsuleInfo, with the step lock held
        self.done = False
        self.result: CapsuleInfo | None = None
        self.error: BaseException | None = None


@dataclass
class _Sampling:
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    eos: bool


class Generation:
    """Streaming iterator over TokenEvents; `.result` is set when it finishes (else None)."""

    def __init__(self, runtime: 'Runtime', prompt_ids: list[int] | None, sampling: _Sampling):
        self._rt = runtime
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.result: GenerationResult | None = None
        self.token_ids: list[int] = []
        self.started = False
        self.t_start = 0.0
        self.t_first = 0.0
        # Incremental detokenization: the text of token_ids[prefix:] minus that of
        # token_ids[prefix:read] is what the newest tokens add (decoding a short window per
        # step, not the whole turn; the window's first tokens give merges their context).
        self.prefix_offset = 0
        self.read_offset = 0
        self.tail = ''  # the end of the text handed out so far, for stop strings

    def __iter__(self) -> Iterator[TokenEvent]:
        return self

    def __next__(self) -> TokenEvent:
        return self._rt._generation_step(self)

    def close(self) -> None:
        """Stop early (if still running); the state stays at the last step boundary, committed."""
        if self.result is None:
            self._rt._finish(self, 'interrupted')

    def __del__(self):
        if sys.is_finalizing():  # interpreter exit: torch and the blob pool may be half gone
            return
        try:
            self.close()
        except Exception:
            pass


class Runtime:
    """Model + state arena + capsule store + engine behind one thread-safe facade."""

    def __init__(self, config: RuntimeConfig | dict | None = None,
                 adapter: StateAdapter | None = None):
        """
        Load the model (or take `adapter`, e.g. your own policy module) and allocate the arena.

        A policy model (builtin:tiny-policy or a directory with policy.json) puts the
        runtime in policy mode: act() instead of prefill()/generate().
        """
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
        self.dtype = _DTYPES[config.dtype]
        self._lock = threading.RLock()
        self._interrupt = threading.Event()
        self._active: Generation | None = None
        self._closed = False
        self._preempt: _Preemption | None = None
        self._preempt_lock = threading.Lock()  # one preemption at a time
        self._abortable = 0  # ident of the thread whose forward may be abandoned now, or 0
        self._extent = 0  # rows the last forward may have written (past position if torn)

        if adapter is None:
            load = load_policy if is_policy_model(config.model) else load_adapter
            adapter = load(config.model, self.device, self.dtype, config.max_seq_len)
        self.adapter = adapter
        self.is_policy = isinstance(adapter, PolicyAdapter)
        self.tokenizer = getattr(adapter, 'tokenizer', None)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.seed)
        if self.is_policy:
            specs = self.adapter.state_specs() + PolicyEngine.state_specs(adapter.spec)
        else:
            specs = self.adapter.state_specs() + [
                StateSpec('logits', 'logits', (self.adapter.vocab_size,), torch.float32),
                StateSpec('tokens', 'tokens', (config.max_seq_len,), torch.int32, seq_dim=0),
            ]
        self.arena = StateArena(specs, self.device, max_position=config.max_seq_len)
        # Capsule blobs on a CPU runtime reuse dropped ones' memory (no page faults).
        self._pool = BlobPool(2 * self.arena.nbytes) if self.device.type == 'cpu' else None
        self.adapter.bind(self.arena.views)
        if self.is_policy:
            self.engine = PolicyEngine(self.adapter, self.arena.views)
        else:
            self.engine = Engine(self.adapter, self.arena.views['logits'], config.cuda_graphs)
            self.engine.abort_when(lambda: self._preempt is not None
                                   and self._abortable == threading.get_ident())
        self._last_step_s = 0.0
        self.fingerprint = hashlib.sha256(
            (self.adapter.fingerprint() + self.arena.layout_fingerprint).encode()
        ).hexdigest()
        self._components = tuple(self.arena.kinds) + ('rng', 'meta')
        self.store = CapsuleStore(
            self.device,
            {
                'device': config.device_budget_bytes,
                'host': config.host_budget_bytes,
                'disk': config.disk_budget_bytes,
            },
            config.eviction,
            config.capsule_path,
        )
        self._ring: collections.deque[Capsule] = collections.deque(
            maxlen=max(config.rollback_depth, 1)
        )
        # Boundaries that left the ring, freed by the next capture (see _push). A deque with
        # maxlen: appending, dropping the oldest and clearing are each atomic, so threads
        # outside the step lock (delete_capsule, fork) may clear it.
        self._retired: collections.deque[Capsule] = collections.deque(maxlen=self._ring.maxlen)
        self._restore_times: collections.deque[float] = collections.deque(maxlen=1000)
        self._last_restore_s = 0.0
        self._last_restore_copied = 0
        self._decode_tps = 0.0
        self.position = 0
        self._pending: int | None = None
        self.reset()

    # ---- small properties -------------------------------------------------------------

    @property
    def generating(self) -> bool:
        return self._active is not None

    @property
    def state_nbytes(self) -> int:
        return self.arena.nbytes

    @property
    def components(self) -> list[str]:
        return list(self._components)

    def tokenize(self, text: str) -> list[int]:
        self._require_mode(policy=False)
        return self.tokenizer.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        self._require_mode(policy=False)
        return self.tokenizer.decode(list(ids))

    # ---- internal state helpers (call with _lock held) --------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise FlashRTError('runtime is closed; build a new Runtime')

    def _check_idle(self) -> None:
        self._check_open()
        if self._active is not None:
            raise BusyError(BUSY_MESSAGE)

    def _require_mode(self, policy: bool) -> None:
        if self.is_policy != policy:
            raise InvalidRequestError(
                f'model {self.config.model!r} is a robot policy: call act(observation), not '
                'prefill/generate/tokenize' if self.is_policy else
                f'model {self.config.model!r} is a language model: act() and the action '
                'queue need a policy model (e.g. builtin:tiny-policy)'
            )

    def _meta(self) -> dict:
        """Return the live non-tensor state but the sampler's, as a capsule keeps it."""
        return {
            'position': self.position,
            'pending': self._pending,
            'adapter': self._adapter_meta(self.adapter.export_meta()),
        }

    def _alloc(self, nbytes: int) -> torch.Tensor:
        """Return a capsule blob of nbytes in arena memory (pooled on CPU; see BlobPool)."""
        if self._pool is None:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._pool.take(nbytes)

    def _capture(self, name: str, tier: str, pinned: bool = False) -> Capsule:
        """Copy the live state into a new capsule (not yet stored)."""
        self._retired.clear()  # before the allocation below, which may reuse their memory
        # A new blob in arena memory; for the host and disk tiers of a GPU runtime, in host
        # memory (host_blob), where the copy below then goes directly.
        if not self._cuda or tier == 'device':
            alloc = self._alloc
        else:
            alloc = functools.partial(host_blob, tier=tier, device=self.device)
        blob, packing = self.arena.pack(self.position, alloc)  # one copy
        rng = self.generator.get_state()
        # A custom adapter's meta goes through JSON now (_adapter_meta): it may export live
        # objects, which must not leak into the capsule, and what cannot be written should
        # fail here. The capsule's JSON is built when something needs it (a disk write, a
        # checksum), not on every snapshot and commit.
        meta = self._meta()
        cap = Capsule(
            name=name,
            tier=tier,
            blob=blob,
            packing=packing,
            manifest=self.arena.manifest,
            fingerprint=self.fingerprint,
            position=self.position,
            meta_json=lambda: json.dumps(dict(meta, rng=bytes(rng.numpy()).hex()),
                                         sort_keys=True),
            components=self._components,
            pinned=pinned,
            epoch=self.arena.epoch,
        )
        # What _check_capsule would parse from meta_json, known here: the first restore of a
        # fresh capsule (an interrupt back to the last checkpoint) skips parsing it.
        cap.restore_cache['meta'] = dict(meta, rng=rng)
        return cap

    def _check_capsule(self, cap: Capsule) -> dict:
        """Everything that could make a restore fail, checked before the first byte is written."""
        meta = cap.restore_cache.get('meta')
        if meta is not None:  # checked once (or captured here): a capsule is immutable
            return meta
        if cap.fingerprint != self.fingerprint or cap.manifest != self.arena.manifest:
            raise FingerprintMismatchError(
                f'capsule {cap.name!r} was taken from a different model, dtype or max_seq_len '
                f'(capsule {cap.fingerprint[:12]}, runtime {self.fingerprint[:12]}); '
                'restore it into a Runtime built with the same config'
            )
        if cap.blob is None or cap.blob.numel() != cap.packing.nbytes:
            raise CorruptCapsuleError(
                f'capsule {cap.name!r} has no state bytes of the expected size; delete it'
            )
        try:
            meta = json.loads(cap.meta_json)
            position = int(meta['position'])
            pending = meta['pending']
            if not 0 <= position <= self.config.max_seq_len or not (pending is None or (
                    type(pending) is int and not self.is_policy
                    and 0 <= pending < self.adapter.vocab_size)):
                raise ValueError('position/pending out of range')
            if position != cap.position or cap.packing != self.arena.packing(position):
                raise ValueError(f'position {position} does not fit the header '
                                 f'({cap.position}, {cap.packing})')
            meta['adapter']['layers']
            self.adapter.check_meta(self._adapter_meta(meta['adapter']))
            meta['rng'] = torch.frombuffer(bytearray.fromhex(meta['rng']), dtype=torch.uint8)
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptCapsuleError(
                f'capsule {cap.name!r} has unreadable metadata ({exc}); delete it'
            ) from exc
        if meta['rng'].numel() != self.generator.get_state().numel():
            # CPU and CUDA generators keep differently sized states; set_state would fail
            # after the arena was already written, so refuse up front.
            raise FingerprintMismatchError(
                f'capsule {cap.name!r} holds a sampler state from another device type; '
                'restore it into a Runtime on the same kind of device'
            )
        try:  # a state of the right size may still be one set_state refuses
            torch.Generator(device=self.device).set_state(meta['rng'])
        except RuntimeError as exc:
            raise CorruptCapsuleError(
                f'capsule {cap.name!r} holds an invalid sampler state ({exc}); delete it'
            ) from exc
        cap.restore_cache['meta'] = meta
        return meta

    def _adapter_meta(self, meta: dict) -> dict:
        """Return a capsule's adapter meta as the adapter may have it: its own, or a copy."""
        return meta if self.adapter.meta_trusted else json.loads(json.dumps(meta))

    def _apply(
        self, cap: Capsule, meta: dict, kinds: set[str] | None = None
    ) -> torch.Tensor:
        """
        Write a checked capsule into the live state (cannot fail half-way).

        Return the blob it copied from: the capsule's, or its transfer to this device (of
        the head only, when the rows were skipped).
        """
        # The sequence rows the live state already shares with the capsule (same lineage,
        # e.g. back to a checkpoint taken moments ago) are not copied again.
        skip = self.arena.rows_shared(cap.epoch) >= cap.position
        key = 'head' if skip else 'prefix'
        pair = cap.restore_cache.get(key) if kinds is None else None
        blob = cap.blob  # a cached pair is a view of it, on this device
        if pair is None:
            if blob.device != self.device:  # pinned host -> device DMA, of the head only if
                self._retired.clear()  # that is all the restore copies; it allocates
                if skip and kinds is None:
                    blob = blob[:self.arena.head_nbytes]
                blob = blob.to(self.device, non_blocking=True)
            if kinds is None:
                pair = self.arena.copy_pair(blob, cap.packing, skip)
                if blob is cap.blob:  # views of an immutable blob: kept for the next restore
                    cap.restore_cache[key] = pair
        self._last_restore_copied = self.arena.unpack(
            blob, cap.packing, max(self.position, self._extent), kinds, pair,
            (cap.epoch, cap.position))
        self._extent = 0
        self.adapter.import_meta(self._adapter_meta(meta['adapter']))
        self.generator.set_state(meta['rng'])
        self.position, self._pending = int(meta['position']), meta['pending']
        return blob

    def _commit(self) -> None:
        """Mark the live state as a committed boundary (push it on the rollback ring)."""
        if self.config.rollback_depth > 0:
            self._push(self._capture(f'@boundary-{self.position}', 'device'))

    def _push(self, entry: Capsule) -> None:
        """
        Push a boundary on the rollback ring.

        The entry that falls off is retired, not dropped: the last reference to a capsule
        costs its teardown (its views, the pooled blob's return: ~10-25 us on a CPU), which a
        restore of a device capsule, the interrupt path, should not pay. What frees the
        retired entries: the next capture, before it allocates (so their memory is reused at
        once), a transfer from another tier, delete_capsule and fork. Between those only
        restores and rollbacks run, which put stored capsules on the ring, so the ring and
        the retired entries together hold at most one more private state than the ring did.
        """
        if len(self._ring) == self._ring.maxlen:
            self._retired.append(self._ring[0])  # full: drops (frees) the oldest retired one
        self._ring.append(entry)

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        self._require_mode(policy=False)
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            try:
                ids = [int(t) for t in prompt]
            except (TypeError, ValueError) as exc:
                raise InvalidRequestError(
                    'prompt must be text or a sequence of token ids'
                ) from exc
        if not ids:
            raise InvalidRequestError('prompt is empty; pass text or at least one token id')
        bad = [t for t in ids if not 0 <= t < self.adapter.vocab_size]
        if bad:
            raise InvalidRequestError(
                f'token ids {bad[:5]} are outside the vocabulary [0, {self.adapter.vocab_size})'
            )
        return ids

    def _prefill_ids(self, ids: list[int]) -> None:
        if self._pending is not None:
            ids = [self._pending] + ids  # the token sampled last turn has not been consumed yet
        if self.position + len(ids) > self.config.max_seq_len:
            raise InvalidRequestError(
                f'prompt of {len(ids)} tokens does not fit: position {self.position}, '
                f'max_seq_len {self.config.max_seq_len}; reset() or raise max_seq_len'
            )
        self._extent = max(self._extent, self.position + len(ids))
        with self._guarded_forward():
            self.engine.prefill(ids, self.position)
        tokens = self.arena.views['tokens']
        tokens[self.position:self.position + len(ids)].copy_(
            torch.tensor(ids, dtype=torch.int32)
        )
        self.position += len(ids)
        self._pending = None

    def _feed(self, token: int) -> None:
        self._extent = max(self._extent, self.position + 1)
        with self._guarded_forward():
            self.engine.decode(token, self.position)
        self.arena.views['tokens'][self.position] = token
        self.position += 1

    @contextlib.contextmanager
    def _guarded_forward(self):
        """
        Put the state back when a forward fails half-way (lock held).

        An error from inside the model (out of memory, a bug in a custom module, Ctrl-C)
        can leave some layers stepped and others not. The newest committed boundary comes
        back (the state before the call, outside a turn; a reset when rollback_depth is 0),
        a running turn ends uncommitted, and the error goes on to the caller. A preemption's
        StepAborted has its own path.
        """
        try:
            yield
        except StepAborted:
            raise
        except BaseException as exc:
            if self._active is not None and self._preempt is not None:
                # A restore/rollback waits for this step: it replaces the state as it would
                # have replaced an abandoned one (rollback(1) lands on the prompt's end).
                self._serve_preemption(self._active, torn=True)
                where = 'the waiting preemption replaced the state'
            else:
                if self._active is not None:
                    self._finish(self._active, 'error', commit=False)
                self._recover_torn()
                where = (f'the state was put back to the last committed boundary (position '
                         f'{self.position})' if self.config.rollback_depth > 0
                         else 'the state was reset (rollback_depth is 0)')
            if hasattr(exc, 'add_note'):  # Python 3.11+
                exc.add_note(f'flashrt: the step failed half-way; {where}')
            raise

    # ---- lifecycle --------------------------------------------------------------------

    def warmup(self) -> None:
        """Run throwaway steps (and capture the CUDA graph on CUDA); live state unchanged."""
        with self._lock:
            self._check_idle()
            saved = self.arena.storage.clone()
            meta = self.adapter.export_meta()
            try:
                self.arena.zero_()
                self.adapter.reset_meta()
                if self.is_policy:  # a throwaway RNG: warm-up must not move the live one
                    scratch = torch.Generator(device=self.device)
                    self.engine.step(torch.zeros(2, self.adapter.spec.obs_dim), 0, scratch)
                    self.engine.step(torch.zeros(1, self.adapter.spec.obs_dim), 2, scratch)
                else:
                    self.engine.prefill([0], 0)
                    self.engine.decode(0, 1)
                if self.config.cuda_graphs and self.device.type == 'cuda' and not self.is_policy:
                    self.arena.zero_()
                    self.engine.capture()
            finally:
                self.arena.storage.copy_(saved)
                self.arena.begin_epoch()  # the old rows are back, but the lineage is not
                self.adapter.import_meta(meta)
                if self.device.type == 'cuda':
                    torch.cuda.synchronize(self.device)

    def reset(self) -> None:
        """Zero state, position 0, sampler reseeded; a committed boundary."""
        with self._lock:
            self._check_idle()
            self.arena.zero_()
            self.adapter.reset_meta()
            self.generator.manual_seed(self.config.seed)
            self.position, self._pending, self._extent = 0, None, 0
            self._commit()

    def close(self) -> None:
        """Free the model, arena and memory capsules (disk capsules stay)."""
        with self._lock:
            if self._active is not None:
                self._interrupt.set()
                self._finish(self._active, 'interrupted')
            self._closed = True
            self._ring.clear()
            self._retired.clear()
            self.store.drop_memory_tiers()
            if self._pool is not None:
                self._pool.clear()
            self.engine.drop_graph()
            del self.adapter, self.engine, self.arena
            if self._cuda:
                with torch.cuda.device(self.device):
                    torch.cuda.empty_cache()

    # ---- prefill / generate -----------------------------------------------------------

    def prefill(self, prompt: str | Sequence[int]) -> int:
        """Consume a prompt into the state; returns the new position (a committed boundary)."""
        with self._lock:
            self._check_idle()
            self._prefill_ids(self._prompt_ids(prompt))
            self._commit()
            return self.position

    def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = ('\n\n',),
        eos: bool = True,
    ) -> Generation:
        """Start a streaming turn (iterate it for TokenEvents); claims the writer slot now."""
        if isinstance(stop, str):
            stop = (stop,)
        if (
            isinstance(max_new_tokens, bool)
            or not isinstance(max_new_tokens, int)
            or max_new_tokens < 0
        ):
            raise InvalidRequestError('max_new_tokens must be an integer >= 0')
        if not temperature >= 0.0 or not 0.0 < top_p <= 1.0 or top_k < 0:
            raise InvalidRequestError('need temperature >= 0, 0 < top_p <= 1 and top_k >= 0')
        sampling = _Sampling(
            max_new_tokens,
            float(temperature),
            int(top_k),
            float(top_p),
            seed,
            tuple(s for s in stop if s),
            bool(eos),
        )
        self._require_mode(policy=False)
        with self._lock:
            self._check_idle()
            ids = None if prompt is None else self._prompt_ids(prompt)
            if ids is None and self.position == 0 and self._pending is None:
                raise InvalidRequestError(
                    'nothing to continue from: the state is empty; pass a prompt'
                )
            gen = Generation(self, ids, sampling)
            self._interrupt.clear()
            self._active = gen
            return gen

    def interrupt(self) -> None:
        """
        Make the running generation stop before its next step (no-op when none runs).

        A generation between steps (nobody iterating it now: left after a `break`, or never
        started) ends here and now, so the runtime is free when this returns; one in the
        middle of a step ends when the step does, and so does one met while another call
        (a snapshot, a digest) holds the runtime: this never waits. Policy mode: drop the
        pending action queue (waits for a running act() to finish).
        """
        if self.is_policy and not self._closed:
            self.drop_actions()
        gen = self._active
        if gen is None:
            return
        self._interrupt.set()
        if self._lock.acquire(blocking=False):  # not inside a step
            try:
                if self._active is gen:
                    self._finish(gen, 'interrupted')
            finally:
                self._lock.release()

    def _generation_step(self, gen: Generation) -> TokenEvent:
        with self._lock:
            if gen.result is not None:
                raise StopIteration
            if self._preempt is not None:  # a restore/rollback waits for this boundary
                self._serve_preemption(gen, torn=False)
                raise StopIteration
            try:
                return self._step(gen)
            except StepAborted:
                self._serve_preemption(gen, torn=True)
                raise StopIteration from None

    def _serve_preemption(self, gen: Generation, torn: bool) -> None:
        """
        End `gen` and run the waiting preemption (lock held, on the generation thread).

        torn=True: a forward was abandoned half-way, so the turn ends uncommitted and the
        live state must be replaced; if the preemption fails anyway (it was checked before
        it was armed) the last committed boundary is put back instead.
        """
        request = self._preempt
        from_newest = self._end_for_preemption(gen, torn)
        try:
            request.result = request.run(from_newest)
        except Exception as exc:
            request.error = exc
            if torn:
                self._recover_torn()
        request.done = True
        self._preempt = None  # served: a turn started before the caller wakes must not see it

    def _end_for_preemption(self, gen: Generation, torn: bool) -> bool:
        """
        End `gen` for a waiting restore/rollback (lock held); return its run()'s `torn`.

        True when the turn committed no end of its own, so a rollback counts from the newest
        boundary: cut mid-step (torn), or claimed and never started.
        """
        from_newest = torn or not gen.started
        self._finish(gen, 'interrupted', commit=not torn)
        return from_newest

    def _recover_torn(self) -> None:
        """Replace a half-updated state: the newest committed boundary, else a reset."""
        if self._ring and self.config.rollback_depth > 0:
            boundary = self._ring[-1]
            self._apply(boundary, self._check_capsule(boundary))
        else:
            self.reset()

    def _preempt_with(self, run) -> CapsuleInfo:
        """Run run(torn) with the step lock held, ending a running generation first."""
        request = _Preemption(run)
        with self._preempt_lock:
            engine = getattr(self, 'engine', None)  # close() deletes it
            if engine is None:
                self._check_open()
            try:
                engine.arm_abort()  # first: once _preempt is set, the next module call aborts
                self._preempt = request
                with self._lock:
                    self._preempt = None
                    if not request.done:  # no step was running: a boundary or idle
                        self._check_open()
                        gen = self._active
                        return run(gen is not None and self._end_for_preemption(gen, False))
            finally:
                self._preempt = None
                engine.disarm_abort()
        if request.error is not None:
            raise request.error
        return request.result

    @contextlib.contextmanager
    def _abortable_forward(self):
        """Let a waiting preemption abandon the forward run inside (StepAborted)."""
        self._abortable = threading.get_ident()
        try:
            yield
        finally:
            self._abortable = 0

    def _step(self, gen: Generation) -> TokenEvent:
        """One step of a generation (lock held): the prompt first, then a token per call."""
        s = gen.sampling
        if not gen.started:
            gen.started, gen.t_start = True, time.perf_counter()
            if gen.prompt_ids is not None:
                try:
                    with self._abortable_forward():
                        self._prefill_ids(gen.prompt_ids)
                except FlashRTError:
                    self._release(gen)
                    raise
            # Seeded after the prompt, which samples nothing: a refused one changes nothing.
            if s.seed is not None:
                self.generator.manual_seed(s.seed)
            if gen.prompt_ids is not None:
                self._commit()  # end of prefill is a committed boundary
        if self._interrupt.is_set():
            self._finish(gen, 'interrupted')
        elif len(gen.token_ids) >= s.max_new_tokens:
            self._finish(gen, 'max_tokens')
        elif self._pending is not None and self.position >= self.config.max_seq_len:
            self._finish(gen, 'max_seq_len')
        if gen.result is not None:
            raise StopIteration
        if self._pending is not None:
            with self._abortable_forward():
                self._feed(self._pending)
            self._pending = None
        with self._guarded_forward():  # e.g. NaN logits make sampling raise
            token = self.engine.sample(s.temperature, s.top_k, s.top_p, self.generator)
        self._pending = token
        now = time.perf_counter()
        if not gen.token_ids:
            gen.t_first = now
        if s.eos and token in self.tokenizer.eos_token_ids:
            self._finish(gen, 'eos')
            raise StopIteration
        gen.token_ids.append(token)
        last = len(gen.token_ids) >= s.max_new_tokens
        piece = self._new_text(gen)
        if piece.endswith('\ufffd') and not last:
            # Hold it back while more tokens may follow: it can be a multi-byte character
            # cut in the middle. The last event flushes everything.
            piece = ''
        elif piece:
            gen.prefix_offset, gen.read_offset = gen.read_offset, len(gen.token_ids)
        reason = 'max_tokens' if last else None
        if piece and s.stop:
            seen = gen.tail + piece
            if any(x in seen for x in s.stop):
                reason = 'stop_string'
            gen.tail = seen[-max(len(x) for x in s.stop):]
        if reason:
            self._finish(gen, reason)
        return TokenEvent(len(gen.token_ids) - 1, token, piece)

    def _new_text(self, gen: Generation) -> str:
        """Return the text the tokens past gen.read_offset add (see Generation)."""
        ids = gen.token_ids
        done = self.tokenizer.decode(ids[gen.prefix_offset:gen.read_offset])
        text = self.tokenizer.decode(ids[gen.prefix_offset:])
        return text[len(done):] if len(text) > len(done) else ''

    def _release(self, gen: Generation) -> None:
        if self._active is gen:
            self._active = None
            self._interrupt.clear()

    def _finish(self, gen: Generation, reason: str, commit: bool = True) -> None:
        """End of turn: build the result, commit the boundary, free the writer slot."""
        with self._lock:
            if gen.result is not None:
                return
            ids = list(gen.token_ids)
            text = self.tokenizer.decode(ids)
            if reason == 'stop_string':
                text = text[: min(text.find(x) for x in gen.sampling.stop if x in text)]
            n = len(ids)
            now = time.perf_counter()
            decode_s = now - gen.t_first if n > 1 else 0.0
            tps = (n - 1) / decode_s if decode_s > 0 else 0.0
            gen.result = GenerationResult(
                ids,
                text,
                reason,
                (gen.t_first - gen.t_start) if n else 0.0,
                tps,
                len(gen.prompt_ids or ()),
            )
            if tps > 0:
                self._decode_tps = tps
            if commit and gen.started and self._active is gen and not self._closed:
                self._commit()  # end of turn is a committed boundary
            self._release(gen)

    # ---- policy mode: observation in, action chunk out ---------------------------------

    @property
    def policy_spec(self) -> PolicySpec | None:
        """obs_dim, action_dim, horizon and names of a policy model (None for an LM)."""
        return self.adapter.spec if self.is_policy else None

    def act(self, observation) -> ActionChunk:
        """
        Fold one observation [obs_dim] (or a history [T, obs_dim]) into the state.

        The new action chunk replaces the pending queue; the state after it is a committed
        boundary. A wrong shape, NaN or Inf raises InvalidRequestError before the state is
        touched; so does a full episode (position == max_seq_len: reset or restore first).
        """
        self._require_mode(policy=True)
        observations = self.engine.check(observation)  # [T, obs_dim] float32, host
        t0 = time.perf_counter()
        with self._lock:
            self._check_idle()
            if self.position + len(observations) > self.config.max_seq_len:
                raise InvalidRequestError(
                    f'episode is full: position {self.position} + {len(observations)} '
                    f'observations > max_seq_len {self.config.max_seq_len}; reset() or '
                    'restore a capsule first, or raise max_seq_len')
            self._extent = max(self._extent, self.position + len(observations))
            left = int(self.engine.left)  # next_action/drop_actions change it, uncommitted
            try:
                with self._guarded_forward():
                    actions = self.engine.step(observations, self.position, self.generator)
            except BaseException:
                if self.config.rollback_depth > 0:  # (else the state was reset)
                    self.engine.left.fill_(left)  # the queue as it was before the call
                raise
            self.position += len(observations)
            self._commit()
            self._last_step_s = time.perf_counter() - t0
            return ActionChunk(self.position, actions, self.adapter.spec.joint_names,
                               self._last_step_s)

    def check_observation(self, observation) -> torch.Tensor:
        """Return the observation as float32 [T, obs_dim], or raise InvalidRequestError."""
        self._require_mode(policy=True)
        return self.engine.check(observation)

    def next_action(self) -> torch.Tensor | None:
        """Take the next not-yet-executed action [action_dim] of the chunk (None: empty)."""
        self._require_mode(policy=True)
        with self._lock:
            self._check_idle()
            return self.engine.pop()

    def pending_actions(self) -> torch.Tensor:
        """Return a copy of the queue of not-yet-executed actions [n, action_dim]."""
        self._require_mode(policy=True)
        with self._lock:
            self._check_open()
            return self.engine.queued()

    def drop_actions(self) -> int:
        """Empty the action queue (what interrupt() does); return how many were dropped."""
        self._require_mode(policy=True)
        with self._lock:
            self._check_open()
            return self.engine.drop()

    # ---- capsules ---------------------------------------------------------------------

    def snapshot(self, name: str, tier: str = 'device', pinned: bool = False) -> CapsuleInfo:
        """Capture the live state as capsule `name` (at the next step boundary if generating)."""
        validate_name(name)
        validate_tier(tier)
        t0 = time.perf_counter()
        with self._lock:
            self._check_open()
            cap = self._capture(name, tier, pinned=bool(pinned))
            if self._cuda:
                torch.cuda.synchronize(self.device)  # the info's latency covers the copy
        stored = self.store.put(cap)
        return stored.info(time.perf_counter() - t0)

    def restore(self, name: str, mode: str = 'full', preempt: bool = False) -> CapsuleInfo:
        """
        Make capsule `name` the live state, all-or-nothing.

        mode 'kv_only' is the ablation: it restores everything except the recurrent and
        conv state. preempt=True ends a running generation in the middle of its step instead
        of raising BusyError (see Preemption above); the capsule is fetched and checked
        before anything is stopped, so a bad one leaves the generation running.
        """
        t0 = time.perf_counter()
        if mode != 'full' and mode != 'kv_only':
            raise InvalidRequestError(
                f"restore mode {mode!r} is not valid; use 'full' or 'kv_only'"
            )
        if preempt and mode != 'full':
            raise InvalidRequestError('preempt needs a full restore (mode kv_only would '
                                      'keep the recurrent state of the abandoned step)')
        self._check_open()
        self.store.check_name(name)
        if not preempt and self._active is not None:  # (checked again under the lock)
            raise BusyError(BUSY_MESSAGE)  # before any disk read or LRU clock
        # Fetched and checked outside the step lock: a bad name or capsule fails at once, and
        # a disk capsule is read and verified while steps go on.
        try:
            cap = self.store.get(name)
            meta = self._check_capsule(cap)
        except (AttributeError, CapsuleNotFoundError):
            self._check_open()  # close() ran meanwhile: say that, not what it took away
            raise
        if preempt:
            return self._preempt_with(lambda torn: self._restore_checked(cap, meta, mode, t0))
        with self._lock:
            self._check_idle()
            return self._restore_checked(cap, meta, mode, t0)

    def _restore_checked(self, cap: Capsule, meta: dict, mode: str, t0: float) -> CapsuleInfo:
        """Apply a checked capsule, push the boundary, time it (lock held)."""
        self._check_open()
        kinds = None if mode == 'full' else set(self.arena.kinds) - KV_ONLY_SKIPS
        blob = self._apply(cap, meta, kinds)
        if self.config.rollback_depth > 0:
            # The restored state is a committed boundary. A device capsule is immutable, so
            # the ring can hold the capsule itself (no copy). After a full restore the
            # device-side blob _apply copied from is the state too: a host capsule's blob
            # (immutable, on a CPU runtime) or the fresh device copy of a host/disk blob.
            # A disk blob read on a CPU runtime maps the file, so that one is copied in,
            # as are a transfer of the head only and the mixed state a kv_only restore
            # leaves.
            if mode == 'full' and cap.tier == 'device':
                entry = cap
            elif mode == 'full' and blob.numel() == cap.packing.nbytes and (
                    cap.tier == 'host' or blob is not cap.blob):
                entry = cap.with_blob(f'@boundary-{self.position}', 'device', blob)
                entry.restore_cache['meta'] = meta
                entry.epoch = self.arena.epoch  # the live state as the restore left it
            else:
                entry = self._capture(f'@boundary-{self.position}', 'device')
            self._push(entry)
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
        cap = self.store.get(source)
        tier = validate_tier(tier or cap.tier)
        self._retired.clear()  # it allocates: free what the ring dropped first
        blob = move_blob(cap.blob, tier, self.device,
                         None if self._pool is None else self._pool.take)  # CPU: one memory
        new = cap.with_blob(target, tier, blob)
        stored = self.store.put(new)
        if self._cuda:
            torch.cuda.synchronize(self.device)  # the info's latency covers the copy
        return stored.info(time.perf_counter() - t0)

    def rollback(self, boundaries: int = 1, preempt: bool = False) -> CapsuleInfo:
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
            return self._preempt_with(lambda torn: self._rollback_locked(boundaries, t0, torn))
        with self._lock:
            self._check_idle()
            return self._rollback_locked(boundaries, t0, torn=False)

    def _check_rollback(self, boundaries: int) -> None:
        if self.config.rollback_depth <= 0:
            raise InvalidRequestError('rollback is disabled (rollback_depth is 0)')
        # The ring's newest entry is the live state's own boundary (every change ends in a
        # commit).
        if boundaries >= len(self._ring):
            raise InvalidRequestError(
                f'only {len(self._ring) - 1} earlier boundaries are kept; '
                f'raise rollback_depth to go further back'
            )

    def _rollback_locked(self, boundaries: int, t0: float, torn: bool) -> CapsuleInfo:
        """
        Roll back (lock held).

        torn: the turn just ended committed no end of its own (cut mid-step: the live state
        is past the newest boundary; or claimed and never started), so count from the newest.
        """
        self._check_open()
        skip = boundaries - 1 if torn else boundaries  # ring entries newer than the target
        self._check_rollback(skip)
        target = self._ring[-1 - skip]
        meta = self._check_capsule(target)
        self._apply(target, meta)
        for _ in range(skip):
            self._retired.append(self._ring.pop())
        if self._cuda:
            torch.cuda.synchronize(self.device)  # the info's latency covers the copy
        dt = time.perf_counter() - t0
        # Reported as the boundary it is, whatever capsule the ring held for it.
        return target.info(dt, tier='device')._replace(
            name=f'@boundary-{target.position}', pinned=False)

    def list_capsules(self, tier: str | None = None,
                      unreadable: list[str] | None = None) -> list[CapsuleInfo]:
        """
        Capsules of every tier (or one), oldest first.

        Disk files that cannot be read (damaged, or written by a release with another
        capsule format) are not listed; pass a list as `unreadable` to get their names.
        restore or verify_capsule says what is wrong with one, delete_capsule removes it.
        """
        if tier is not None:
            validate_tier(tier)
        return self.store.infos(tier, unreadable)

    def delete_capsule(self, name: str) -> CapsuleInfo:
        t0 = time.perf_counter()
        info = self.store.delete(name)
        self._retired.clear()  # a deleted capsule may be all that kept them shared
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
        with self._lock:
            self._check_open()
            h = hashlib.sha256()
            self.arena.digest(h)
            rng = bytes(self.generator.get_state().numpy()).hex()
            h.update(json.dumps(dict(self._meta(), rng=rng), sort_keys=True).encode())
            return h.hexdigest()

    def _retired_bytes(self) -> int:
        """Bytes the retired ring entries alone keep: what the next capture frees."""
        retired = list(self._retired)
        held = {c.blob.data_ptr() for c in [*self._ring, *self.store.memory_capsules()]
                if c.blob is not None}
        waiting = {c.blob.data_ptr(): c.nbytes for c in retired
                   if c.blob is not None and c.blob.data_ptr() not in held}
        return sum(waiting.values())

    def stats(self) -> dict:
        times = sorted(self._restore_times)
        p99 = times[min(len(times) - 1, int(0.99 * len(times)))] if times else 0.0
        tiers = {
            t: {
                'count': self.store.count(t),
                'bytes_used': self.store.used_bytes(t),
                'budget': self.store.budgets[t],
            }
            for t in ('device', 'host', 'disk')
        }
        ring = list(self._ring) if self.config.rollback_depth > 0 else []
        stats = {
            'model': self.config.model,
            'family': self.adapter.family if not self._closed else '',
            'device': str(self.device),
            'dtype': self.config.dtype,
            'state_nbytes': self.state_nbytes if not self._closed else 0,
            'position': self.position,
            'tiers': tiers,
            'rollback_ring': {
                'count': len(ring),
                'bytes_used': sum(c.nbytes for c in ring),
                'depth': self.config.rollback_depth,
                # Entries that left the ring, held until the next capture frees them (_push);
                # some may still be named capsules or ring entries too.
                'retired_count': len(self._retired),
                'retired_bytes': self._retired_bytes(),
            },
            'last_restore_s': self._last_restore_s,
            # Bytes the last restore/rollback copied: less than the capsule when the live
            # state already held its sequence rows (same lineage).
            'last_restore_copied_bytes': self._last_restore_copied,
            # Memory of dropped capsules kept for new ones (CPU runtimes). Not in the tier
            # accounting, which counts capsule bytes (a pooled blob's buffer may be up to 1/8
            # larger than the capsule).
            'blob_pool_idle_bytes': 0 if self._pool is None else self._pool.idle_bytes,
            'p99_restore_s': p99,
            'decode_tokens_per_s': self._decode_tps,
            'cuda_graph': bool(not self._closed and self.engine.graph is not None),
            'cuda_graph_note': None if self._closed else self.engine.graph_error,
            'cuda_graph_replays': 0 if self._closed else self.engine.replays,
        }
        if self.is_policy:
            stats['control_step_s'] = self._last_step_s
        return stats
