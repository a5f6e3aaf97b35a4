"""CUDA-only checks: graph capture, device/host tiers on a GPU. Skipped without a GPU."""

import pytest
from runtime_harness import greedy, PROMPT
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')]


@pytest.mark.parametrize(
    'model', ['builtin:tiny-hybrid', 'builtin:tiny-llama', 'builtin:tiny-mamba2']
)
@pytest.mark.parametrize('max_seq_len', [128, 1024])
def test_graph_decode_matches_eager(make_runtime, model, max_seq_len):
    # At 1024 the eager step attends over a window of the buffer (WINDOW_QUANTUM steps) and
    # the graph over all of it: the masked rows must not change a token.
    prompt = PROMPT * (8 if max_seq_len > 256 else 1)
    eager = make_runtime(model, device='cuda', cuda_graphs=False, max_seq_len=max_seq_len)
    graphed = make_runtime(model, device='cuda', cuda_graphs=True, max_seq_len=max_seq_len)
    graphed.warmup()
    stats = graphed.stats()
    assert stats.cuda_graph, stats.cuda_graph_note
    assert greedy(graphed, 16, prompt=prompt) == greedy(eager, 16, prompt=prompt)
    assert graphed.stats().cuda_graph_replays >= 15  # the graph ran those steps, not eager
    assert eager.stats().cuda_graph_replays == 0


def test_failed_capture_runs_eager_on_the_stream_it_started_on(make_runtime, monkeypatch):
    rt = make_runtime(device='cuda')
    eager = make_runtime(device='cuda', cuda_graphs=False)
    step = rt.engine._step

    def syncing_step(kv_len=None):
        step(kv_len)
        rt.engine.logits.sum().item()  # a host sync: allowed eagerly, fatal to a capture

    monkeypatch.setattr(rt.engine, '_step', syncing_step)
    stream = torch.cuda.current_stream(rt.device)
    rt.warmup()
    stats = rt.stats()
    assert not stats.cuda_graph and 'capture failed' in stats.cuda_graph_note
    assert torch.cuda.current_stream(rt.device) == stream
    rt.warmup()  # no second attempt
    assert rt.stats().cuda_graph_note == stats.cuda_graph_note
    monkeypatch.undo()
    assert greedy(rt, 12, prompt=PROMPT) == greedy(eager, 12, prompt=PROMPT)


@pytest.mark.parametrize('tier', ['device', 'host', 'disk'])
def test_restore_exact_on_cuda(make_runtime, tier):
    rt = make_runtime(device='cuda', dtype='bfloat16')
    rt.warmup()
    rt.prefill(PROMPT)
    rt.snapshot('c', tier=tier)
    digest = rt.state_digest()
    first = greedy(rt, 12)
    rt.arena.begin_epoch()  # lineage forgotten: the whole capsule comes over, not its head
    rt.restore('c')
    assert rt.stats().last_restore_copied_bytes == rt.store.get('c').packing.nbytes
    assert rt.state_digest() == digest
    assert greedy(rt, 12) == first
    blob = rt.store.get('c').blob
    if tier == 'device':
        assert blob.is_cuda
    elif tier == 'host':
        assert not blob.is_cuda and blob.is_pinned()


def test_graph_survives_restore_and_rollback(make_runtime):
    rt = make_runtime(device='cuda')
    eager = make_runtime(device='cuda', cuda_graphs=False)
    eager.prefill(PROMPT)
    rt.warmup()
    rt.prefill(PROMPT)
    rt.snapshot('a')
    first = greedy(rt, 10)
    assert first == greedy(eager, 10)  # the graph's tokens are right, not only repeatable
    rt.rollback(1)
    assert greedy(rt, 10) == first
    rt.arena.begin_epoch()  # lineage forgotten: a full copy into the graph's fixed addresses
    rt.restore('a')
    assert greedy(rt, 10) == first
    assert rt.stats().cuda_graph and rt.stats().cuda_graph_replays >= 27


def test_same_lineage_host_restore_moves_only_the_head(make_runtime):
    """Back to a host checkpoint of the live branch: the head crosses to the GPU, no KV row."""
    rt = make_runtime(device='cuda', max_seq_len=256, rollback_depth=3)
    assert rt.device.index is not None  # 'cuda' is pinned to an index: capsules compare equal
    rt.prefill(PROMPT * 3)
    rt.snapshot('h', 'host')
    digest = rt.state_digest()
    first = greedy(rt, 8)
    rt.restore('h')
    assert rt.state_digest() == digest
    assert rt.stats().last_restore_copied_bytes == rt.arena.head_nbytes
    assert greedy(rt, 8) == first
    rt.rollback(1)  # the ring entry of that restore is a capture, not the partial transfer
    assert rt.state_digest() == digest
    rt.arena.begin_epoch()  # lineage forgotten: the whole capsule comes over
    rt.restore('h')
    assert rt.state_digest() == digest
    assert rt.stats().last_restore_copied_bytes == rt.store.get('h').blob.numel()
