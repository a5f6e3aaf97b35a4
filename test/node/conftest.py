"""
Fixtures for the node tests: the installed `flashrt_node` started as a separate process.

One node process (`node_a`) and one client serve every test module of this folder, to keep
CPU time down; each test starts from a known state (it restores `home` first).
"""

import importlib.util
import shutil
import time

from flashrt_ros.node_process import NodeProcess
from node_harness import EventLog, HOME, NODE_A_PARAMS
from node_harness import start_client, wait_active
import pytest


def _ros_ready():
    return (importlib.util.find_spec('rclpy') is not None
            and importlib.util.find_spec('flashrt_ros.msg') is not None
            and shutil.which('flashrt_node') is not None)


if not _ros_ready():
    pytest.skip('rclpy, the generated flashrt_ros interfaces or the installed flashrt_node are '
                'missing; run through `make test` (or source env.sh after `make setup`)',
                allow_module_level=True)


@pytest.fixture(scope='session')
def capsule_dir(tmp_path_factory):
    """Return the capsule directory shared by the test nodes."""
    return str(tmp_path_factory.mktemp('capsules'))


@pytest.fixture(scope='session')
def node_a(tmp_path_factory, capsule_dir):
    """Start the shared node; stop it with SIGINT at the end of the session."""
    proc = NodeProcess(str(tmp_path_factory.mktemp('node_a')),
                       dict(NODE_A_PARAMS, capsule_dir=capsule_dir))
    yield proc
    proc.stop()


@pytest.fixture(scope='session')
def client(node_a):
    """Return a client of the shared node, once it is active."""
    c = start_client()
    try:
        wait_active(c, node_a)
        assert c.wait_for_subscribers(10.0), 'the node does not subscribe to its topics'
        yield c
    finally:
        c.close()


@pytest.fixture
def at_home(client):
    """Restore home (stopping any leftover generation) and return the home digest."""
    deadline = time.monotonic() + 10.0
    while True:
        response = client.restore(HOME)
        if response.success or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert response.success, response.message
    return client.state_digest()


@pytest.fixture
def events(client):
    """Yield an EventLog on the shared node's ~/events."""
    log = EventLog(client)
    yield log
    log.close()
