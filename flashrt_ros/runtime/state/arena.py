"""
StateArena: the one owner of every state buffer of the model.

All state tensors (attention K/V, conv state, recurrent/SSM state, position counters, the
last logits, the token history, ...) are typed views into ONE contiguous, aligned uint8
allocation per device. The arena is allocated once and only ever written in place, so:
  * addresses never move (a captured CUDA graph stays valid across restores);
  * a snapshot is a copy of arena bytes, a restore is a copy back (no re-binding);
  * the manifest (name, kind, dtype, shape, byte offset, strides) fully describes the
    layout and its hash is the layout fingerprint a capsule must match.

Layout: a *head* of every tensor without a sequence axis (each at an aligned offset), then
a *row block* that holds the tensors with a sequence axis position-major: row t holds step
t of every such tensor (each in its own aligned slot of the row). So the state at any
position is a prefix of the arena — the head and the first `position` rows — and a
snapshot, a restore or a host transfer is ONE contiguous copy of exactly the bytes in use,
whatever the number of layers. The sequence tensors are strided views (their step axis
strides over whole rows); attention reads them as it reads any sliced cache.

Invariants kept by everyone that writes the arena, along the row block:
  * every row at index >= the live position is zero. That is what lets a snapshot copy
    only the used prefix and a restore still reproduce the full arena byte for byte (it
    copies the prefix back and zeroes the rows the newer state used);
  * rows are append-only: a step at `position` writes rows >= position, never an earlier
    one. Only a restore or a reset rewrites old rows, and each starts a new *epoch*. So two
    states of one epoch agree on every row both have, and a restore can skip the rows the
    live state provably shares with the capsule (see rows_shared): the interrupt path,
    back to a checkpoint taken moments ago, then copies the head (recurrent and conv
    state) and zeroes the few rows written since, whatever the length of the context.
    The rollback ring's commit boundaries rely on the same: they hold the head alone
    (pack(head_only=True)) and take their rows from the live arena (state/ring.py).
A sequence tensor of another length than the row block lives in the head and is always
copied whole. A *window* (a spec with window_dim: the last rows of a stream, row t at t mod
the window's length, e.g. a sliding-window KV) lives at the end of the head, after the
*rest*: a step writes a few of its rows, so a rollback boundary can keep the rest and just
the rows the next step will overwrite (pack_delta, state/ring.py).
"""

from __future__ import annotations

import collections
import ctypes
from dataclasses import dataclass
import hashlib
import itertools
import json
import math
import sys
from typing import Iterable, Sequence

import torch

from .memory import huge_page_memory
from ..errors import FlashRTError

ALIGN = 256  # bytes; keeps every head view aligned for any dtype and for vectorized copies
SLOT_ALIGN = 16  # bytes; each tensor's slot inside a row (vector loads, every dtype)
LINEAGE_LINKS = 256  # epochs whose parent link is remembered (older ones: copy everything)
LINEAGE_WALK = 32  # parent links followed before a restore gives up and copies everything
_EPOCHS = itertools.count(1)  # process-wide, so epochs of different arenas never collide

_DTYPE_NAMES = {
    torch.float32: 'float32',
    torch.float16: 'float16',
    torch.bfloat16: 'bfloat16',
    torch.float64: 'float64',
    torch.int64: 'int64',
    torch.int32: 'int32',
    torch.int16: 'int16',
    torch.int8: 'int8',
    torch.uint8: 'uint8',
    torch.bool: 'bool',
}
_DTYPES_BY_NAME = {v: k for k, v in _DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]


def dtype_from_name(name: str) -> torch.dtype:
    return _DTYPES_BY_NAME[name]


