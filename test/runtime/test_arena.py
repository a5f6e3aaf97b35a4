"""StateArena: one allocation, typed views, prefix packing that restores the full arena exactly."""

import hashlib

from flashrt_ros.runtime.arena import ALIGN, StateArena, StateSpec
import pytest
import torch


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
        assert e.offset % ALIGN == 0
        assert view.dtype == e.torch_dtype and tuple(view.shape) == e.shape
        assert base + e.offset == view.data_ptr() and view.data_ptr() + e.nbytes <= end
    arena.views['L0.recurrent0'].fill_(1.5)  # writes land in the one storage
    assert arena.storage.count_nonzero() > 0
    assert {e.dtype for e in arena.manifest} == {'bfloat16', 'float32', 'int64', 'int32'}


def test_layout_fingerprint_tracks_shapes():
    assert (
        StateArena(_specs(16), 'cpu').layout_fingerprint
        == StateArena(_specs(16), 'cpu').layout_fingerprint
    )
    assert (
        StateArena(_specs(16), 'cpu').layout_fingerprint
        != StateArena(_specs(32), 'cpu').layout_fingerprint
    )


@pytest.mark.parametrize('whole', [False, True])
def test_pack_unpack_restores_every_byte(whole):
    arena = StateArena(_specs(), 'cpu')
    _advance(arena, 0, 5, seed=1)
    snap_digest = _digest(arena)
    blob, packing = arena.pack(5, whole=whole)
    assert packing.whole == whole
    if not whole:
        assert blob.numel() < arena.nbytes  # only the used KV prefix was copied
    _advance(arena, 5, 12, seed=2)  # a newer state wrote rows 5..11 and changed the rest
    assert _digest(arena) != snap_digest
    arena.unpack(blob, packing, live_position=12)
    assert _digest(arena) == snap_digest  # stale rows past the prefix were zeroed


def test_unpack_subset_of_kinds_leaves_the_rest():
    arena = StateArena(_specs(), 'cpu')
    _advance(arena, 0, 4, seed=3)
    blob, packing = arena.pack(4, whole=False)
    kv_then = arena.views['L1.key'].clone()
    _advance(arena, 4, 9, seed=4)
    rec_now = arena.views['L0.recurrent0'].clone()
    arena.unpack(blob, packing, live_position=9, kinds={'kv'})
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


def test_snapshot_copies_are_few_whatever_the_layer_count():
    # Tensors without a sequence axis are one range; KV tensors of one layout one strided
    # copy; so 1 + (number of KV layouts) copies for 1 or 12 layers.
    for n in (1, 12):
        arena = StateArena(_layers(n), 'cpu')
        assert len(arena.runs(arena.plan(5, whole=False))) == 3
        kinds = [e.seq_dim is not None for e in arena.manifest]
        assert kinds == sorted(kinds)  # no sequence axis first


def test_packed_blob_is_deterministic_and_restores_many_layers():
    arena = StateArena(_layers(6), 'cpu')
    _advance(arena, 0, 7, seed=5)
    snap_digest = _digest(arena)
    first, packing = arena.pack(7, whole=False)
    second = torch.full_like(first, 0xAB)
    arena.pack(7, whole=False, alloc=lambda nbytes: second)
    assert torch.equal(first, second)  # every blob byte is written: padding is copied too
    assert packing.nbytes == first.numel() < arena.nbytes
    _advance(arena, 7, 16, seed=6)
    arena.unpack(first, packing, live_position=16)
    assert _digest(arena) == snap_digest


def test_unpack_of_kinds_between_others_leaves_neighbours():
    # 'position' entries sit between conv/recurrent entries: a restore of only those must not
    # copy its neighbours' bytes through one merged range.
    arena = StateArena(_layers(3), 'cpu')
    _advance(arena, 0, 4, seed=7)
    blob, packing = arena.pack(4, whole=False)
    length_then = arena.views['L1.L1.length'].clone()
    _advance(arena, 4, 9, seed=8)
    conv_now = {n: arena.views[n].clone() for n in arena.views if n.endswith('conv0')}
    arena.unpack(blob, packing, live_position=9, kinds={'position'})
    assert torch.equal(arena.views['L1.L1.length'], length_then)
    for name, value in conv_now.items():
        assert torch.equal(arena.views[name], value)
