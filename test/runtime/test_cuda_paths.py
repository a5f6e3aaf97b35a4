"""
The CUDA paths in bf16 with graphs live (warmup()): what a GPU settles. Skipped without one.

gpu_probe.sh runs these (pytest -m cuda) with test_cuda.py and the CUDA case of the lineage
test.
"""

import threading

from flashrt_ros.bench.gpu_env import sdpa_report
import pytest
from runtime_harness import FAMILIES, greedy, PROMPT
from test_preemption import OTHER, test_preempting_a_long_prompt_cuts_its_prefill_short
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')]
SAMPLED = {'temperature': 0.9, 'top_k': 40, 'top_p': 0.95}


def _graphed(make_runtime, model='builtin:tiny-hybrid', **overrides):
    rt = make_runtime(model, device='cuda', dtype='bfloat16', **overrides)
    rt.warmup()
    stats = rt.stats()
    assert stats.cuda_graph, stats.cuda_graph_note  # the replay check after capture passed
    return rt


@pytest.mark.parametrize('model', FAMILIES)
def test_graph_decode_matches_eager_in_bf16(make_runtime, model):
    eager = make_runtime(model, device='cuda', dtype='bfloat16', cuda_graphs=False)
    graphed = _graphed(make_runtime, model)
    assert greedy(graphed, 24, prompt=PROMPT) == greedy(eager, 24, prompt=PROMPT)
    assert graphed.stats().cuda_graph_replays >= 23
    assert all(k.count(':') == 1 for k in graphed.stats().kernels)


@pytest.mark.parametrize('tier', ['device', 'host', 'disk'])
def test_sampled_decode_is_reproducible_after_restore(make_runtime, tier):
    rt = _graphed(make_runtime)
    rt.prefill(PROMPT)
    rt.snapshot('c', tier=tier)
    first = greedy(rt, 24, **SAMPLED)  # the runtime's own generator: it is in the capsule
    rt.restore('c')
    assert greedy(rt, 24, **SAMPLED) == first
    rt.arena.begin_epoch()  # a full copy into the graph's addresses as well
    rt.restore('c')
    assert greedy(rt, 24, **SAMPLED) == first


def test_preempting_a_graphed_decode_from_another_thread(make_runtime):
    rt = _graphed(make_runtime, max_seq_len=1024)
    rt.prefill(PROMPT)
    rt.snapshot('home')
    home = rt.state_digest()
    reference = greedy(rt, 12)
    for call in (lambda: rt.restore('home', preempt=True),
                 lambda: rt.rollback(2, preempt=True)):  # past the prompt's end
        rt.restore('home')
        gen = rt.generate(prompt=OTHER, max_new_tokens=900, stop=(), eos=False)
        out = []
        thread = threading.Thread(target=lambda: out.extend(gen))
        thread.start()
        while len(out) < 8 and thread.is_alive():
            thread.join(0.001)
        call()  # waits for at most the replay in flight
        thread.join(30)
        assert not thread.is_alive() and gen.result.stop_reason == 'interrupted'
        assert rt.state_digest() == home and not rt.generating
    assert greedy(rt, 12) == reference
    assert rt.stats().cuda_graph_replays > 16


def test_preempting_a_long_prefill_on_cuda(make_runtime):
    # The CPU test as it is, on a graphed bf16 runtime: the kernels queued before the cut
    # run before the rollback's copies.
    test_preempting_a_long_prompt_cuts_its_prefill_short(
        lambda **overrides: _graphed(make_runtime, **overrides))


def test_policy_mode_on_cuda(make_runtime):
    rt = make_runtime('builtin:tiny-policy', device='cuda', dtype='bfloat16')
    rt.warmup()
    assert rt.adapter.device == rt.device
    rt.act([0.1] * rt.policy_spec.obs_dim)
    rt.snapshot('s', tier='host')
    digest = rt.state_digest()
    first = [rt.act([0.2 * i] * rt.policy_spec.obs_dim).actions for i in range(3)]
    rt.restore('s')
    assert rt.state_digest() == digest
    again = [rt.act([0.2 * i] * rt.policy_spec.obs_dim).actions for i in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not first[0].is_cuda  # chunks handed out are host copies
    stats = rt.stats()
    assert stats.device.startswith('cuda') and stats.control_step_s > 0


def test_sdpa_backends_on_the_strided_kv_views_match_math():
    report = sdpa_report('cuda')
    assert report['MATH']['ran'], report
    ran = [name for name, r in report.items() if isinstance(r, dict) and r.get('ran')]
    for name in ran:
        assert report[name]['max_diff_vs_math'] <= 2e-2, (name, report)
