"""
The reliability suite: soak, SIGKILL mid-write, full filesystem, racing clients, fuzz.

Long (minutes), so it runs only with FLASHRT_RELIABILITY=1 (`make reliability`); under
`make test` its tests are collected and skipped.
"""

import os

import pytest
from reliability_harness import Surroundings


@pytest.fixture(scope='session', autouse=True)
def reliability_enabled():
    """Skip every test of this folder unless FLASHRT_RELIABILITY=1."""
    if os.environ.get('FLASHRT_RELIABILITY') != '1':
        pytest.skip('the reliability suite is long; run it with `make reliability` '
                    '(FLASHRT_RELIABILITY=1)')


@pytest.fixture
def surroundings(tmp_path):
    """Yield a capsule dir with a sibling folder and parent files; check they are untouched."""
    place = Surroundings(tmp_path / 'place')
    yield place
    place.assert_untouched()
