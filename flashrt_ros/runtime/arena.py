"""
StateArena: the one owner of every state buffer of the model.

All state tensors (attention K/V, conv state, recurrent/SSM state, position counters, the
last logits, ...) are typed views into ONE contiguous, aligned uint8 allocation per
device. The arena is allocated once and only ever written in place, so:
  * addresses never move (a captured CUDA graph stays valid across restores);
  * a snapshot is a copy of arena bytes, a restore is a copy back (no re-binding);
  * the manifest (name, kind, dtype, shape, byte offset) fully describes the layout and
    its hash is the layout fingerprint a capsule must match.

Invariant kept by everyone that writes the arena: along a tensor's sequence axis
(`seq_dim`, the KV time axis) every row at index >= the live position is zero. That is
what lets a snapshot copy only the used prefix and a restore still reproduce the full
arena byte for byte (it copies the prefix back and zeroes the rows the newer state used).
"""

from __future__ import annotations

from dataclasses import dataclass
import hashlib
import json
from typing import Iterable, Sequence

import torch

ALIGN = 256  # bytes; keeps every view aligned for any dtype and for vectorized copies

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
    seq_dim: int | None = None  # axis indexed by token position; only rows < position are live


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


def _narrow_rows(t: torch.Tensor, seq_dim: int | None, start: int, stop: int) -> torch.Tensor:
    return t if seq_dim is None else t.narrow(seq_dim, start, stop - start)


