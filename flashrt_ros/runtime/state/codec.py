"""
The codec between the live state and capsules: capture, check and apply.

Live state = the arena bytes + the non-tensor state a capsule keeps as JSON: the cursor
(position, pending token, the conversation's messages: modes/lm/chat.py), the adapter's
meta (layer flags, counters) and the sampler's state (hex in the JSON; host bytes for CPU
and CUDA generators alike, so neither a snapshot nor a restore needs a device sync for
it). capture copies the live state into a new capsule; check refuses one that does not fit
this runtime (fingerprint, manifest, sizes, metadata) before anything is written; apply
writes a checked one in and cannot fail half-way.
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Callable

import torch

from .arena import StateArena
from .capsule import BOUNDARY_NAME, Capsule
from .memory import host_blob
from ..errors import CorruptCapsuleError, FingerprintMismatchError

ROLES = ('system', 'user', 'assistant', 'raw')  # of a conversation's messages


def check_messages(messages) -> tuple:
    """Return a capsule's conversation as a tuple of (role, content); ValueError if bad."""
    out = []
    for message in messages:
        role, content = message  # a pair, or ValueError/TypeError
        if role not in ROLES or not isinstance(content, str):
            raise ValueError(f'bad conversation message {message!r}')
        out.append((role, content))
    return tuple(out)


class Cursor:
    """Where the live sequence stands (the non-tensor state the runtime steps)."""

    __slots__ = ('position', 'pending', 'extent', 'messages', 'turn_open')

    def __init__(self):
        self.position = 0  # tokens (observations) consumed into the state
        # The last sampled token, not yet fed to the model. A turn ends right after
        # sampling, so the next turn (or step) starts by feeding it: one forward fewer per
        # turn, and every step boundary is consistent.
        self.pending: int | None = None
        self.extent = 0  # rows the last forward may have written (past position if torn)
        # The conversation in the state, ((role, content), ...): replaced, never mutated, so
        # a capture keeps a reference. Empty outside a conversation (raw text).
        self.messages: tuple = ()
        # A conversation turn is being generated: its reply is not closed, so the state is
        # no boundary and is not snapshotted.
        self.turn_open = False


def _meta_json(meta: dict, rng: torch.Tensor) -> str:
    """Return a capsule's JSON of the non-tensor state (meta and the sampler state)."""
    return json.dumps(dict(meta, rng=bytes(rng.numpy()).hex()), sort_keys=True)


