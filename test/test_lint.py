"""The linters ROS packages run as tests: flake8 and pep257 with the ament settings."""

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATHS = [os.path.join(ROOT, p) for p in ('flashrt_ros', 'test', 'launch', 'scripts/flashrt_node')]


def _lint(tool):
    """
    Run ament_<tool> in a fresh interpreter; return (exit code, output).

    Not in-process: flake8 forks worker processes, and forking this pytest process after
    other tests started DDS threads can deadlock the child.
    """
    module = f'ament_{tool}.main'
    if importlib.util.find_spec(module) is None:
        pytest.skip(f'ament_{tool} is not installed')
    code = f'import sys; from {module} import main; sys.exit(main(argv=sys.argv[1:]))'
    paths = [p for p in PATHS if os.path.exists(p)]
    done = subprocess.run([sys.executable, '-c', code, *paths], capture_output=True, text=True,
                          timeout=240)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize('tool', ['flake8', 'pep257'])
def test_lint(tool):
    rc, output = _lint(tool)
    assert rc == 0, f'{tool} found problems:\n{output[-6000:]}'