class StateArena:
    """One contiguous allocation holding every state tensor as a typed view."""

    def __init__(self, specs: Iterable[StateSpec], device: torch.device | str, align: int = ALIGN):
        self.device = torch.device(device)
        self.align = align
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
        self._pack_plans: dict[tuple[int, bool], tuple] = {}
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

    def digest(self, hasher: 'hashlib._Hash') -> None:
        """Feed every arena byte to hasher (copies to host first when on an accelerator)."""
        data = self.storage if self.storage.device.type == 'cpu' else self.storage.cpu()
        hasher.update(memoryview(data.numpy()))

    # ---- snapshot / restore helpers -------------------------------------------------

    def plan(self, position: int, whole: bool) -> Packing:
        """Lay out a snapshot blob at `position`: the whole arena, or only the live parts."""
        if whole:
            segs = tuple(
                Segment(
                    e.name, None if e.seq_dim is None else e.shape[e.seq_dim], e.offset, e.nbytes
                )
                for e in self.manifest
            )
            return Packing(True, segs, self.nbytes)
        segs, offset = [], 0
        for e in self.manifest:
            rows = None if e.seq_dim is None else min(position, e.shape[e.seq_dim])
            nbytes = e.nbytes if rows is None else rows * e.row_nbytes()
            segs.append(Segment(e.name, rows, offset, nbytes))
            offset = _align(offset + nbytes, self.align)
        return Packing(False, tuple(segs), max(offset, self.align))

    def choose_whole(self, position: int) -> bool:
        """
        Whether one whole-arena copy is cheaper than per-tensor prefix copies.

        A rough cost model, time = bytes / bandwidth + copies * launch overhead: on a GPU
        each extra copy is a kernel launch (~5 us) while bandwidth is huge, so one big copy
        usually wins; on a CPU copies are cheap to start and bandwidth is the limit.
        """
        packed = self._pack_plan(position, False)[0]
        if self.device.type == 'cuda':
            bytes_per_us, launch_us = 500e3, 6.0
        else:
            bytes_per_us, launch_us = 10e3, 2.0
        t_whole = self.nbytes / bytes_per_us + launch_us
        t_packed = packed.nbytes / bytes_per_us + len(packed.segments) * launch_us
        return t_whole <= t_packed

    def _pack_plan(self, position: int, whole: bool) -> tuple:
        """
        (packing, split sizes, [(piece index, view shape)], arena sources) for pack().

        Built once per (position, whole) and kept for the last few positions: the sources
        are uint8 views of the arena (which never moves), so a snapshot only allocates the
        blob, splits it into pieces (one call) and copies every segment in one fused call.
        """
        key = (position if not whole else -1, whole)
        plan = self._pack_plans.get(key)
        if plan is not None:
            return plan
        packing = self.plan(position, whole)
        sizes, targets, srcs, cursor = [], [], [], 0
        if not whole:
            for seg in packing.segments:
                if seg.nbytes == 0:
                    continue
                e = self._by_name[seg.name]
                if seg.offset > cursor:
                    sizes.append(seg.offset - cursor)  # alignment padding, left as allocated
                if seg.rows is None:
                    outer, run, stride = 1, e.nbytes, e.nbytes
                else:
                    outer = 1
                    for s in e.shape[:e.seq_dim]:
                        outer *= s
                    inner = e.nbytes // (outer * e.shape[e.seq_dim])  # bytes of one row
                    run, stride = seg.rows * inner, e.shape[e.seq_dim] * inner
                # Byte views: [outer, rows * inner] strided in the arena, dense in the blob.
                targets.append((len(sizes), (outer, run)))
                sizes.append(seg.nbytes)
                srcs.append(self.storage.as_strided((outer, run), (stride, 1), e.offset))
                cursor = seg.offset + seg.nbytes
            if packing.nbytes > cursor:
                sizes.append(packing.nbytes - cursor)
        plan = (packing, sizes, targets, srcs)
        if len(self._pack_plans) >= 8:
            self._pack_plans.clear()  # a few positions are hot (prefill end, turn ends)
        self._pack_plans[key] = plan
        return plan

    def pack(
        self, position: int, whole: bool, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Packing]:
        """Copy the state at `position` into a flat uint8 blob on the arena's device."""
        packing, sizes, targets, srcs = self._pack_plan(position, whole)
        blob = (
            out
            if out is not None
            else torch.empty(packing.nbytes, dtype=torch.uint8, device=self.device)
        )
        if whole:
            blob.copy_(self.storage)  # [nbytes] one copy, memcpy speed
            return blob, packing
        if srcs:
            pieces = blob[:packing.nbytes].split_with_sizes(sizes)
            torch._foreach_copy_([pieces[i].view(shape) for i, shape in targets], srcs)
        return blob, packing

    def copy_pairs(
        self, blob: torch.Tensor, packing: Packing, kinds: set[str] | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(arena destinations, blob sources) for a restore; build once per capsule, reuse."""
        dsts, srcs = [], []
        for seg in packing.segments:
            e = self._by_name[seg.name]
            if kinds is not None and e.kind not in kinds:
                continue
            shape = list(e.shape)
            if seg.rows is not None:
                shape[e.seq_dim] = seg.rows
            dsts.append(_narrow_rows(self.views[e.name], e.seq_dim, 0, seg.rows or 0))
            srcs.append(typed_view(blob, seg.offset, e.torch_dtype, shape))
        return dsts, srcs

    def unpack(
        self,
        blob: torch.Tensor,
        packing: Packing,
        live_position: int,
        kinds: set[str] | None = None,
        pairs: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
    ) -> None:
        """
        Copy a snapshot blob back into the arena in place.

        kinds=None restores everything; a set restores only entries of those kinds (the
        KV-only ablation). Rows a newer state wrote past the snapshot's prefix (up to
        live_position) are zeroed, which re-establishes the zero-tail invariant.
        """
        if packing.whole and kinds is None:
            self.storage.copy_(blob)  # [nbytes] one copy; the tail comes back as it was
            return
        dsts, srcs = pairs if pairs is not None else self.copy_pairs(blob, packing, kinds)
        torch._foreach_copy_(dsts, srcs)  # one call for all segments (mixed dtypes, strided KV)
        for seg in packing.segments:
            e = self._by_name[seg.name]
            if seg.rows is None or (kinds is not None and e.kind not in kinds):
                continue
            stale_end = min(max(live_position, seg.rows), e.shape[e.seq_dim])
            if stale_end > seg.rows:
                self.views[e.name].narrow(e.seq_dim, seg.rows, stale_end - seg.rows).zero_()

    def check_compatible(self, manifest: Sequence[ManifestEntry]) -> bool:
        return tuple(manifest) == self.manifest
