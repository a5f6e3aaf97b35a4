"""StateArena: one allocation, typed views, a state that is a prefix of it, one-copy capsules."""

import ctypes
import hashlib

from flashrt_ros.runtime.state import arena as arena_module
from flashrt_ros.runtime.state.arena import ALIGN, LINEAGE_LINKS, SLOT_ALIGN, StateArena, StateSpec
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _specs(max_len=16):
    return [
        StateSpec('L0.conv0', 'conv', (1, 24, 4), torch.bfloat16),
        StateSpec('L0.recurrent0', 'recurrent', (1, 2, 8, 8), torch.float32),
        StateSpec('L1.key', 'kv', (1, 2, max_len, 8), torch.bfloat16, seq_dim=2),
        StateSpec('L1.value', 'kv', (1, 2, max_len, 8), torch.bfloat16, seq_dim=2),
        StateSpec('L1.length', 'position', (), torch.int64),
        StateSpec('tokens', 'tokens', (max_len,), torch.int32, seq_dim=0),
    ]


def _digest(arena):
    h = hashlib.sha256()
    arena.digest(h)
    return h.hexdigest()


def _advance(arena, start, stop, seed):
    """Write state the way a model does: new KV rows at [start, stop), the rest overwritten."""
    g = torch.Generator().manual_seed(seed)
    for name, t in arena.views.items():
        e = arena.entry(name)
        if e.seq_dim is None:
            t.copy_(torch.randint(-100, 100, t.shape, generator=g).to(t.dtype))
        else:
            rows = t.narrow(e.seq_dim, start, stop - start)
            rows.copy_(torch.randint(1, 100, rows.shape, generator=g).to(t.dtype))


def test_views_share_one_aligned_allocation():
    arena = StateArena(_specs(), 'cpu')
    base = arena.storage.data_ptr()
    end = base + arena.nbytes
    for e in arena.manifest:
        view = arena.views[e.name]
        assert view.dtype == e.torch_dtype and tuple(view.shape) == e.shape
        assert base + e.offset == view.data_ptr()
        if e.seq_dim is None:  # head: contiguous, aligned
            assert e.offset % ALIGN == 0 and view.is_contiguous()
            assert view.data_ptr() + e.nbytes <= end
        else:  # row block: one step of the tensor per row
            assert e.offset % SLOT_ALIGN == 0 and e.offset >= arena.head_nbytes
            assert view.stride(e.seq_dim) * view.element_size() == arena.row_nbytes
            last = view.select(e.seq_dim, e.shape[e.seq_dim] - 1)
            assert last.data_ptr() + last.numel() * last.element_size() <= end
    arena.views['L0.recurrent0'].fill_(1.5)  # writes land in the one storage
    assert arena.storage.count_nonzero() > 0
    assert {e.dtype for e in arena.manifest} == {'bfloat16', 'float32', 'int64', 'int32'}


def test_state_at_a_position_is_a_prefix_of_the_arena():
    """Step t writes only the head and row t: the state at p is the first prefix_nbytes(p)."""
    arena = StateArena(_specs(), 'cpu')
    for t in range(6):
        before = arena.storage.clone()
        _advance(arena, t, t + 1, seed=t)
        changed = (arena.storage != before).nonzero().flatten()
        lo, hi = arena.prefix_nbytes(t), arena.prefix_nbytes(t + 1)
        assert all(i < arena.head_nbytes or lo <= i < hi for i in changed.tolist())
        assert arena.storage[hi:].count_nonzero() == 0
    assert arena.packing(6).nbytes == arena.prefix_nbytes(6) < arena.nbytes


def _copies(fn, monkeypatch):
    """Count the copies fn makes: aten copy_ calls and memmoves (arena.copy_into)."""
    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.copy_.default:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    memmove = ctypes.memmove

    def counted(*args):
        Count.n += 1
        return memmove(*args)

    with monkeypatch.context() as m:
        m.setattr(ctypes, 'memmove', counted)
        with Count():
            fn()
    return Count.n


def test_layout_fingerprint_tracks_shapes():
    assert (
        StateArena(_specs(16), 'cpu').layout_fingerprint
        == StateArena(_specs(16), 'cpu').layout_fingerprint
    )
    assert (
        StateArena(_specs(16), 'cpu').layout_fingerprint
        != StateArena(_specs(32), 'cpu').layout_fingerprint
    )


@pytest.mark.parametrize('position', [5, 16])
def test_pack_unpack_restores_every_byte(position):
    arena = StateArena(_specs(), 'cpu')
    _advance(arena, 0, position, seed=1)
    snap_digest = _digest(arena)
    blob, packing = arena.pack(position)
    assert packing.rows == position and blob.numel() == arena.prefix_nbytes(position)
    _advance(arena, 0, 0, seed=2)  # a newer state changed the head...
    _advance(arena, position, 16, seed=3)  # ...and wrote the rows after the snapshot's
    assert _digest(arena) != snap_digest
    arena.unpack(blob, packing, live_rows=16)
    assert _digest(arena) == snap_digest  # stale rows past the prefix were zeroed


def test_restore_skipping_shared_rows_copies_the_head_only():
    arena = StateArena(_specs(), 'cpu')
    _advance(arena, 0, 5, seed=4)
    snap_digest = _digest(arena)
    blob, packing = arena.pack(5)
    epoch = arena.epoch
    _advance(arena, 5, 9, seed=5)  # same lineage: rows 0..4 untouched
    copied, _ = arena.unpack(blob, packing, live_rows=9, lineage=(epoch, 5))
    assert copied == arena.head_nbytes and _digest(arena) == snap_digest


