"""
StateArena: the one owner of every state buffer of the model.

All state tensors (attention K/V, conv state, recurrent/SSM state, position counters, the
last logits, ...) are typed views into ONE contiguous, aligned uint8 allocation per
device. The arena is allocated once and only ever written in place, so:
  * addresses never move (a captured CUDA graph stays valid across restores);
  * a snapshot is a copy of arena bytes, a restore is a copy back (no re-binding);
  * the manifest (name, kind, dtype, shape, byte offset) fully describes the layout and
    its hash is the layout fingerprint a capsule must match.

Invariants kept by everyone that writes the arena, along a tensor's sequence axis
(`seq_dim`, the KV time axis):
  * every row at index >= the live position is zero. That is what lets a snapshot copy
    only the used prefix and a restore still reproduce the full arena byte for byte (it
    copies the prefix back and zeroes the rows the newer state used);
  * rows are append-only: a step at `position` writes rows >= position, never an earlier
    one. Only a restore or a reset rewrites old rows, and each starts a new *epoch*. So two
    states of one epoch agree on every row both have, and a restore can skip the rows the
    live state provably shares with the capsule (see rows_shared): the interrupt path,
    back to a checkpoint taken moments ago, then copies the recurrent and conv state and
    zeroes the few rows written since, whatever the length of the context.
"""

from __future__ import annotations

from dataclasses import dataclass
import hashlib
import itertools
import json
import sys
from typing import Iterable, Sequence

import torch

ALIGN = 256  # bytes; keeps every view aligned for any dtype and for vectorized copies
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


