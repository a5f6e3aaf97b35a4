"""Fast-kernel packages transformers binds at import run only for CUDA tensors."""

import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A causal_conv1d whose kernels raise, as a Triton/CUDA-only build does for CPU tensors.
STUB = """
def causal_conv1d_fn(x, weight, bias=None, activation=None, seq_idx=None):
    raise RuntimeError('stub causal_conv1d kernel called')


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None):
    raise RuntimeError('stub causal_conv1d kernel called')
"""

SCRIPT = textwrap.dedent("""
    import json
    from flashrt_ros.runtime import Runtime

    for model in ('builtin:tiny-hybrid', 'builtin:tiny-policy'):
        rt = Runtime({'model': model, 'device': 'cpu'})
        rt.warmup()
        if rt.is_policy:
            rt.act([0.1] * rt.policy_spec.obs_dim)
        else:
            list(rt.generate('hello', max_new_tokens=4, stop=()))
        stats = rt.stats()
        print(json.dumps([model, stats.to_dict()['kernels']]))
        rt.close()
    from transformers.models.qwen3_next import modeling_qwen3_next as m
    bound = [c.cell_contents for c in m.causal_conv1d_fn.flashrt_kernel.__closure__]
    print(json.dumps(['bound', sorted({getattr(c, '__module__', '') for c in bound})]))
""")


def test_cpu_runtime_falls_back_to_reference_kernels(tmp_path):
    (tmp_path / 'causal_conv1d').mkdir()
    (tmp_path / 'causal_conv1d' / '__init__.py').write_text(STUB)
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join(p for p in (str(tmp_path), ROOT) if p)
    proc = subprocess.run([sys.executable, '-c', SCRIPT], env=env, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith('[')]
    results = dict(json.loads(line) for line in lines)
    for model in ('builtin:tiny-hybrid', 'builtin:tiny-policy'):
        kernels = results[model]
        assert 'causal_conv1d_fn:reference' in kernels, kernels
        assert all(k.endswith(':reference') for k in kernels), kernels
    assert 'causal_conv1d' in results['bound']  # transformers bound the stub: the test has teeth


def test_stats_name_kernels_of_the_model():
    from flashrt_ros.runtime import Runtime

    rt = Runtime({'model': 'builtin:tiny-llama', 'device': 'cpu'})
    assert rt.stats().kernels == () and rt.stats().to_dict()['kernels'] == []
    rt.close()
