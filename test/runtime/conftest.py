"""Shared fixtures for the runtime unit tests (CPU, tiny random-weight models, no ROS)."""

import warnings

from flashrt_ros.runtime import Runtime, RuntimeConfig
import pytest

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