def _align(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class StateSpec:
    """What a model adapter asks the arena for: one named state tensor."""

    name: str
    kind: str  # "kv" | "conv" | "recurrent" | "position" | "logits" | "mtp" | ...
    shape: tuple[int, ...]
    dtype: torch.dtype
    # Axis indexed by token position: only rows < position are live, rows >= position are
    # zero, and a step writes rows >= position only (append-only; see the module docstring).
    seq_dim: int | None = None
    # Axis of a window: a ring of the stream's last rows, of which a step writes only those
    # its adapter reports (StateAdapter.window_writes).
    window_dim: int | None = None


@dataclass(frozen=True)
class ManifestEntry:
    """Where one state tensor lives inside the arena."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # bytes from the arena's start to the tensor's first element
    nbytes: int  # bytes of its elements
    seq_dim: int | None = None
    strides: tuple[int, ...] | None = None  # in elements; None: contiguous (a head tensor)
    window_dim: int | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    def to_json(self) -> dict:
        return {
            'name': self.name,
            'kind': self.kind,
            'dtype': self.dtype,
            'shape': list(self.shape),
            'offset': self.offset,
            'nbytes': self.nbytes,
            'seq_dim': self.seq_dim,
            'strides': None if self.strides is None else list(self.strides),
        } | ({} if self.window_dim is None else {'window_dim': self.window_dim})

    @classmethod
    def from_json(cls, d: dict) -> 'ManifestEntry':
        return cls(
            d['name'],
            d['kind'],
            d['dtype'],
            tuple(d['shape']),
            int(d['offset']),
            int(d['nbytes']),
            d['seq_dim'],
            None if d['strides'] is None else tuple(d['strides']),
            d.get('window_dim'),
        )


@dataclass(frozen=True)
class Packing:
    """
    How a snapshot blob maps onto the arena: it is the arena's first `nbytes` bytes.

    Those are the head (every tensor outside the row block) and the first `rows` rows of
    the row block; every later row of the state it was taken from was zero.
    """

    rows: int
    nbytes: int

    def to_json(self) -> dict:
        return {'rows': self.rows, 'nbytes': self.nbytes}

    @classmethod
    def from_json(cls, d: dict) -> 'Packing':
        return cls(int(d['rows']), int(d['nbytes']))


def typed_view(
    buf: torch.Tensor, offset: int, dtype: torch.dtype, shape: Sequence[int]
) -> torch.Tensor:
    """View buf[offset:] (a flat uint8 tensor) as dtype/shape; shares memory."""
    nbytes = math.prod(shape) * dtype.itemsize
    return buf[offset:offset + nbytes].view(dtype).view(tuple(shape))


def _words(buf: torch.Tensor) -> torch.Tensor:
    """View a flat uint8 buffer as int64 words when its address and length allow (else as is)."""
    if buf.data_ptr() % 8 == 0 and buf.numel() % 8 == 0:
        return buf.view(torch.int64)
    return buf


# A CPU copy or fill of fewer bytes runs on the calling thread, as one memmove or memset.
# torch splits it over its thread pool instead, whose workers sleep after an idle moment:
# waking them costs more than the whole copy (on a VM, ms against 0.1-0.6 ms; a restore
# usually comes after an idle moment, from a thread that rarely runs torch).
SERIAL_COPY_MAX = 16 << 20


def _serial(*tensors: torch.Tensor) -> bool:
    t = tensors[0]
    return (all(x.device.type == 'cpu' and x.is_contiguous() and x.dtype == t.dtype
                and x.nbytes == t.nbytes for x in tensors) and t.nbytes < SERIAL_COPY_MAX)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """
    dst.copy_(src) (see SERIAL_COPY_MAX).

    Tensors of one dtype and size, contiguous on the CPU, are copied with memmove (torch's
    version counter is not bumped: nothing here is tracked by autograd); anything else goes
    through copy_, which converts, broadcasts or refuses as usual.
    """
    if _serial(src, dst):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.nbytes)
    else:
        dst.copy_(src)


def zero_into(t: torch.Tensor) -> None:
    """t.zero_() for a contiguous tensor (see SERIAL_COPY_MAX)."""
    if _serial(t):
        ctypes.memset(t.data_ptr(), 0, t.nbytes)
    else:
        t.zero_()


class StateArena:
    """One contiguous allocation holding every state tensor as a typed view."""

    def __init__(self, specs: Iterable[StateSpec], device: torch.device | str, align: int = ALIGN,
                 max_position: int | None = None):
        """
        Lay out `specs` in one zeroed allocation on `device`.

        max_position: the longest sequence the runtime runs, the row block's length. Sequence
        tensors of exactly that length go in the row block; a shorter or longer one (e.g. a
        rolling window) lives in the head. None: the longest sequence axis among `specs`.
        """
        self.device = torch.device(device)
        self.align = align
        specs = list(specs)
        names = set()
        for spec in specs:
            if spec.name in names:
                raise ValueError(f'duplicate state name {spec.name!r}')
            names.add(spec.name)
        seq_lens = [s.shape[s.seq_dim] for s in specs if s.seq_dim is not None]
        self.rows = max_position if max_position is not None else max(seq_lens, default=0)

        def in_rows(s: StateSpec) -> bool:
            return s.seq_dim is not None and s.shape[s.seq_dim] == self.rows > 0

        entries, offset = {}, 0
        self.rest_nbytes = None  # the head before its windows (pack_delta copies it whole)
        head = [s for s in specs if not in_rows(s)]
        for s in sorted(head, key=lambda s: s.window_dim is not None):  # windows last
            if s.window_dim is not None and self.rest_nbytes is None:
                self.rest_nbytes = offset
            nbytes = math.prod(s.shape) * s.dtype.itemsize
            entries[s.name] = ManifestEntry(s.name, s.kind, dtype_name(s.dtype), tuple(s.shape),
                                            offset, nbytes, s.seq_dim, None, s.window_dim)
            offset = _align(offset + nbytes, align)
        self.head_nbytes = offset
        if self.rest_nbytes is None:
            self.rest_nbytes = offset
        slots, row = [], 0
        for s in specs:
            if in_rows(s):
                slots.append((s, row))
                step = math.prod(s.shape) // self.rows * s.dtype.itemsize
                row = _align(row + step, SLOT_ALIGN)
        self.row_nbytes = row
        for s, slot in slots:
            size = s.dtype.itemsize
            inner = list(s.shape[:s.seq_dim]) + list(s.shape[s.seq_dim + 1:])
            strides = [math.prod(inner[i + 1:]) for i in range(len(inner))]
            strides.insert(s.seq_dim, row // size)
            entries[s.name] = ManifestEntry(
                s.name, s.kind, dtype_name(s.dtype), tuple(s.shape), offset + slot,
                math.prod(s.shape) * size, s.seq_dim, tuple(strides))
        self.manifest: tuple[ManifestEntry, ...] = tuple(entries[s.name] for s in specs)
        self.nbytes = max(_align(self.prefix_nbytes(self.rows), align), align)
        # The single allocation. Zero-filled: zero is the "no state yet" value of every component.
        self.storage = (huge_page_memory(self.nbytes) if self.device.type == 'cpu' else
                        torch.zeros(self.nbytes, dtype=torch.uint8, device=self.device))
        self.views: dict[str, torch.Tensor] = {e.name: self.view(e) for e in self.manifest}
        self._by_name = {e.name: e for e in self.manifest}
        self.seq_kinds = {e.kind for e in self.manifest if e.strides is not None}  # row block
        self.windows = tuple(e for e in self.manifest if e.window_dim is not None)
        self.epoch = next(_EPOCHS)  # changes whenever a row before the live position is rewritten
        self._parents: dict[int, tuple[int, int]] = {}  # epoch -> (parent epoch, rows shared)
        # Their keys, oldest first: dropping a dict's first key by iterating would scan the
        # deleted slots before it, which the interrupt path pays on every restore.
        self._links: collections.deque[int] = collections.deque()
        self._words = _words(self.storage)
        # False: every restore copies the whole prefix (a reference that never skips rows).
        self.skip_shared_rows = True
        layout = {'align': align, 'rows': self.rows, 'row_nbytes': self.row_nbytes,
                  'entries': [e.to_json() for e in self.manifest]}
        self.layout_fingerprint = hashlib.sha256(
            json.dumps(layout, sort_keys=True).encode()
        ).hexdigest()

    def view(self, e: ManifestEntry, buf: torch.Tensor | None = None,
             rows: int | None = None) -> torch.Tensor:
        """
        Return tensor `e` as a view of `buf`, only its first `rows` steps when given.

        buf: the arena (default) or a blob laid out as the arena's prefix.
        """
        buf = self.storage if buf is None else buf
        if e.strides is None:
            return typed_view(buf, e.offset, e.torch_dtype, e.shape)
        typed = buf.view(e.torch_dtype)
        shape = list(e.shape)
        if rows is not None:
            shape[e.seq_dim] = rows
        size = typed.element_size()
        return typed.as_strided(shape, e.strides, typed.storage_offset() + e.offset // size)

    @property
    def kinds(self) -> list[str]:
        """Component kinds present, in manifest order, without repeats."""
        return list(dict.fromkeys(e.kind for e in self.manifest))

    def entry(self, name: str) -> ManifestEntry:
        return self._by_name[name]

    def zero_(self) -> None:
        zero_into(self.storage)
        self.begin_epoch()

    # ---- lineage: which sequence rows the live state shares with a capsule ------------

    def begin_epoch(self, parent: int | None = None, rows: int = 0) -> None:
        """
        Start a new epoch: call after anything rewrote rows before the live position.

        parent/rows: the new state's first `rows` sequence rows are those of epoch `parent`
        (a restore of a capsule taken in `parent` at position `rows`).
        """
        self.epoch = next(_EPOCHS)
        if parent is not None:
            if len(self._links) >= LINEAGE_LINKS:
                del self._parents[self._links.popleft()]
            self._parents[self.epoch] = (parent, rows)
            self._links.append(self.epoch)

    def _shared(self, epoch: int | None) -> int | None:
        """Return the rows shared with epoch `epoch` (see rows_shared); None: no ancestor."""
        e, shared = self.epoch, sys.maxsize
        for _ in range(LINEAGE_WALK):
            if e == epoch:
                return shared
            link = self._parents.get(e)
            if link is None:
                return None
            e, rows = link
            shared = min(shared, rows)
        return None

    def rows_shared(self, epoch: int | None) -> int:
        """
        Return how many leading sequence rows the live state shares with epoch `epoch`.

        Any state taken in `epoch` agrees with the live one on that many rows (sys.maxsize
        within the live epoch, 0 when the lineage is unknown).
        """
        shared = self._shared(epoch)
        return 0 if shared is None else shared

    def descends(self, epoch: int | None, position: int) -> bool:
        """
        Whether the live state came from the state of `epoch` at `position` by steps alone.

        Within an epoch the state only steps forward; a restore links the epoch it begins to
        the capsule's (epoch, position). So a window holds that state's rows but for the
        ones written by the steps since (what a delta boundary keeps: state/ring.py).
        """
        shared = self._shared(epoch)
        return shared is not None and shared >= position

    def digest(self, hasher: 'hashlib._Hash') -> None:
        """Feed every arena byte to hasher (copies to host first when on an accelerator)."""
        data = self.storage if self.storage.device.type == 'cpu' else self.storage.cpu()
        hasher.update(memoryview(data.numpy()))

    # ---- snapshot / restore ----------------------------------------------------------

    def prefix_nbytes(self, rows: int) -> int:
        """Bytes of the arena prefix that holds the state at `rows` positions."""
        return self.head_nbytes + rows * self.row_nbytes

    def zero_rows(self, start: int, stop: int) -> None:
        """Zero rows [start, stop) of every row-block tensor (one contiguous range)."""
        zero_into(self.storage[self.prefix_nbytes(start):self.prefix_nbytes(stop)])

    def packing(self, position: int) -> Packing:
        """Return the packing of a snapshot at `position`: the prefix to its last used row."""
        rows = min(position, self.rows)
        return Packing(rows, self.prefix_nbytes(rows))

    def pack(self, position: int, alloc=None,
             head_only: bool = False) -> tuple[torch.Tensor, Packing]:
        """
        Copy the state at `position` into a flat uint8 blob on the arena's device: one copy.

        alloc(nbytes) returns the blob to fill (default: a new tensor); every byte is written.
        head_only: copy the head alone, not the rows (a rollback boundary that leaves its rows
        to the live arena); the packing returned is still the whole state's.
        """
        packing = self.packing(position)
        nbytes = self.head_nbytes if head_only else packing.nbytes
        blob = (
            alloc(nbytes)
            if alloc is not None
            else torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        )
        dst = _words(blob)
        copy_into(dst, self._words[:dst.numel()] if dst.dtype == self._words.dtype
                  else self.storage[:nbytes])
        return blob, packing

    # ---- delta boundaries: the rest of the head and a few window rows --------------------

    def window_rows(self, writes: dict[str, tuple[int, int]]) -> tuple[tuple, int]:
        """
        Lay out the window rows `writes` names ({name: (first row, rows)}, wrapping) in a blob.

        Returns ((entry, row, rows, blob offset), ...), a piece per run of rows that does not
        wrap, and the blob's size: the rest of the head first, then the pieces.
        """
        pieces, offset = [], self.rest_nbytes
        for e in self.windows:
            start, count = writes[e.name]
            length = e.shape[e.window_dim]
            while count > 0:
                row = start % length
                n = min(count, length - row)
                pieces.append((e, row, n, offset))
                offset = _align(offset + n * (e.nbytes // length), SLOT_ALIGN)
                start, count = start + n, count - n
        return tuple(pieces), offset

    def pack_delta(self, position: int, alloc,
                   writes: dict[str, tuple[int, int]]) -> tuple[torch.Tensor, Packing, tuple]:
        """
        Copy the rest of the head and the window rows `writes` names into a new blob.

        What a boundary needs beside the live arena when the next steps write only those
        rows (ring.py). Returns (blob, the whole state's packing, ((window entry, first row,
        their copy in the blob), ...): what put_rows writes back).
        """
        pieces, nbytes = self.window_rows(writes)
        blob = alloc(nbytes)
        copy_into(blob[:self.rest_nbytes], self.storage[:self.rest_nbytes])
        kept = []
        for e, row, n, offset in pieces:
            shape = list(e.shape)
            shape[e.window_dim] = n
            rows = typed_view(blob, offset, e.torch_dtype, shape)
            rows.copy_(self.views[e.name].narrow(e.window_dim, row, n))
            kept.append((e, row, rows))
        return blob, self.packing(position), tuple(kept)

    def put_rows(self, entries) -> int:
        """
        Write back the window rows that delta entries kept (pack_delta), oldest entry first.

        A row kept by several entries gets the oldest one's copy: the row as it was before
        any of their steps. One gather and a copy per run of rows per window. Returns the
        bytes copied.
        """
        gathered: dict[str, tuple] = {}  # name -> (entry, rows, the same as a set, copies)
        for entry in entries:
            for e, row, kept in entry.window_rows:
                _, rows, seen, copies = gathered.setdefault(e.name, (e, [], set(), []))
                n = kept.shape[e.window_dim]
                new = [i for i in range(n) if row + i not in seen]
                if len(new) == n:
                    copies.append(kept)
                else:  # the window went round: only the rows not put yet
                    copies += [kept.narrow(e.window_dim, i, 1) for i in new]
                added = [row + i for i in new]  # rows of the window (pieces do not wrap)
                rows += added
                seen.update(added)
        copied = 0
        for e, rows, _, copies in gathered.values():
            src = copies[0] if len(copies) == 1 else torch.cat(copies, e.window_dim)
            view, start = self.views[e.name], 0
            for end in range(1, len(rows) + 1):  # one copy per run of consecutive rows
                if end == len(rows) or rows[end] != rows[end - 1] + 1:
                    view.narrow(e.window_dim, rows[start], end - start).copy_(
                        src.narrow(e.window_dim, start, end - start))
                    start = end
            copied += src.nbytes
        return copied

    def put_windows(self, blob: torch.Tensor) -> int:
        """Copy every window from a blob that holds the whole head; return the bytes copied."""
        copy_into(self.storage[self.rest_nbytes:self.head_nbytes],
                  blob[self.rest_nbytes:self.head_nbytes])
        return self.head_nbytes - self.rest_nbytes

    def copy_pair(self, blob: torch.Tensor, packing: Packing,
                  skip_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """
        Return (arena destination, blob source) of a restore.

        The blob's whole prefix, or with skip_rows only the head (the caller knows the live
        state holds the rows: see rows_shared). Views only; a caller may keep them for
        repeated restores of one blob.
        """
        src = _words(blob[:self.head_nbytes] if skip_rows else blob)
        dst = self._words if src.dtype == self._words.dtype else self.storage
        return dst[:src.numel()], src

    def unpack(
        self,
        blob: torch.Tensor,
        packing: Packing,
        live_rows: int,
        lineage: tuple[int | None, int] = (None, 0),
        kinds: set[str] | None = None,
        views: dict | None = None,
        rest_only: bool = False,
    ) -> tuple[int, torch.Tensor]:
        """
        Copy a snapshot blob back into the arena in place; return (bytes copied, source).

        lineage: (epoch, position) of the snapshot, the parent of the epoch this begins.
        kinds=None restores everything in one copy, without the sequence rows the live state
        shares with the snapshot (rows_shared). A blob on another device is transferred
        first, its head only when the rows are left out; the source returned is then that
        transfer, else the blob. `views`, a dict kept with an immutable blob, holds the
        copy's views for the next restore of it. A set of kinds restores only entries of
        those kinds (the KV-only ablation), tensor by tensor. Rows a newer state wrote past
        the snapshot's (up to live_rows) are zeroed in every row-block tensor, of a
        restored kind or not, which re-establishes the zero-tail invariant. rest_only: the
        blob is a delta boundary's (pack_delta); only the head before the windows is copied.
        """
        stale = min(max(live_rows, packing.rows), self.rows)
        if rest_only:
            blob = blob[:self.rest_nbytes]  # its window rows go back apart (put_rows)
        if kinds is None:
            skip = self.skip_shared_rows and self.rows_shared(lineage[0]) >= packing.rows
            if blob.numel() < packing.nbytes and not skip:
                raise FlashRTError('a head-only boundary whose sequence rows the live state '
                                   'no longer holds cannot be restored')
            key = 'head' if skip else 'prefix'
            pair = None if views is None else views.get(key)
            if pair is None:
                if blob.device != self.device:  # e.g. a pinned host -> device DMA
                    blob = (blob[:self.head_nbytes] if skip else blob).to(
                        self.device, non_blocking=True)
                    pair = self.copy_pair(blob, packing, skip)
                else:
                    pair = self.copy_pair(blob, packing, skip)
                    if views is not None:
                        views[key] = pair
            dst, src = pair
            copy_into(dst, src)
            if stale > packing.rows:
                self.zero_rows(packing.rows, stale)
            self.begin_epoch(*lineage)
            return src.nbytes, blob
        if blob.numel() < packing.nbytes:
            raise FlashRTError('a head-only boundary restores in full mode only')
        if not self.seq_kinds | {e.kind for e in self.windows} <= kinds:
            lineage = (None, 0)  # some rows stay the live state's, not the capsule's
        if blob.device != self.device:
            blob = blob.to(self.device, non_blocking=True)
        src = blob
        if blob.data_ptr() % SLOT_ALIGN:
            src = blob.clone()  # typed views need aligned elements (a mapped disk blob)
        copied = 0
        for e in self.manifest:
            rows = None if e.strides is None else packing.rows
            if e.kind in kinds:
                self.view(e, rows=rows).copy_(self.view(e, src, rows))
                copied += e.nbytes if rows is None else e.nbytes // self.rows * rows
            # Rows past the position are zero in every tensor that cannot roll, of a restored
            # kind or not (one longer than the row block lives in the head).
            if e.seq_dim is not None and e.shape[e.seq_dim] >= self.rows > 0 and (
                    stale > packing.rows):
                self.view(e).narrow(e.seq_dim, packing.rows, stale - packing.rows).zero_()
        self.begin_epoch(*lineage)
        return copied, blob
