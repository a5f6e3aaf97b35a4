"""A bf16 prefill's products in float32 where torch's bf16 kernel is slow (models/widen.py)."""

import threading

from flashrt_ros.runtime.models import widen
from flashrt_ros.runtime.models.widen import WIDEN_ROWS
import pytest
from runtime_harness import decode_steps, greedy, PROMPT
import torch
import torch.nn.functional as F

# Two float32 sums of the same bf16 products in another order, each rounded to bf16: a
# result may land one bf16 step (2^-7 relative) away.
BF16_STEP = 2.0 ** -7


@pytest.fixture
def bound(monkeypatch):
    """Bind the widened product, whether or not this CPU needs it (the same code path)."""
    monkeypatch.setattr(F, 'linear', widen._dispatch)


def _operands(rows, k=96, n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=g).bfloat16(),
            torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16())


def test_only_a_bf16_product_of_enough_rows_inside_widened_is_widened(bound):
    kernel = widen._linear
    for rows in (1, WIDEN_ROWS - 1, WIDEN_ROWS, 3 * WIDEN_ROWS):
        x, w, b = _operands(rows)
        wide = F.linear(x.float(), w.float(), b.float()).bfloat16()
        assert torch.equal(F.linear(x, w, b), kernel(x, w, b)), rows  # outside widened()
        with widen.widened():
            out = F.linear(x, w, b)
            f32 = F.linear(x.float(), w.float(), b.float())  # not bf16: never widened
        assert out.dtype == torch.bfloat16 and f32.dtype == torch.float32
        assert torch.equal(f32, kernel(x.float(), w.float(), b.float()))
        assert torch.equal(out, wide if rows >= WIDEN_ROWS else kernel(x, w, b)), rows
        assert torch.allclose(out.float(), kernel(x, w, b).float(), rtol=2 * BF16_STEP,
                              atol=1e-2), rows


def test_widened_is_per_thread_and_nests(bound):
    x, w, b = _operands(2 * WIDEN_ROWS)
    wide = F.linear(x.float(), w.float(), b.float()).bfloat16()
    seen = {}
    with widen.widened():
        other = threading.Thread(target=lambda: seen.update(out=F.linear(x, w, b)))
        other.start()
        other.join()
        with widen.widened(False):
            assert torch.equal(F.linear(x, w, b), widen._linear(x, w, b))
        assert torch.equal(F.linear(x, w, b), wide)
    assert torch.equal(seen['out'], widen._linear(x, w, b))


def test_install_binds_only_where_it_is_needed():
    before = F.linear
    try:
        bound = widen.install()
        assert bound == widen.needed() and (F.linear is widen._dispatch) == bound
        assert widen.install() == bound  # idempotent
    finally:
        F.linear = before


def test_a_widened_bf16_prefill_decodes_like_the_bf16_kernel(make_runtime, tmp_path, bound):
    # The trained default in bf16: the state after a 300-token prompt, widened or not, gives
    # logits within bf16 rounding of each other and the same greedy turn.
    rt = make_runtime('default', dtype='bfloat16', max_seq_len=600)
    prompt = '<|im_start|>user\nput the red cup in the bin<|im_end|>\n<|im_start|>assistant\n'
    runs = {}
    for name, linear in (('kernel', widen._linear), ('widened', widen._dispatch)):
        F.linear = linear
        rt.reset()
        rt.prefill(PROMPT * 8, raw=True)
        rt.prefill(prompt, raw=True)
        logits = rt.engine.logits.clone()
        runs[name] = logits, decode_steps(rt, 4)[0], greedy(rt, 20, raw=True)
    (a, steps_a, turn_a), (b, steps_b, turn_b) = runs['kernel'], runs['widened']
    for x, y in zip([a] + steps_a, [b] + steps_b):
        assert (x - y).abs().max() <= 0.15 * y.abs().max()
        assert int(x.argmax()) == int(y.argmax())
    assert turn_a == turn_b


def test_a_bf16_runtime_lists_the_binding_when_bound(make_runtime):
    rt = make_runtime('builtin:tiny-hybrid', dtype='bfloat16')
    assert (widen.KERNEL in rt.stats().kernels) == (F.linear is widen._dispatch)
    assert widen.KERNEL not in make_runtime('builtin:tiny-hybrid').stats().kernels  # float32
