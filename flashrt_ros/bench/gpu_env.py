"""
What a GPU machine offers the CUDA path, checked before anything is measured on it.

    python -m flashrt_ros.bench.gpu_env [--device cuda] [--out env.json]

Records torch/CUDA versions, the device capability against the kernels torch was built
for (a wheel without them still reports CUDA available and fails at the first kernel),
one real kernel, the fast-kernel packages present and which SDPA backends take the arena's
row-strided KV views. Exits 1 when a CUDA device was asked for and cannot run a kernel.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import re
import sys

import torch

FAST_KERNELS = {'fla': 'flash-linear-attention', 'causal_conv1d': 'causal-conv1d',
                'mamba_ssm': 'mamba-ssm'}


def arch_supported(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """
    Whether a build for `arch_list` (torch.cuda.get_arch_list()) has kernels for a device.

    A cubin sm_XY runs on X.Z for Z >= Y (sm_XYa only on X.Y itself); PTX compute_XY is
    compiled by the driver for any later device.
    """
    for arch in arch_list:
        m = re.fullmatch(r'(sm|compute)_(\d+?)(\d)([af]?)', arch)
        if m is None:
            continue
        kind, major, minor, suffix = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
        if kind == 'compute' and (major, minor) <= capability:
            return True
        if kind == 'sm' and major == capability[0] and (
                minor == capability[1] if suffix == 'a' else minor <= capability[1]):
            return True
    return False


def one_kernel(device: torch.device) -> dict:
    """Run a matmul on `device` and compare it with the CPU's."""
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    try:
        y = (x.to(device) @ x.to(device)).cpu()
    except Exception as exc:  # no kernel image for this device, a driver mismatch, ...
        return {'ok': False, 'error': f'{type(exc).__name__}: {exc}'[:500]}
    diff = float((y - x @ x).abs().max())
    return {'ok': diff < 1e-2, 'max_diff_vs_cpu': diff}


def fast_kernels() -> dict:
    """Which fast-kernel packages transformers would bind, with their versions."""
    found = {}
    for module, dist in FAST_KERNELS.items():
        if importlib.util.find_spec(module) is None:
            found[module] = None
            continue
        try:
            found[module] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[module] = 'present (no distribution metadata)'
    return found


def sdpa_on_strided_views(key: torch.Tensor, value: torch.Tensor, length: int) -> dict:
    """
    Run every SDPA backend over buffers laid out like the arena's KV views vs the math one.

    key/value: [B, H, max_len, D] views (row-strided: rows of all layers interleave). The
    data is random and in buffers of the same strides, so the live state is not touched.
    """
    from torch.nn.attention import sdpa_kernel, SDPBackend

    def strided(view):
        buf = torch.empty_strided(view.shape, view.stride(), dtype=view.dtype, device=view.device)
        return buf.normal_()[:, :, :length]  # [B, H, length, D], still row-strided

    k, v = strided(key), strided(value)
    q = torch.randn(k.shape[0], k.shape[1], 1, k.shape[3], dtype=k.dtype, device=k.device)
    with sdpa_kernel(SDPBackend.MATH):
        reference = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    default = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    out = {'shape': list(k.shape), 'strides': list(k.stride()), 'dtype': str(k.dtype)[6:]}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
        try:
            with sdpa_kernel(backend):
                y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        except RuntimeError as exc:  # this backend does not take these inputs here
            out[backend.name] = {'ran': False, 'error': str(exc).split('\n')[0][:300]}
            continue
        out[backend.name] = {'ran': True,
                             'max_diff_vs_math': float((y - reference).abs().max()),
                             'same_as_default': bool(torch.equal(y, default))}
    return out


def environment(device: str) -> dict:
    """Describe torch, the device and the kernels; `ok` says whether CUDA work can run."""
    env = {'torch': torch.__version__, 'cuda_build': torch.version.cuda,
           'cuda_available': torch.cuda.is_available(), 'fast_kernels': fast_kernels()}
    try:
        env['transformers'] = importlib.metadata.version('transformers')
    except importlib.metadata.PackageNotFoundError:
        env['transformers'] = None
    dev = torch.device(device)
    if dev.type != 'cuda':
        env['skipped'] = f'device {device}: the GPU checks need a CUDA device'
        env['kernel'] = one_kernel(dev)
        env['ok'] = env['kernel']['ok']
        return env
    if not torch.cuda.is_available():
        env.update(ok=False, error='torch sees no CUDA device (a CPU build, or no driver)')
        return env
    capability = torch.cuda.get_device_capability(dev)
    env.update(device_name=torch.cuda.get_device_name(dev),
               capability=f'{capability[0]}.{capability[1]}',
               arch_list=torch.cuda.get_arch_list())
    env['arch_supported'] = arch_supported(capability, env['arch_list'])
    b = torch.backends.cuda
    env['sdpa_enabled'] = {'flash': b.flash_sdp_enabled(), 'mem_efficient':
                           b.mem_efficient_sdp_enabled(), 'cudnn': b.cudnn_sdp_enabled(),
                           'math': b.math_sdp_enabled()}
    env['kernel'] = one_kernel(dev)
    env['ok'] = env['kernel']['ok']
    if not env['arch_supported']:
        env['error'] = (f'this torch has no kernels for sm_{capability[0]}{capability[1]} '
                        f'(built for {" ".join(env["arch_list"])}): install a build for it')
    return env


def sdpa_report(device: str) -> dict:
    """SDPA backends on a real runtime's KV view layout (builtin:tiny-hybrid, bf16 on CUDA)."""
    from flashrt_ros.runtime import Runtime

    dtype = 'bfloat16' if torch.device(device).type == 'cuda' else 'float32'
    rt = Runtime({'model': 'builtin:tiny-hybrid', 'device': device, 'dtype': dtype,
                  'max_seq_len': 512})
    try:
        views = rt.arena.views
        name = next(n for n in views if n.endswith('.key'))
        return sdpa_on_strided_views(views[name], views[name[:-4] + '.value'], 300)
    finally:
        rt.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog='python -m flashrt_ros.bench.gpu_env',
                                description=__doc__.strip().split('\n')[0])
    p.add_argument('--device', default='cuda')
    p.add_argument('--out', help='write the JSON here too')
    p.add_argument('--no-sdpa', action='store_true', help='skip the SDPA backend check')
    args = p.parse_args(argv)
    env = environment(args.device)
    if env['ok'] and not args.no_sdpa:
        try:
            env['sdpa_strided_kv'] = sdpa_report(args.device)
        except Exception as exc:  # recorded; the kernel check above decides the exit code
            env['sdpa_strided_kv'] = {'error': f'{type(exc).__name__}: {exc}'[:500]}
    text = json.dumps(env, indent=1)
    print(text)
    if args.out:
        with open(args.out, 'w') as f:
            f.write(text + '\n')
    usable = env['ok'] and env.get('arch_supported', True)
    if not usable:
        print(f'gpu_env: {env.get("error") or env["kernel"]}', file=sys.stderr)
    return 0 if usable else 1


if __name__ == '__main__':
    sys.exit(main())
