"""Capsule services over real DDS: happy paths, bad inputs, and the node keeps serving."""

import glob
import os
import threading

from node_harness import HOME


def _names(response):
    return {c.name: c for c in response.capsules}


def test_home_capsule_taken_at_activation(client):
    response = client.list_capsules()
    assert response.success, response.message
    home = _names(response)[HOME]
    assert home.tier == 'device' and home.pinned
    assert home.position == len('You are a helpful robot.')
    assert set(home.components) >= {'kv', 'conv', 'recurrent'}
    assert len(home.fingerprint) == 64
    assert 'live position' in response.message


def test_state_digest_service(client, at_home):
    assert len(at_home) == 64 and int(at_home, 16) >= 0
    assert client.state_digest() == at_home


def test_snapshot_restore_round_trip(client, at_home, events):
    outcome = client.generate('Hello', max_new_tokens=6)
    assert outcome.result.success, outcome.message
    after = client.state_digest()
    assert after != at_home
    start = len(events.events)
    response = client.snapshot('after_hello')
    assert response.success, response.message
    assert response.capsule.name == 'after_hello' and response.capsule.tier == 'device'
    assert response.capsule.position == outcome.result.position
    assert response.capsule.size_bytes > 0 and response.latency_ms > 0.0
    event = events.wait_for(lambda e: e.operation == 'snapshot' and e.name == 'after_hello',
                            start=start)
    assert event is not None and event.success and event.size_bytes > 0
    assert event.latency_ms > 0.0

    response = client.restore(HOME)
    assert response.success, response.message
    assert client.state_digest() == at_home
    assert response.capsule.name == HOME and response.latency_ms > 0.0
    response = client.restore('after_hello')
    assert response.success, response.message
    assert client.state_digest() == after
    event = events.wait_for(lambda e: e.operation == 'restore' and e.name == 'after_hello',
                            start=start)
    assert event is not None and event.success
    assert client.delete_capsule('after_hello').success


def test_host_and_disk_tiers(client, at_home, capsule_dir):
    for tier in ('host', 'disk'):
        response = client.snapshot(f'tier_{tier}', tier=tier)
        assert response.success, response.message
        assert response.capsule.tier == tier
    assert os.path.isfile(os.path.join(capsule_dir, 'tier_disk.safetensors'))
    listed = client.list_capsules(tier='disk')
    assert listed.success and 'tier_disk' in _names(listed)
    assert 'tier_host' not in _names(listed)
    assert _names(client.list_capsules(tier='host'))['tier_host'].tier == 'host'
    client.generate('x', max_new_tokens=2)
    for tier in ('host', 'disk'):
        response = client.restore(f'tier_{tier}')
        assert response.success, response.message
        assert client.state_digest() == at_home
        deleted = client.delete_capsule(f'tier_{tier}')
        assert deleted.success and deleted.freed_bytes > 0, deleted.message
    assert not os.path.exists(os.path.join(capsule_dir, 'tier_disk.safetensors'))


def test_bad_names_answer_false_and_keep_state(client, at_home, events):
    start = len(events.events)
    for name in ('', '../escape', 'a/b', 'x' * 200, 'bad name'):
        response = client.snapshot(name)
        assert not response.success
        assert 'name' in response.message, response.message
    response = client.restore('no_such_capsule')
    assert not response.success
    assert 'not found' in response.message and 'list_capsules' in response.message
    response = client.restore('../etc/passwd')
    assert not response.success and 'not allowed' in response.message
    assert not client.delete_capsule('no_such_capsule').success
    failed = events.wait_for(lambda e: e.operation == 'restore' and not e.success, start=start)
    assert failed is not None and 'not found' in failed.message
    assert client.state_digest() == at_home
    assert client.list_capsules().success


def test_wrong_tier_and_mode(client, at_home):
    response = client.snapshot('tiered', tier='gpu')
    assert not response.success
    assert 'device' in response.message and 'disk' in response.message
    assert not client.list_capsules(tier='gpu').success
    response = client.fork(HOME, 'tiered', tier='floppy')
    assert not response.success and 'tier' in response.message
    response = client.restore(HOME, mode='half')
    assert not response.success and 'kv_only' in response.message
    assert 'tiered' not in _names(client.list_capsules())
    assert client.state_digest() == at_home


def test_kv_only_restore_mode(client, at_home):
    client.generate('state', max_new_tokens=4)
    response = client.restore(HOME, mode='kv_only')
    assert response.success, response.message
    # The ablation leaves the recurrent/conv state of the newer turn in place.
    assert client.state_digest() != at_home


def test_fork_and_branches_stay_independent(client, at_home):
    response = client.fork(HOME, 'branch')
    assert response.success, response.message
    assert response.capsule.name == 'branch' and response.capsule.tier == 'device'
    first = client.generate(' Go left.', start_from='branch', save_as='branch', max_new_tokens=6)
    assert first.result.success, first.message
    other = client.generate(' Go right.', start_from=HOME, max_new_tokens=6)
    assert other.result.success
    assert client.restore(HOME).success and client.state_digest() == at_home
    again = client.generate(' Go left.', start_from=HOME, max_new_tokens=6)
    assert again.token_ids == first.token_ids
    branch = _names(client.list_capsules())['branch']
    assert branch.position == first.result.position
    assert not client.fork('missing', 'x').success
    response = client.fork(HOME, HOME)
    assert not response.success and 'differ' in response.message
    assert not client.fork(HOME, '../x').success
    response = client.fork(HOME, 'branch_disk', tier='disk')
    assert response.success and response.capsule.tier == 'disk'
    for name in ('branch', 'branch_disk'):
        assert client.delete_capsule(name).success


