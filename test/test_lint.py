"""The linters ROS packages run as tests: flake8 and pep257 with the ament settings."""

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATHS = [os.path.join(ROOT, p) for p in ('flashrt_ros', 'test', 'launch', 'scripts/flashrt_node')]


def _paths():
    return [p for p in PATHS if os.path.exists(p)]


def test_flake8():
    main = pytest.importorskip('ament_flake8.main', reason='ament_flake8 is not installed')
    rc = main.main(argv=_paths())
    assert rc == 0, 'flake8 found problems (listed above)'


def test_pep257():
    main = pytest.importorskip('ament_pep257.main', reason='ament_pep257 is not installed')
    rc = main.main(argv=_paths())
    assert rc == 0, 'pep257 found problems (listed above)'
