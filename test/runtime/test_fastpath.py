"""The exact decode fast path (cpu_step off): transformers' generate() tokens and bits."""

from flashrt_ros.runtime.models.builtin import build_builtin
from flashrt_ros.runtime.models.fastpath import FAMILIES as FAST_FAMILIES
from flashrt_ros.runtime.models.tokenizer import ByteTokenizer
import pytest
from runtime_harness import decode_steps, FAMILIES, greedy, OTHER_PROMPT, PROMPT
import torch

FAST = ['builtin:tiny-hybrid', 'builtin:tiny-qwen3-5']
STEPS = 24


def _hf_greedy(model_id, ids, n):
    """Greedy continuation by transformers' own generate() on a fresh copy of the model."""
    model = build_builtin(model_id.removeprefix('builtin:'), torch.float32)
    # The runtime never samples the padding ids past the byte tokenizer's vocabulary.
    padding = list(range(ByteTokenizer.vocab_size, model.config.vocab_size))
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=0,
                         suppress_tokens=padding)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize('cpu_step', [True, False])
@pytest.mark.parametrize('model', FAMILIES)
def test_greedy_decode_matches_transformers_generate(make_runtime, model, cpu_step):
    rt = make_runtime(model, cpu_step=cpu_step)
    expects_fast = model in FAST
    assert (rt.adapter.fastpath is not None) == expects_fast, rt.adapter.fastpath_note
    assert (rt.stats().decode_fastpath_note is None) == expects_fast
    assert (rt.adapter.cpu_step is not None) == (expects_fast and cpu_step)
    before = rt.engine.replays
    ids = rt.tokenize(PROMPT)
    assert greedy(rt, STEPS, prompt=PROMPT) == _hf_greedy(model, ids, STEPS)
    assert rt.engine.replays == before  # CPU: no graph; every step ran eagerly


@pytest.mark.parametrize('model', FAST)
def test_fastpath_writes_the_same_bytes_as_transformers(make_runtime, model):
    fast, slow = (make_runtime(model, max_seq_len=600, cpu_step=False) for _ in range(2))
    slow.adapter.fastpath = None  # every step through transformers' forward
    for rt in (fast, slow):
        rt.prefill(PROMPT * 8)  # past one attention window (binding.WINDOW_QUANTUM)
    assert fast.state_digest() == slow.state_digest()
    calls = []
    step = fast.adapter.fastpath.step
    fast.adapter.fastpath.step = lambda *a: calls.append(1) or step(*a)
    logits_fast, digest_fast = decode_steps(fast, STEPS)
    logits_slow, digest_slow = decode_steps(slow, STEPS)
    assert len(calls) == STEPS
    for i, (a, b) in enumerate(zip(logits_fast, logits_slow)):
        assert torch.equal(a, b), f'step {i}: logits differ by {(a - b).abs().max()}'
    assert digest_fast == digest_slow


def test_fastpath_continues_exactly_after_restore_and_rollback(make_runtime):
    rt = make_runtime('builtin:tiny-hybrid')
    rt.prefill(PROMPT)
    rt.snapshot('a')
    reference = greedy(rt, 12)
    rt.prefill(OTHER_PROMPT)
    rt.restore('a')
    assert greedy(rt, 12) == reference
    rt.restore('a')
    greedy(rt, 5)
    rt.rollback(1)
    assert greedy(rt, 12) == reference


def test_first_token_on_an_empty_state_takes_transformers_path(make_runtime):
    rt = make_runtime('builtin:tiny-qwen3-5', cpu_step=False)
    assert not rt.adapter.decode_ready()  # no previous state: the next step is a prefill
    calls = []
    step = rt.adapter.fastpath.step
    rt.adapter.fastpath.step = lambda *a: calls.append(1) or step(*a)
    rt.engine.decode(65, 0)
    assert calls == [] and rt.adapter.decode_ready()
    rt.cursor.position = 1
    rt.engine.decode(66, 1)
    assert calls == [1]


@pytest.mark.parametrize('model', ['builtin:tiny-lfm2', 'builtin:tiny-mamba2',
                                   'builtin:tiny-llama'])
def test_other_families_fall_back_saying_why(make_runtime, model):
    rt = make_runtime(model)
    assert rt.adapter.fastpath is None
    note = rt.stats().decode_fastpath_note
    assert rt.adapter.family in note and all(f in note for f in FAST_FAMILIES)
