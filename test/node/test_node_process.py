"""Process-level behaviour: autostart off, lifecycle transitions, foreign capsules, SIGINT."""

import os
import signal
import time

from action_msgs.msg import GoalStatus
from flashrt_ros.node_process import NodeProcess
from node_harness import HOME, start_client, wait_active
import pytest

B_PARAMS = {
    'model': 'builtin:tiny-hybrid',
    'cpu_step': False,  # a turn still runs when the test deactivates (see NODE_A_PARAMS)
    'max_seq_len': 512,          # another state layout: capsules of node A do not fit
    'autostart': False,
    'system_prompt': 'Other robot.',
    'interrupt_timeout': 5.0,
}


@pytest.fixture(scope='module')
def node_b(tmp_path_factory, capsule_dir):
    """Start a second node (not autostarted) that shares node A's capsule directory."""
    proc = NodeProcess(str(tmp_path_factory.mktemp('node_b')),
                       dict(B_PARAMS, capsule_dir=capsule_dir), name='flashrt_b')
    yield proc
    proc.stop()


@pytest.fixture(scope='module')
def client_b(node_b):
    """Return a client of node B."""
    c = start_client('flashrt_b')
    yield c
    c.close()


def _get_state(client, timeout=60.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.get_state(timeout=5.0)
        except TimeoutError:
            if time.monotonic() > deadline:
                raise


def test_autostart_off_waits_unconfigured(client_b):
    assert _get_state(client_b) == 'unconfigured'
    response = client_b.snapshot('x')
    assert not response.success and 'unconfigured' in response.message
    assert not client_b.list_capsules().success
    assert not client_b.start_generate('hi', max_new_tokens=2).accepted


def test_lifecycle_transitions(client_b, node_b):
    assert client_b.change_state('configure', timeout=120.0)
    assert client_b.get_state() == 'inactive'
    response = client_b.snapshot('x')
    assert not response.success and 'inactive' in response.message
    assert client_b.change_state('activate', timeout=60.0)
    wait_active(client_b, node_b, timeout=30.0)
    home = {c.name: c for c in client_b.list_capsules().capsules}[HOME]
    assert home.position == len('Other robot.')
    assert client_b.snapshot('b_capsule').success

    # deactivate stops a running generation at its next step
    run = client_b.start_generate('Describe the room.', max_new_tokens=400)  # no EOS in 400
    assert run.accepted
    time.sleep(0.3)
    assert client_b.change_state('deactivate', timeout=30.0)
    outcome = run.result(30.0)
    assert outcome.result.stop_reason == 'interrupted'
    assert outcome.status == GoalStatus.STATUS_SUCCEEDED
    assert client_b.get_state() == 'inactive'
    assert not client_b.start_generate('hi', max_new_tokens=2).accepted

    # reactivation keeps the live state and the capsules
    assert client_b.change_state('activate', timeout=30.0)
    assert 'b_capsule' in {c.name for c in client_b.list_capsules().capsules}
    assert client_b.generate('Back.', max_new_tokens=3).result.success

    # cleanup frees the runtime; configure + activate builds home again
    assert client_b.change_state('deactivate')
    assert client_b.change_state('cleanup', timeout=30.0)
    assert client_b.get_state() == 'unconfigured'
    assert not client_b.list_capsules().success
    assert client_b.change_state('configure', timeout=120.0)
    assert client_b.change_state('activate', timeout=60.0)
    names = {c.name for c in client_b.list_capsules().capsules}
    assert HOME in names and 'b_capsule' not in names  # memory capsules went with cleanup


def test_fingerprint_mismatch(client, client_b, at_home, capsule_dir):
    if client_b.get_state() != 'active':
        assert client_b.change_state('configure', timeout=120.0)
        assert client_b.change_state('activate', timeout=60.0)
    response = client_b.snapshot('foreign', tier='disk')
    assert response.success, response.message
    assert os.path.isfile(os.path.join(capsule_dir, 'foreign.safetensors'))
    listed = {c.name: c for c in client.list_capsules().capsules}  # node A sees the file
    assert listed['foreign'].tier == 'disk'
    assert listed['foreign'].fingerprint != listed[HOME].fingerprint
    response = client.restore('foreign')
    assert not response.success
    assert 'different model' in response.message, response.message
    assert client.state_digest() == at_home
    out = client.generate('foreign', start_from='foreign', max_new_tokens=2)
    assert not out.result.success and 'different model' in out.result.message
    assert client.state_digest() == at_home
    assert client_b.restore('foreign').success  # fine in the node that wrote it
    assert client_b.delete_capsule('foreign').success


def test_unreadable_capsule_file_is_named_in_the_listing(client, at_home, capsule_dir):
    assert client.snapshot('old-release', tier='disk').success
    path = os.path.join(capsule_dir, 'old-release.safetensors')
    os.truncate(path, os.path.getsize(path) - 100)  # our header, a short body
    response = client.list_capsules()
    assert response.success and 'old-release' not in {c.name for c in response.capsules}
    assert '1 unreadable capsule files on disk' in response.message, response.message
    assert 'old-release' in response.message
    response = client.restore('old-release')
    assert not response.success and 'delete it' in response.message, response.message
    assert client.state_digest() == at_home
    assert client.delete_capsule('old-release').success
    assert 'unreadable' not in client.list_capsules().message


def test_sigint_during_generation_exits_zero(client_b, node_b):
    if client_b.get_state() != 'active':
        assert client_b.change_state('activate', timeout=60.0)
    run = client_b.start_generate('Keep talking.', max_new_tokens=400)
    assert run.accepted
    time.sleep(0.3)
    t0 = time.monotonic()
    code = node_b.stop(signal.SIGINT, timeout=30.0)
    assert code == 0, node_b.log()[-3000:]
    assert time.monotonic() - t0 < 15.0
    assert 'shutting down' in node_b.log()


def test_sigterm_while_loading_exits_zero(tmp_path, capsule_dir, client):
    proc = NodeProcess(str(tmp_path), dict(B_PARAMS, capsule_dir=capsule_dir, autostart=True),
                       name='flashrt_c')
    try:
        # The node exists (signal handlers installed) and is loading its model.
        deadline = time.monotonic() + 60.0
        while 'flashrt_c' not in client.node.get_node_names():
            assert time.monotonic() < deadline, proc.log()[-3000:]
            time.sleep(0.05)
    finally:
        code = proc.stop(signal.SIGTERM, timeout=60.0)
    assert code == 0, proc.log()[-3000:]
