"""Shared fixtures for the runtime unit tests (CPU, tiny random-weight models, no ROS)."""

import warnings

from flashrt_ros.runtime import Runtime, RuntimeConfig
import pytest

HYBRIDS = [
    'builtin:tiny-hybrid',
    'builtin:tiny-qwen3-5',
    'builtin:tiny-lfm2',
    'builtin:tiny-mamba2',
]
ATTENTION_ONLY = 'builtin:tiny-llama'
FAMILIES = HYBRIDS + [ATTENTION_ONLY]
DTYPES = ['float32', 'bfloat16']
PROMPT = 'The robot arm picks up the red cube and'
OTHER_PROMPT = 'zz 9071 something else entirely ###'

warnings.filterwarnings('ignore', message='.*falling back to its reference PyTorch.*')


@pytest.fixture
def make_runtime(tmp_path):
    """Build Runtimes sharing one temporary capsule dir; all closed at teardown."""
    made = []

    def make(model='builtin:tiny-hybrid', adapter=None, **overrides):
        values = {'model': model, 'device': 'cpu', 'dtype': 'float32', 'max_seq_len': 128,
                  'capsule_dir': str(tmp_path / 'capsules'), 'rollback_depth': 4}
        values.update(overrides)
        rt = Runtime(RuntimeConfig(**values), adapter=adapter)
        made.append(rt)
        return rt

    yield make
    for rt in made:
        if not rt._closed:
            rt.close()


def greedy(rt, n=10, prompt=None, **kw):
    """Token ids of one greedy turn with no stop conditions except the token count."""
    kw.setdefault('stop', ())
    kw.setdefault('eos', False)
    gen = rt.generate(prompt=prompt, max_new_tokens=n, **kw)
    return [ev.token_id for ev in gen]
