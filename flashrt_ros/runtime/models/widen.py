"""
A bf16 model's prefill products in float32, on a CPU where torch's bf16 kernel is slow.

Without bf16 instructions (an x86 CPU with AVX2 and no AVX512_BF16, for one) torch's CPU
`linear` over bf16 tensors costs each row of its input about what a matrix-vector product
costs, so a prefill's products take several times their float32 time. Inside `widened()`
a bound `nn.Linear`'s product of at least WIDEN_ROWS rows takes its bf16 weight widened to
float32 for the call (exactly: every bf16 value is a float32 value), sums in float32, as
torch's bf16 kernel does, and rounds its result to bf16: results differ from that kernel's
only by the order of the sums. Decode steps (one row) keep the bf16 kernel, faster there.

`install(model)` binds the bf16 CPU `nn.Linear`s of that model, and only where this CPU
needs it: one product timed both ways, once per process, as the compiled step times its
vector width. A bound module's forward calls `F.linear` as before outside `widened()` and
for anything but a bf16 CPU input.
"""

from __future__ import annotations

import functools
import threading
import time
import types

import torch
import torch.nn.functional as F

from .pieces import switched

WIDEN_ROWS = 16  # rows from which widening pays where it is needed (bf16 cost grows per row)
KERNEL = 'bf16_linear:float32'  # its entry in Runtime.stats().kernels when bound
_PROBE = (WIDEN_ROWS, 1024, 1024)  # rows, inputs, outputs of the timed product
_mode = threading.local()


def widened(on: bool = True):
    """Run this thread's bound products of WIDEN_ROWS rows or more in float32 inside."""
    return switched(_mode, 'on', on)


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
    """Whether this CPU's bf16 `linear` of WIDEN_ROWS rows is slower than the widened one."""
    rows, k, n = _PROBE
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    with torch.inference_mode():
        bf16 = _best_ms(lambda: F.linear(x, w))
        wide = _best_ms(lambda: _widened(x, w, None))
    return bf16 > 1.25 * wide


def _widened(x, weight, bias):
    bias = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), bias).to(x.dtype)


def _forward(self, x):
    if (getattr(_mode, 'on', False) and x.dtype == torch.bfloat16
            and self.weight.dtype == torch.bfloat16 and x.device.type == 'cpu'
            and x.dim() >= 2 and x.numel() >= WIDEN_ROWS * x.shape[-1]):
        return _widened(x, self.weight, self.bias)
    return F.linear(x, self.weight, self.bias)


def _linears(model: torch.nn.Module):
    return [m for m in model.modules() if type(m) is torch.nn.Linear
            and m.weight.dtype == torch.bfloat16 and m.weight.device.type == 'cpu']


def bind(model: torch.nn.Module) -> int:
    """Bind every bf16 CPU `nn.Linear` of `model`, needed or not; return how many."""
    linears = _linears(model)
    for m in linears:
        m.forward = types.MethodType(_forward, m)
    return len(linears)


def unbind(model: torch.nn.Module) -> None:
    """Give every module of `model` its class's forward back."""
    for m in model.modules():
        if getattr(m.__dict__.get('forward'), '__func__', None) is _forward:
            del m.forward


def install(model: torch.nn.Module) -> bool:
    """Bind `model`'s bf16 CPU products when it has any and this CPU needs it; return if so."""
    return bool(_linears(model)) and needed() and bind(model) > 0
