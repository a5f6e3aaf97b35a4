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
def calls(monkeypatch):
    """Count the widened products (whatever their values: the kernel's may be equal)."""
    count = [0]
    inner = widen._widened

    def spy(*args):
        count[0] += 1
        return inner(*args)

    monkeypatch.setattr(widen, '_widened', spy)
    return count


def _linear(seed=0, k=96, n=40):
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n).bfloat16()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g))
        lin.bias.copy_(torch.randn(n, generator=g))
    return lin


def _rows(rows, k=96, seed=1):
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_only_a_bound_bf16_product_of_enough_rows_inside_widened_is_widened(calls):
    lin = _linear()
    assert widen.bind(lin) == 1
    w, b = lin.weight, lin.bias
    for rows in (1, WIDEN_ROWS - 1, WIDEN_ROWS, 3 * WIDEN_ROWS):
        x = _rows(rows)
        before = calls[0]
        assert torch.equal(lin(x), F.linear(x, w, b)) and calls[0] == before  # outside
        with widen.widened():
            out = lin(x)
        widened = calls[0] - before
        assert widened == (rows >= WIDEN_ROWS), rows
        assert out.dtype == torch.bfloat16
        if widened:
            assert torch.equal(out, F.linear(x.float(), w.float(), b.float()).bfloat16())
        assert torch.allclose(out.float(), F.linear(x, w, b).float(), rtol=2 * BF16_STEP,
                              atol=1e-2), rows
    assert calls[0] == 2
    lin.float()  # converted after binding: a float32 product is never widened
    with widen.widened():
        assert lin(_rows(WIDEN_ROWS).float()).dtype == torch.float32
    widen.unbind(lin.bfloat16())
    with widen.widened():
        lin(_rows(WIDEN_ROWS))
    assert 'forward' not in lin.__dict__ and calls[0] == 2


def test_widened_is_per_thread_and_nests(calls):
    lin, x = _linear(), _rows(2 * WIDEN_ROWS)
    widen.bind(lin)
    with widen.widened():
        other = threading.Thread(target=lambda: lin(x))  # not widened on its own thread
        other.start()
        other.join()
        assert calls[0] == 0
        with widen.widened(False):
            lin(x)
        assert calls[0] == 0
        lin(x)
        assert calls[0] == 1
    lin(x)
    assert calls[0] == 1


def test_install_binds_only_bf16_cpu_linears_and_only_where_needed():
    model = torch.nn.Sequential(_linear(), torch.nn.Linear(40, 8))  # bf16, float32
    assert widen.install(model) == widen.needed()
    assert ('forward' in model[0].__dict__) == widen.needed()
    assert 'forward' not in model[1].__dict__
    assert not widen.install(torch.nn.Linear(4, 4))  # float32: nothing to bind


def test_a_widened_bf16_prefill_decodes_like_the_bf16_kernel(make_runtime, calls):
    # The trained default in bf16: the state after a 300-token prompt, widened or not, gives
    # logits within bf16 rounding of each other and the same greedy turn.
    rt = make_runtime('default', dtype='bfloat16', max_seq_len=600)
    model = rt.adapter.model
    prompt = '<|im_start|>user\nput the red cup in the bin<|im_end|>\n<|im_start|>assistant\n'
    runs, counts = {}, {}
    for name, bind in (('kernel', widen.unbind), ('widened', widen.bind)):
        bind(model)
        before = calls[0]
        rt.reset()
        rt.prefill(PROMPT * 8, raw=True)
        rt.prefill(prompt, raw=True)
        logits = rt.engine.logits.clone()
        runs[name] = logits, decode_steps(rt, 4)[0], greedy(rt, 20, raw=True)
        counts[name] = calls[0] - before
    assert counts['kernel'] == 0 and counts['widened'] > 0
    (a, steps_a, turn_a), (b, steps_b, turn_b) = runs['kernel'], runs['widened']
    for x, y in zip([a] + steps_a, [b] + steps_b):
        assert (x - y).abs().max() <= 0.15 * y.abs().max()
        assert int(x.argmax()) == int(y.argmax())
    assert turn_a == turn_b


def test_a_bf16_runtime_lists_the_binding_where_this_cpu_needs_it(make_runtime):
    kernels = make_runtime('builtin:tiny-hybrid', dtype='bfloat16').stats().kernels
    assert (widen.KERNEL in kernels) == widen.needed() and list(kernels) == sorted(kernels)
    assert widen.KERNEL not in make_runtime('builtin:tiny-hybrid').stats().kernels  # float32
