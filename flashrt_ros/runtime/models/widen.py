"""
A bf16 model's prefill products in float32, on a CPU where torch's bf16 kernel is slow.

Without bf16 instructions (an x86 CPU with AVX2 and no AVX512_BF16, for one) torch's CPU
`linear` over bf16 tensors costs each row of its input about what a matrix-vector product
costs, so a prefill's products take several times their float32 time. Inside `widened()`
a product of at least WIDEN_ROWS rows takes its bf16 weight widened to float32 for the
call (exactly: every bf16 value is a float32 value), sums in float32, as torch's bf16
kernel does, and rounds its result to bf16: results differ from that kernel's only by the
order of the sums. Decode steps (one row) keep the bf16 kernel, faster there.

`install()` decides once per process, by timing both on one product, as the compiled step
times its vector width; the binding is process-wide and calls what it wraps outside
`widened()` and for anything but a bf16 product on the CPU.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time

import torch
import torch.nn.functional as F

WIDEN_ROWS = 16  # rows from which the widened product is the faster one where it is needed
KERNEL = 'bf16_linear:float32'  # its entry in Runtime.stats().kernels when bound
_PROBE = (64, 1024, 1024)  # rows, inputs, outputs of the timed product
_mode = threading.local()


@contextlib.contextmanager
def widened(on: bool = True):
    """Run this thread's bf16 CPU products of WIDEN_ROWS rows or more in float32 inside."""
    before = getattr(_mode, 'on', False)
    _mode.on = on
    try:
        yield
    finally:
        _mode.on = before


def _best_ms(fn, repeats=3) -> float:
    fn()
    best = float('inf')
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


@functools.cache
def needed() -> bool:
    """Whether this CPU's bf16 `linear` is slower than the widened one by half again."""
    rows, k, n = _PROBE
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    with torch.inference_mode():
        bf16 = _best_ms(lambda: _linear(x, w, None))
        wide = _best_ms(lambda: _widened(x, w, None))
    return bf16 > 1.5 * wide


def _widened(x, weight, bias):
    bias = None if bias is None else bias.float()
    return _linear(x.float(), weight.float(), bias).to(x.dtype)


_linear = F.linear


def _dispatch(x, weight, bias=None):
    if (getattr(_mode, 'on', False) and x.dtype == torch.bfloat16
            and weight.dtype == torch.bfloat16 and x.device.type == 'cpu'
            and x.dim() >= 2 and x.numel() >= WIDEN_ROWS * x.shape[-1]):
        return _widened(x, weight, bias)
    return _linear(x, weight, bias)


def install() -> bool:
    """Bind the widened product for bf16 CPU models when this CPU needs it; return if bound."""
    if F.linear is _dispatch:
        return True
    if not needed():
        return False
    F.linear = _dispatch
    return True