class StateCodec:
    """Capture, check and apply capsules of one runtime's live state."""

    def __init__(self, arena: StateArena, adapter, generator: torch.Generator, cursor: Cursor,
                 alloc: Callable[[int], torch.Tensor], before_alloc: Callable[[], None],
                 vocab_size: int | None):
        """
        Bind the codec to one runtime's state.

        alloc(nbytes): a device-tier blob. before_alloc(): frees memory waiting for the next
        allocation (the rollback ring's retired entries). vocab_size: None for a policy,
        whose state has no pending token.
        """
        self.arena, self.adapter, self.generator, self.cursor = arena, adapter, generator, cursor
        self.alloc, self.before_alloc, self.vocab_size = alloc, before_alloc, vocab_size
        self.device = arena.device
        self._cuda = self.device.type == 'cuda'
        self.fingerprint = hashlib.sha256(
            (adapter.fingerprint() + arena.layout_fingerprint).encode()
        ).hexdigest()
        self.components = tuple(arena.kinds) + ('rng', 'meta')
        self.meta_trusted = adapter.meta_trusted  # see StateAdapter.meta_trusted
        self.last_copied_bytes = 0  # bytes the last apply copied

    def close(self) -> None:
        """Let go of the arena and the adapter (the runtime closes): any later use fails."""
        del self.arena, self.adapter

    def _adapter_meta(self, meta: dict) -> dict:
        """Return a capsule's adapter meta as the adapter may have it: its own, or a copy."""
        return meta if self.meta_trusted else json.loads(json.dumps(meta))

    def _live_meta(self) -> dict:
        """Return the live non-tensor state but the sampler's, as a capsule keeps it."""
        return {
            'position': self.cursor.position,
            'pending': self.cursor.pending,
            'chat': self.cursor.messages,
            'adapter': self._adapter_meta(self.adapter.export_meta()),
        }

    def live_meta_json(self) -> str:
        """Return the live non-tensor state as a capsule taken now would hold it."""
        return _meta_json(self._live_meta(), self.generator.get_state())

    def capture(self, name: str, tier: str, pinned: bool = False,
                head_only: bool = False, writes: dict | None = None) -> Capsule:
        """
        Copy the live state into a new capsule (not yet stored).

        head_only: a rollback boundary of the live lineage, which leaves the sequence rows
        in the arena (ring.py); never stored. writes: a delta boundary, which also leaves the
        windows but for these rows ({name: (first row, rows)}, StateAdapter.window_writes).
        """
        self.before_alloc()  # first: the allocation below may reuse that memory
        # The blob is in arena memory; for the host and disk tiers of a GPU runtime in host
        # memory (host_blob), where the copy then goes directly.
        if not self._cuda or tier == 'device':
            alloc = self.alloc
        else:
            alloc = functools.partial(host_blob, tier=tier, device=self.device)
        position = self.cursor.position
        layout = None
        if writes is None:
            blob, packing = self.arena.pack(position, alloc, head_only)  # one copy
        else:
            blob, packing, layout = self.arena.pack_delta(position, alloc, writes)
        rng = self.generator.get_state()
        # A custom adapter's meta goes through JSON now (_adapter_meta): it may export live
        # objects, which must not leak into the capsule, and what cannot be written should
        # fail here. The capsule's JSON is built when something needs it (a disk write, a
        # checksum), not on every snapshot and commit.
        meta = self._live_meta()
        cap = Capsule(
            name=name,
            tier=tier,
            blob=blob,
            packing=packing,
            manifest=self.arena.manifest,
            fingerprint=self.fingerprint,
            position=position,
            meta_json=lambda: _meta_json(meta, rng),
            components=self.components,
            pinned=pinned,
            epoch=self.arena.epoch,
            roles=tuple(role for role, _ in meta['chat']),
        )
        # What check() would parse from meta_json, known here: the first restore of a fresh
        # capsule (an interrupt back to the last checkpoint) skips parsing it.
        cap.restore_cache['meta'] = dict(meta, rng=rng)
        cap.window_rows = layout
        return cap

    def boundary(self, head_only: bool) -> Capsule:
        """
        Capture the live state as a lineage entry of the rollback ring (ring.py).

        head_only with windows in the state: a delta entry, which keeps of the windows only
        the rows the next step overwrites.
        """
        name = BOUNDARY_NAME.format(self.cursor.position)
        if head_only and self.arena.windows:
            entry = self.capture(name, 'device', writes=self.adapter.window_writes())
        else:
            entry = self.capture(name, 'device', head_only=head_only)
        entry.on_lineage = True
        return entry

    def check(self, cap: Capsule) -> dict:
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
            rows = self.arena.rows or position  # no rows (a policy without sequence state)
            if not 0 <= position <= rows or not (pending is None or (
                    type(pending) is int and self.vocab_size is not None
                    and 0 <= pending < self.vocab_size)):
                raise ValueError('position/pending out of range')
            if position != cap.position or cap.packing != self.arena.packing(position):
                raise ValueError(f'position {position} does not fit the header '
                                 f'({cap.position}, {cap.packing})')
            meta['chat'] = check_messages(meta.get('chat', ()))  # none before conversations
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

    def apply(self, cap: Capsule, meta: dict | None = None,
              kinds: set[str] | None = None, path: tuple = (None, ())) -> torch.Tensor:
        """
        Write capsule `cap` into the live state (checked first unless `meta` is given).

        Returns the blob it copied from: the capsule's, or its transfer to this device (of
        the head only, when the rows were shared). kinds: restore only those (kv_only).
        path: for a delta entry of the ring, the entries that take the live windows back to
        it (RollbackRing.path); the newest entry needs none.
        """
        if meta is None:
            meta = self.check(cap)
        cursor = self.cursor
        if self._cuda and cap.tier != 'device':
            self.before_alloc()  # the host -> device transfer allocates
        delta = cap.window_rows is not None
        self.last_copied_bytes, blob = self.arena.unpack(
            cap.blob, cap.packing, max(cursor.position, cursor.extent), (cap.epoch, cap.position),
            kinds, cap.restore_cache, rest_only=delta)
        if delta:
            base, deltas = path
            if base is not None:
                self.last_copied_bytes += self.arena.put_windows(base.blob)
            self.last_copied_bytes += self.arena.put_rows((cap, *deltas))
        cursor.extent = 0
        adapter_meta = meta['adapter']  # (_adapter_meta inline: every restore runs this)
        self.adapter.import_meta(adapter_meta if self.meta_trusted
                                 else self._adapter_meta(adapter_meta))
        self.generator.set_state(meta['rng'])
        cursor.position, cursor.pending = int(meta['position']), meta['pending']
        cursor.messages, cursor.turn_open = meta['chat'], False
        return blob

    def restore(self, cap: Capsule, meta: dict, kinds: set[str] | None,
                boundary: bool, head_only: bool = True) -> Capsule | None:
        """
        Apply a checked capsule; with `boundary`, return the ring entry of the state it lands on.

        The restored state is a committed boundary. A device capsule is immutable, so the
        ring can hold the capsule itself (no copy). After a full restore the device-side blob
        apply copied from is the state too: a host capsule's blob (immutable, on a CPU
        runtime) or the fresh device copy of a host/disk blob. A disk blob read on a CPU
        runtime maps the file, and a transfer of the head only and the mixed state a kv_only
        restore leaves are not the state either: those land on a lineage entry (boundary),
        the head alone with `head_only`.
        """
        blob = self.apply(cap, meta, kinds)
        if not boundary:
            return None
        if kinds is None and cap.tier == 'device':
            return cap
        name = BOUNDARY_NAME.format(self.cursor.position)
        if kinds is None and blob.numel() == cap.packing.nbytes and (
                cap.tier == 'host' or blob is not cap.blob):
            entry = cap.with_blob(name, 'device', blob)
            entry.restore_cache['meta'] = meta
            entry.epoch = self.arena.epoch  # the live state as the restore left it
            return entry
        return self.boundary(head_only)