def test_rolling_window_lives_in_the_head_and_is_copied_whole():
    specs = _specs() + [StateSpec('window', 'recurrent', (4, 3), torch.float32, seq_dim=0)]
    arena = StateArena(specs, 'cpu', max_position=16)
    window = arena.entry('window')
    assert window.strides is None and window.offset < arena.head_nbytes
    arena.views['window'].fill_(2.0)
    blob, packing = arena.pack(1)
    arena.views['window'].zero_()
    arena.unpack(blob, packing, live_rows=1)
    assert bool((arena.views['window'] == 2.0).all())


def test_unpack_subset_of_kinds_leaves_the_rest():
    arena = StateArena(_specs(), 'cpu')
    _advance(arena, 0, 4, seed=3)
    blob, packing = arena.pack(4)
    kv_then = arena.views['L1.key'].clone()
    _advance(arena, 4, 9, seed=4)
    rec_now = arena.views['L0.recurrent0'].clone()
    arena.unpack(blob, packing, live_rows=9, kinds={'kv'})
    assert torch.equal(arena.views['L1.key'], kv_then)
    assert torch.equal(arena.views['L0.recurrent0'], rec_now)


def test_duplicate_names_are_rejected():
    spec = StateSpec('x', 'kv', (2,), torch.float32)
    with pytest.raises(ValueError, match='duplicate'):
        StateArena([spec, spec], 'cpu')


def _layers(n, max_len=16):
    """N layers' worth of _specs(), as an adapter lists them (layer by layer)."""
    return [StateSpec(f'L{i}.{s.name}', s.kind, s.shape, s.dtype, s.seq_dim)
            for i in range(n) for s in _specs(max_len)]


@pytest.mark.parametrize('serial_max', [arena_module.SERIAL_COPY_MAX, 0])
def test_snapshot_and_restore_are_one_copy_whatever_the_layer_count(monkeypatch, serial_max):
    # serial_max 0: every copy through torch, as a state of 16 MiB and more is copied.
    monkeypatch.setattr(arena_module, 'SERIAL_COPY_MAX', serial_max)
    for n in (1, 12):
        arena = StateArena(_layers(n), 'cpu')
        _advance(arena, 0, 5, seed=n)
        digest = _digest(arena)
        blob, packing = arena.pack(5)
        assert _copies(lambda: arena.pack(5), monkeypatch) == 1
        _advance(arena, 5, 9, seed=n + 1)
        assert _copies(lambda: arena.unpack(blob, packing, live_rows=9), monkeypatch) == 1
        assert _digest(arena) == digest  # the rows written past 5 are zeroed again
        arena.zero_()
        assert not arena.storage.any()


def test_packed_blob_is_deterministic_and_restores_many_layers():
    arena = StateArena(_layers(6), 'cpu')
    _advance(arena, 0, 7, seed=5)
    snap_digest = _digest(arena)
    first, packing = arena.pack(7)
    second = torch.full_like(first, 0xAB)
    arena.pack(7, alloc=lambda nbytes: second)
    assert torch.equal(first, second)  # every blob byte is written: padding is copied too
    assert packing.nbytes == first.numel() < arena.nbytes
    _advance(arena, 7, 16, seed=6)
    arena.unpack(first, packing, live_rows=16)
    assert _digest(arena) == snap_digest


def test_unpack_of_kinds_between_others_leaves_neighbours():
    # 'position' entries sit between conv/recurrent entries: a restore of only those must not
    # copy its neighbours' bytes through one merged range.
    arena = StateArena(_layers(3), 'cpu')
    _advance(arena, 0, 4, seed=7)
    blob, packing = arena.pack(4)
    length_then = arena.views['L1.L1.length'].clone()
    _advance(arena, 4, 9, seed=8)
    conv_now = {n: arena.views[n].clone() for n in arena.views if n.endswith('conv0')}
    arena.unpack(blob, packing, live_rows=9, kinds={'position'})
    assert torch.equal(arena.views['L1.L1.length'], length_then)
    for name, value in conv_now.items():
        assert torch.equal(arena.views[name], value)


def test_lineage_keeps_the_newest_links_only():
    arena = StateArena(_specs(), 'cpu')
    first = arena.epoch
    arena.begin_epoch(first, 4)
    assert arena.rows_shared(first) == 4
    epochs = []
    for _ in range(LINEAGE_LINKS + 10):  # a restore of a capsule from the previous epoch each
        epochs.append(arena.epoch)
        arena.begin_epoch(arena.epoch, 3)
    newest = (epochs + [arena.epoch])[-LINEAGE_LINKS:]
    assert list(arena._parents) == newest  # bounded: the oldest links went first
    assert arena.rows_shared(epochs[-1]) == 3 and arena.rows_shared(epochs[-20]) == 3


def test_a_copy_of_another_size_is_refused_not_written_past_the_end():
    # The one-thread copy takes equal sizes only; anything else goes to torch, which refuses.
    buf = torch.zeros(32, dtype=torch.uint8)
    with pytest.raises(RuntimeError):
        arena_module.copy_into(buf[:8], torch.ones(16, dtype=torch.uint8))
    assert not buf.any()
    arena_module.copy_into(buf[:16], torch.ones(16, dtype=torch.uint8))
    assert buf[:16].all() and not buf[16:].any()
