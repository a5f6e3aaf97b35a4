"""
Fast kernels (fla, causal_conv1d, mamba_ssm) only for CUDA tensors.

transformers binds a fast package's function in place of its reference torch code when the
package imports, whatever device the tensors are on later
(integrations/hub_kernels.use_kernel_func_from_hub_with_fallback). Those kernels are
Triton/CUDA only, so a CPU model fails in them. `route_kernels` replaces each such binding
in the model's modeling modules with one that picks by the tensors' device; the route is
process-wide because transformers' binding is, and it is right for every device.
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch

REFERENCE = 'reference'


def _binding(fn):
    """Return (func_name, package, fast function or None, reference) of a transformers binding."""
    code = getattr(fn, '__code__', None)
    names = code.co_freevars if code is not None else ()
    if not {'implementation', 'torch_function', 'func_name', 'package'} <= set(names):
        return None
    cells = dict(zip(names, (c.cell_contents for c in fn.__closure__)))
    fast, reference = cells['implementation'], cells['torch_function']
    return cells['func_name'], cells['package'], None if fast is reference else fast, reference


def _routed(wrapped, reference):
    params = tuple(inspect.signature(reference).parameters)

    @functools.wraps(reference)
    def route(*args, **kwargs):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is not None and first.is_cuda:
            return wrapped(*args, **kwargs)
        # The keywords the reference takes, as transformers' own fallback passes them.
        return reference(*args, **{k: v for k, v in kwargs.items() if k in params})

    route.flashrt_kernel = wrapped  # marks it routed; the transformers binding it calls
    return route


def route_kernels(model: torch.nn.Module, device: torch.device) -> tuple[str, ...]:
    """
    Route fast-kernel bindings of `model`'s modules by device; name what `device` runs.

    Returns sorted 'function:package' for a fast kernel, 'function:reference' otherwise.
    """
    names = set()
    for module_name in {type(m).__module__ for m in model.modules()}:
        module = sys.modules.get(module_name)
        for attr, fn in list(vars(module).items()) if module is not None else ():
            wrapped = getattr(fn, 'flashrt_kernel', fn)
            found = _binding(wrapped)
            if found is None:
                continue
            func_name, package, fast, reference = found
            if fast is not None and wrapped is fn:
                setattr(module, attr, _routed(wrapped, reference))
            use = package if fast is not None and device.type == 'cuda' else REFERENCE
            names.add(f'{func_name}:{use}')
    return tuple(sorted(names))