def test_rollback(client, at_home):
    client.generate('Step one.', max_new_tokens=4)
    response = client.rollback(2)  # before the prompt and the reply
    assert response.success, response.message
    assert response.position == len('You are a helpful robot.')
    assert client.state_digest() == at_home
    response = client.rollback(1000)
    assert not response.success and 'rollback_depth' in response.message
    assert client.state_digest() == at_home


def test_corrupt_disk_file(client, at_home, capsule_dir):
    assert client.snapshot('to_corrupt', tier='disk').success
    path = os.path.join(capsule_dir, 'to_corrupt.safetensors')
    with open(path, 'r+b') as f:
        f.seek(-64, os.SEEK_END)
        data = bytearray(f.read(16))
        f.seek(-64, os.SEEK_END)
        f.write(bytes(b ^ 0xFF for b in data))
    client.generate('move on', max_new_tokens=2)
    before = client.state_digest()
    response = client.restore('to_corrupt')
    assert not response.success
    assert 'checksum' in response.message and 'delete' in response.message, response.message
    assert client.state_digest() == before
    with open(os.path.join(capsule_dir, 'garbage.safetensors'), 'wb') as f:
        f.write(b'this is not a capsule')
    response = client.restore('garbage')
    assert not response.success and 'not a capsule' in response.message, response.message
    assert client.state_digest() == before
    assert client.delete_capsule('to_corrupt').success
    os.remove(os.path.join(capsule_dir, 'garbage.safetensors'))
    assert client.restore(HOME).success


def test_delete_unreadable_disk_file(client, capsule_dir):
    assert client.snapshot('unreadable', tier='disk').success
    path = os.path.join(capsule_dir, 'unreadable.safetensors')
    os.truncate(path, os.path.getsize(path) - 100)  # our header, a short body
    foreign = os.path.join(capsule_dir, 'foreign.safetensors')
    with open(foreign, 'wb') as f:
        f.write(b'this is not a capsule')
    try:
        response = client.delete_capsule('unreadable')
        assert response.success, response.message
        assert not os.path.exists(path)
        response = client.delete_capsule('foreign')  # not ours: left alone
        assert not response.success and 'not a capsule' in response.message, response.message
        assert os.path.exists(foreign)
        listing = client.list_capsules()
        assert 'foreign' not in [c.name for c in listing.capsules]
        assert 'not capsules, left alone (foreign' in listing.message, \
            listing.message
    finally:
        for leftover in (path, foreign):
            if os.path.exists(leftover):
                os.remove(leftover)


def test_full_budget_refuses_then_recovers(client, at_home):
    taken, refusal = [], None
    for i in range(12):
        response = client.snapshot(f'fill_{i}', tier='host')
        if not response.success:
            refusal = response.message
            break
        taken.append(f'fill_{i}')
    assert taken, 'no host capsule fitted at all'
    assert refusal is not None, 'the 400000-byte host budget never filled up'
    assert 'host' in refusal and 'full' in refusal, refusal
    assert f'fill_{len(taken)}' not in _names(client.list_capsules())
    assert client.state_digest() == at_home
    for name in taken:
        assert client.delete_capsule(name).success
    response = client.snapshot('after_full', tier='host')
    assert response.success, response.message
    assert client.delete_capsule('after_full').success


def test_concurrent_service_calls(client, at_home):
    errors = []

    def worker(i):
        try:
            for _ in range(5):
                assert client.snapshot(f'conc_{i}').success
                assert client.list_capsules().success
                assert client.restore(HOME).success
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert client.state_digest() == at_home
    for i in range(3):
        assert client.delete_capsule(f'conc_{i}').success


def test_diagnostics(client):
    from diagnostic_msgs.msg import DiagnosticArray
    received = []
    done = threading.Event()

    def on_diag(msg):
        for status in msg.status:
            if 'flashrt' in status.name:
                received.append({kv.key: kv.value for kv in status.values})
                done.set()

    sub = client.node.create_subscription(DiagnosticArray, '/diagnostics', on_diag, 10)
    try:
        assert done.wait(10.0), 'no /diagnostics message from the node'
    finally:
        client.node.destroy_subscription(sub)
    values = received[0]
    for key in ('state_bytes', 'device_capsules', 'device_bytes_used', 'host_capsules',
                'disk_capsules', 'last_restore_ms', 'p99_restore_ms', 'last_restore_copied_bytes',
                'decode_tokens_per_s', 'kernels', 'disk_temp_bytes', 'cpu_step'):
        assert key in values, key
    assert values['cpu_step'] == 'off (cpu_step: false)'  # NODE_A_PARAMS
    assert int(values['state_bytes']) > 0 and int(values['device_capsules']) >= 1
    assert values['lifecycle_state'] == 'active'


def test_no_stray_files(capsule_dir):
    assert not glob.glob(os.path.join(capsule_dir, '.*.tmp'))