@dataclass(frozen=True)
class ManifestEntry:
    """Where one state tensor lives inside the arena."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    seq_dim: int | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    def row_nbytes(self) -> int:
        """Bytes of one step along seq_dim (the whole tensor when it has no seq axis)."""
        if self.seq_dim is None:
            return self.nbytes
        return self.nbytes // self.shape[self.seq_dim]

    def to_json(self) -> dict:
        return {
            'name': self.name,
            'kind': self.kind,
            'dtype': self.dtype,
            'shape': list(self.shape),
            'offset': self.offset,
            'nbytes': self.nbytes,
            'seq_dim': self.seq_dim,
        }

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
        )


@dataclass(frozen=True)
class Segment:
    """One state tensor inside a snapshot blob: `rows` leading positions (None = all of it)."""

    name: str
    rows: int | None
    offset: int
    nbytes: int


@dataclass(frozen=True)
class _Run:
    """
    One strided byte copy between the arena and a blob, covering one or more state tensors.

    In the arena the run is `count` tensors `stride` bytes apart, each `outer` pieces of
    `rows * row` bytes that are `seq_len * row` bytes apart (rows=None: one flat range of
    `row` bytes). In the blob the same bytes lie dense from `blob_offset`.
    """

    arena_offset: int
    blob_offset: int
    count: int
    stride: int
    outer: int
    seq_len: int
    row: int
    rows: int | None
    last: int  # manifest index of the run's last tensor (runs only grow over neighbours)

    @property
    def shape(self) -> tuple[int, int, int]:
        run = self.row if self.rows is None else self.rows * self.row
        return (self.count, self.outer, run)

    @property
    def nbytes(self) -> int:
        count, outer, run = self.shape
        return count * outer * run

    def word(self, blob_start: int = 0) -> torch.dtype:
        """
        Pick the widest integer type every offset and length of the run divides into.

        Copying int64 words instead of bytes makes 8x fewer elements: a state of up to
        256 KiB then stays under ATen's parallel grain and is copied by the calling thread
        alone. Waking an OpenMP team from a thread that rarely runs torch (a ROS executor
        thread serving ~/restore) costs more than such a copy.
        """
        bits = self.arena_offset | self.blob_offset | self.row | blob_start
        if self.count > 1:
            bits |= self.stride
        return next(dtype for size, dtype in _WORDS if bits % size == 0)

    def arena_view(self, words: dict, rows: tuple[int, int] | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
        """Return the run's part of the arena (`words`: the storage viewed per word type)."""
        dtype = dtype or self.word()
        storage, w = words[dtype], words[dtype].element_size()
        if self.rows is None:
            return storage[self.arena_offset // w:(self.arena_offset + self.row) // w].view(
                1, 1, -1)
        start, stop = rows if rows is not None else (0, self.rows)
        return storage.as_strided((self.count, self.outer, (stop - start) * self.row // w),
                                  (self.stride // w, self.seq_len * self.row // w, 1),
                                  (self.arena_offset + start * self.row) // w)

    def blob_view(self, blob: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        piece = blob[self.blob_offset:self.blob_offset + self.nbytes].view(dtype or self.word())
        return piece.view(self.count, self.outer, -1)


_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


@dataclass(frozen=True)
class Packing:
    """
    How a snapshot blob maps back onto the arena.

    whole=True means the blob is a byte copy of the entire arena (one copy each way);
    otherwise it holds only the segments, each aligned, used KV prefixes only.
    """

    whole: bool
    segments: tuple[Segment, ...]
    nbytes: int

    def to_json(self) -> dict:
        return {
            'whole': self.whole,
            'nbytes': self.nbytes,
            'segments': [[s.name, s.rows, s.offset, s.nbytes] for s in self.segments],
        }

    @classmethod
    def from_json(cls, d: dict) -> 'Packing':
        segs = tuple(Segment(n, r, int(o), int(b)) for n, r, o, b in d['segments'])
        return cls(bool(d['whole']), segs, int(d['nbytes']))


def typed_view(
    buf: torch.Tensor, offset: int, dtype: torch.dtype, shape: Sequence[int]
) -> torch.Tensor:
    """View buf[offset:] (a flat uint8 tensor) as dtype/shape; shares memory."""
    count = 1
    for s in shape:
        count *= s
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    return buf[offset:offset + nbytes].view(dtype).view(tuple(shape))


class StateArena:
    """One contiguous allocation holding every state tensor as a typed view."""

    def __init__(self, specs: Iterable[StateSpec], device: torch.device | str, align: int = ALIGN,
                 max_position: int | None = None):
        """
        Lay out `specs` in one zeroed allocation on `device`.

        max_position: the longest sequence the runtime runs. Sequence tensors at least that
        long are append-only over a whole sequence, so a restore may skip the rows the live
        state shares with the capsule; a shorter one (a rolling window of recent steps) is
        always copied. None: every one is always copied.
        """
        self.device = torch.device(device)
        self.align = align
        self.max_position = max_position
        # Order: every tensor without a sequence axis first (one dense region a snapshot copies
        # as one range), then the KV tensors grouped by layout (equal dtype and shape), so a
        # snapshot or restore is a few strided copies whatever the number of layers.
        groups: dict[tuple, int] = {}
        specs = list(specs)
        keys = [0 if s.seq_dim is None
                else 1 + groups.setdefault((s.dtype, tuple(s.shape), s.seq_dim), len(groups))
                for s in specs]
        specs = [s for _, _, s in sorted(zip(keys, range(len(specs)), specs))]
        entries, offset = [], 0
        names = set()
        for spec in specs:
            if spec.name in names:
                raise ValueError(f'duplicate state name {spec.name!r}')
            names.add(spec.name)
            count = 1
            for s in spec.shape:
                count *= s
            nbytes = count * torch.empty((), dtype=spec.dtype).element_size()
            entries.append(ManifestEntry(spec.name, spec.kind, dtype_name(spec.dtype),
                                         tuple(spec.shape), offset, nbytes, spec.seq_dim))
            offset = _align(offset + nbytes, align)
        self.manifest: tuple[ManifestEntry, ...] = tuple(entries)
        self.nbytes = max(offset, align)
        # The single allocation. Zero-filled: zero is the "no state yet" value of every component.
        self.storage = torch.zeros(self.nbytes, dtype=torch.uint8, device=self.device)
        self.views: dict[str, torch.Tensor] = {
            e.name: typed_view(self.storage, e.offset, e.torch_dtype, e.shape)
            for e in self.manifest
        }
        self._by_name = {e.name: e for e in self.manifest}
        self._index = {e.name: i for i, e in enumerate(self.manifest)}
        self._seq_kinds = {e.kind for e in self.manifest if e.seq_dim is not None}
        self._pack_plans: dict[tuple[int, bool], tuple] = {}
        self._restore_plans: dict[tuple, tuple] = {}
        self.epoch = next(_EPOCHS)  # changes whenever a row before the live position is rewritten
        self._parents: dict[int, tuple[int, int]] = {}  # epoch -> (parent epoch, rows shared)
        # The storage as words of every width (nbytes is a multiple of ALIGN) for _Run views.
        self._words = {dtype: self.storage.view(dtype) for _, dtype in _WORDS}
        layout = {'align': align, 'entries': [e.to_json() for e in self.manifest]}
        self.layout_fingerprint = hashlib.sha256(
            json.dumps(layout, sort_keys=True).encode()
        ).hexdigest()

    @property
    def kinds(self) -> list[str]:
        """Component kinds present, in manifest order, without repeats."""
        return list(dict.fromkeys(e.kind for e in self.manifest))

    def entry(self, name: str) -> ManifestEntry:
        return self._by_name[name]

    def zero_(self) -> None:
        self.storage.zero_()
        self.begin_epoch()

    # ---- lineage: which sequence rows the live state shares with a capsule ------------

    def begin_epoch(self, parent: int | None = None, rows: int = 0) -> None:
        """
        Start a new epoch: call after anything rewrote rows before the live position.

        parent/rows: the new state's first `rows` sequence rows are those of epoch `parent`
        (a restore of a capsule taken in `parent` at position `rows`).
        """
        self.epoch = next(_EPOCHS)
        if parent is not None and rows > 0:
            if len(self._parents) >= LINEAGE_LINKS:
                del self._parents[next(iter(self._parents))]  # the oldest link
            self._parents[self.epoch] = (parent, rows)

    def rows_shared(self, epoch: int | None) -> int:
        """
        Return how many leading sequence rows the live state shares with epoch `epoch`.

        Any state taken in `epoch` agrees with the live one on that many rows (sys.maxsize
        within the live epoch, 0 when the lineage is unknown).
        """
        e, shared = self.epoch, sys.maxsize
        for _ in range(LINEAGE_WALK):
            if e == epoch:
                return shared
            link = self._parents.get(e)
            if link is None:
                return 0
            e, rows = link
            shared = min(shared, rows)
        return 0

    def digest(self, hasher: 'hashlib._Hash') -> None:
        """Feed every arena byte to hasher (copies to host first when on an accelerator)."""
        data = self.storage if self.storage.device.type == 'cpu' else self.storage.cpu()
        hasher.update(memoryview(data.numpy()))

    # ---- snapshot / restore helpers -------------------------------------------------

    def plan(self, position: int, whole: bool) -> Packing:
        """
        Lay out a snapshot blob at `position`: the whole arena, or only the live parts.

        A packed blob keeps the tensors without a sequence axis at their arena offsets (the
        arena puts them first, so they are one range) and the used rows of every KV tensor
        dense after them.
        """
        if whole:
            segs = tuple(
                Segment(
                    e.name, None if e.seq_dim is None else e.shape[e.seq_dim], e.offset, e.nbytes
                )
                for e in self.manifest
            )
            return Packing(True, segs, self.nbytes)
        segs, cursor = [], 0
        for e in self.manifest:
            rows = None if e.seq_dim is None else min(position, e.shape[e.seq_dim])
            nbytes = e.nbytes if rows is None else rows * e.row_nbytes()
            offset = _align(cursor, self.align) if rows is None else cursor
            segs.append(Segment(e.name, rows, offset, nbytes))
            cursor = offset + nbytes
        return Packing(False, tuple(segs), cursor)

    def choose_whole(self, position: int) -> bool:
        """
        Whether one whole-arena copy is cheaper than copying the used rows only.

        A rough cost model, time = bytes / bandwidth + copies * launch overhead: on a GPU
        each extra copy is a kernel launch (~5 us) while bandwidth is huge, so one big copy
        usually wins; on a CPU copies are cheap to start and bandwidth is the limit.
        """
        packing, runs, _ = self._pack_plan(position, False)
        if self.device.type == 'cuda':
            bytes_per_us, launch_us = 500e3, 6.0
        else:
            bytes_per_us, launch_us = 10e3, 2.0
        t_whole = self.nbytes / bytes_per_us + launch_us
        t_packed = packing.nbytes / bytes_per_us + len(runs) * launch_us
        return t_whole <= t_packed

    def runs(self, packing: Packing, kinds: set[str] | None = None) -> list[_Run]:
        """
        Merge a packing's segments into as few strided copies as the layout allows.

        Neighbouring tensors without a sequence axis (or with all rows used) merge into one
        flat range when they sit equally far apart in the arena and the blob; neighbouring
        KV tensors of one layout merge into one [count, outer, rows * row] copy. `kinds`
        keeps only tensors of those kinds; a tensor left out breaks a run.
        """
        runs: list[_Run] = []
        for seg in packing.segments:
            index, e = self._index[seg.name], self._by_name[seg.name]
            if kinds is not None and e.kind not in kinds:
                continue
            last = runs[-1] if runs and runs[-1].last == index - 1 else None
            seq_len = 0 if e.seq_dim is None else e.shape[e.seq_dim]
            if seg.rows is None or seg.rows == seq_len:  # one flat range
                arena_gap = e.offset - (last.arena_offset + last.row) if last else -1
                blob_gap = seg.offset - (last.blob_offset + last.row) if last else -1
                if last is not None and last.rows is None and arena_gap == blob_gap >= 0:
                    runs[-1] = _Run(last.arena_offset, last.blob_offset, 1, 0, 1, 0,
                                    e.offset + seg.nbytes - last.arena_offset, None, index)
                else:
                    runs.append(_Run(e.offset, seg.offset, 1, 0, 1, 0, seg.nbytes, None, index))
                continue
            outer = 1
            for s in e.shape[:e.seq_dim]:
                outer *= s
            row = e.nbytes // (outer * seq_len)
            if (last is not None and last.rows == seg.rows and last.outer == outer
                    and last.row == row and last.seq_len == seq_len
                    and seg.offset == last.blob_offset + last.nbytes):
                stride = e.offset - last.arena_offset if last.count == 1 else last.stride
                if e.offset == last.arena_offset + last.count * stride:
                    runs[-1] = _Run(last.arena_offset, last.blob_offset, last.count + 1, stride,
                                    outer, seq_len, row, seg.rows, index)
                    continue
            runs.append(_Run(e.offset, seg.offset, 1, e.nbytes, outer, seq_len, row,
                             seg.rows, index))
        return runs

    def _pack_plan(self, position: int, whole: bool) -> tuple:
        """
        (packing, runs, arena views) for pack(), built once per (position, whole).

        Kept for the last few positions: the views are of the arena (which never moves), so
        a snapshot only allocates the blob and copies every run in one fused call.
        """
        key = (position if not whole else -1, whole)
        plan = self._pack_plans.get(key)
        if plan is not None:
            return plan
        packing = self.plan(position, whole)
        runs = [] if whole else [r for r in self.runs(packing) if r.nbytes]
        plan = (packing, runs, [r.arena_view(self._words) for r in runs])
        if len(self._pack_plans) >= 8:
            self._pack_plans.clear()  # a few positions are hot (prefill end, turn ends)
        self._pack_plans[key] = plan
        return plan

    def pack(
        self, position: int, whole: bool, alloc=None
    ) -> tuple[torch.Tensor, Packing]:
        """
        Copy the state at `position` into a flat uint8 blob on the arena's device.

        alloc(nbytes) returns the blob to fill (default: a new tensor); every byte of it is
        written.
        """
        packing, runs, views = self._pack_plan(position, whole)
        blob = (
            alloc(packing.nbytes)
            if alloc is not None
            else torch.empty(packing.nbytes, dtype=torch.uint8, device=self.device)
        )
        if whole:
            arena, words = self._whole(blob)
            words.copy_(arena)  # one copy, memcpy speed
        elif runs:
            torch._foreach_copy_([r.blob_view(blob, v.dtype) for r, v in zip(runs, views)],
                                 views)
        return blob, packing

    def _whole(self, blob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(arena, blob) of a whole-arena copy, as int64 words when the blob's start allows."""
        dtype = torch.int64 if blob.storage_offset() % 8 == 0 else torch.uint8
        return self._words[dtype], blob.view(dtype)

    def copy_pairs(
        self, blob: torch.Tensor, packing: Packing, kinds: set[str] | None = None,
        skip_rows: bool = False,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[_Run], int]:
        """
        (arena destinations, blob sources, runs with rows, bytes copied) for a restore.

        skip_rows leaves out every copy of sequence rows: the caller knows the live state
        already holds them (rows_shared); their stale tails are still zeroed.
        """
        start = blob.storage_offset()
        key = (packing, None if kinds is None else tuple(sorted(kinds)), start % 8, skip_rows)
        plan = self._restore_plans.get(key)
        if plan is None:  # the arena side depends on the packing only: shared by capsules
            runs = self.runs(packing, kinds)
            copied = [(r, r.word(start)) for r in runs if r.nbytes and not (
                skip_rows and r.rows is not None and self.max_position is not None
                and r.seq_len >= self.max_position)]
            plan = (copied, [r.arena_view(self._words, dtype=d) for r, d in copied],
                    [r for r in runs if r.rows is not None], sum(r.nbytes for r, _ in copied))
            if len(self._restore_plans) >= 16:
                self._restore_plans.clear()
            self._restore_plans[key] = plan
        copied, dsts, partial, nbytes = plan
        return dsts, [r.blob_view(blob, d) for r, d in copied], partial, nbytes

    def unpack(
        self,
        blob: torch.Tensor,
        packing: Packing,
        live_position: int,
        kinds: set[str] | None = None,
        pairs: tuple | None = None,
        lineage: tuple[int | None, int] = (None, 0),
    ) -> int:
        """
        Copy a snapshot blob back into the arena in place; return the bytes copied.

        kinds=None restores everything; a set restores only entries of those kinds (the
        KV-only ablation). Rows a newer state wrote past the snapshot's prefix (up to
        live_position) are zeroed, which re-establishes the zero-tail invariant. `pairs`
        (from copy_pairs) may skip the sequence rows the live state already shares.
        lineage: (epoch, position) of the capsule, the parent of the epoch this begins.
        """
        if packing.whole and kinds is None:
            arena, words = self._whole(blob)
            arena.copy_(words)  # one copy; the tail comes back as it was
            self.begin_epoch(*lineage)
            return self.nbytes
        if kinds is not None and not self._seq_kinds <= kinds:
            lineage = (None, 0)  # some sequence rows stay the live state's, not the capsule's
        dsts, srcs, partial, nbytes = (
            pairs if pairs is not None else self.copy_pairs(blob, packing, kinds))
        if dsts:
            torch._foreach_copy_(dsts, srcs)  # one call for all runs
        for r in partial:
            stale_end = min(max(live_position, r.rows), r.seq_len)
            if stale_end > r.rows:
                r.arena_view(self._words, (r.rows, stale_end)).zero_()
        self.begin_epoch(*lineage)
        return nbytes

    def check_compatible(self, manifest: Sequence[ManifestEntry]) -> bool:
        return tuple(manifest) == self.manifest
