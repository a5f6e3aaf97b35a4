"""Restore exactness for every supported family and dtype, and the KV-only ablation."""

import pytest
from runtime_harness import ATTENTION_ONLY, DTYPES, FAMILIES, greedy, HYBRIDS, OTHER_PROMPT, PROMPT
import torch


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('model', FAMILIES)
def test_restore_gives_identical_tokens_and_digest(make_runtime, model, dtype):
    rt = make_runtime(model, dtype=dtype)
    rt.prefill(PROMPT)
    info = rt.snapshot('boundary')
    digest = rt.state_digest()
    assert info.position == rt.position == len(rt.tokenize(PROMPT))
    first = greedy(rt, 12)
    assert rt.state_digest() != digest
    rt.restore('boundary')
    assert rt.state_digest() == digest
    assert rt.position == info.position
    assert greedy(rt, 12) == first


@pytest.mark.parametrize('model', HYBRIDS)
def test_kv_only_restore_diverges_on_hybrids(make_runtime, model):
    rt = make_runtime(model)
    rt.prefill(PROMPT)
    rt.snapshot('a')
    reference = greedy(rt, 16)
    rt.prefill(OTHER_PROMPT)  # recurrent/conv state now belongs to another context
    rt.restore('a', mode='kv_only')
    assert rt.position == len(rt.tokenize(PROMPT))
    assert (
        greedy(rt, 16) != reference
    ), 'recurrent state is load-bearing: KV alone must not suffice'


def test_kv_only_restore_is_exact_on_attention_only(make_runtime):
    rt = make_runtime(ATTENTION_ONLY)
    rt.prefill(PROMPT)
    rt.snapshot('a')
    digest = rt.state_digest()
    reference = greedy(rt, 16)
    rt.prefill(OTHER_PROMPT)
    rt.restore('a', mode='kv_only')
    assert rt.state_digest() == digest
    assert greedy(rt, 16) == reference


def test_has_previous_state_flags_are_part_of_the_state(make_runtime):
    rt = make_runtime('builtin:tiny-hybrid')
    rt.prefill(PROMPT)
    rt.snapshot('a')
    reference = greedy(rt, 8)
    rt.restore('a')
    rt.adapter.reset_meta()  # bytes restored, flags dropped: what a bytes-only copy does
    assert greedy(rt, 8) != reference
    rt.restore('a')
    assert greedy(rt, 8) == reference


def test_empty_state_capsule_restores_the_prefill_path(make_runtime):
    rt = make_runtime('builtin:tiny-qwen3-5')
    rt.snapshot('empty')
    digest = rt.state_digest()
    first = greedy(rt, 6, prompt=PROMPT)
    rt.restore('empty')
    assert rt.position == 0 and rt.state_digest() == digest
    assert greedy(rt, 6, prompt=PROMPT) == first


@pytest.mark.parametrize('model', ['builtin:tiny-hybrid', 'builtin:tiny-mamba2'])
def test_turns_continue_exactly_like_one_long_turn(make_runtime, model):
    rt = make_runtime(model)
    rt.prefill(PROMPT)
    rt.snapshot('a')
    one_turn = greedy(rt, 10)
    rt.restore('a')
    assert greedy(rt, 4) + greedy(rt, 6) == one_turn  # the pending token carries across turns


def test_sampled_decode_reproduces_after_restore(make_runtime):
    rt = make_runtime('builtin:tiny-hybrid')
    rt.prefill(PROMPT)
    kw = {'temperature': 1.0, 'top_k': 50, 'top_p': 0.95}
    greedy(rt, 3, seed=7, **kw)  # advance the sampler RNG before the snapshot
    rt.snapshot('mid')
    first = greedy(rt, 12, **kw)
    second = greedy(rt, 12, **kw)
    assert first != second  # the RNG really moves
    rt.restore('mid')
    assert greedy(rt, 12, **kw) == first  # RNG state came back with the capsule
    assert greedy(rt, 12, **kw) == second


def test_seeded_sampling_is_repeatable_and_seed_dependent(make_runtime):
    rt = make_runtime('builtin:tiny-lfm2')
    rt.prefill(PROMPT)
    rt.snapshot('a')
    a = greedy(rt, 12, temperature=1.0, seed=1)
    rt.restore('a')
    b = greedy(rt, 12, temperature=1.0, seed=1)
    rt.restore('a')
    c = greedy(rt, 12, temperature=1.0, seed=2)
    assert a == b and a != c


@pytest.mark.parametrize('model', ['builtin:tiny-hybrid', 'builtin:tiny-llama'])
def test_eager_attention_window_matches_the_whole_buffer(make_runtime, model):
    windowed = make_runtime(model, max_seq_len=1024)
    whole = make_runtime(model, max_seq_len=1024)
    whole.adapter.binding.windowed = []  # always attend over all 1024 rows
    prompt = PROMPT * 8                # crosses the 256-token window quantum
    assert greedy(windowed, 24, prompt=prompt) == greedy(whole, 24, prompt=prompt)
    logits_w, logits_f = windowed.arena.views['logits'], whole.arena.views['logits']
    assert torch.allclose(logits_w, logits_f, atol=1e-5)
