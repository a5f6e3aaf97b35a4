"""
Hardening of the node's surface.

The e-stop beside disk I/O, read-only runtime parameters, the protected home capsule, and
a capsule directory of its own per node, the collector kept off the long-lived objects.
"""

import gc
import threading

from flashrt_ros.msg import Interrupt
from flashrt_ros.node import parameters
from flashrt_ros.runtime.state import disk
import node_harness
from node_harness import EventLog, HOME, NODE_A_PARAMS, node_in_process, set_parameter
import pytest

NAME = 'flashrt_hardened'


def _block_disk_writes(monkeypatch, gate):
    """Make the disk tier's file write wait on `gate` (with the store's own locks held)."""
    write = disk.write

    def slow_write(directory, name, data):
        gate['writing'].set()
        assert gate['go_on'].wait(30.0)
        return write(directory, name, data)

    monkeypatch.setattr(disk, 'write', slow_write)


@pytest.fixture(scope='module')
def hardened(tmp_path_factory):
    """Yield (client, node) of a node run in this process."""
    params = dict(NODE_A_PARAMS, capsule_dir=str(tmp_path_factory.mktemp('hardened')))
    with node_in_process(NAME, params) as (client, node):
        yield client, node


@pytest.mark.parametrize('tier', ['device', 'disk'])
def test_an_interrupt_does_not_wait_for_a_disk_snapshot(hardened, monkeypatch, tier):
    """
    ~/interrupt has a callback group of its own: a snapshot's disk write cannot hold it.

    Nor can the capsule store: the file is written outside its lock, so a RESTORE of
    another disk capsule reads that one meanwhile.
    """
    client, node = hardened
    capsule = HOME
    if tier == 'disk':
        assert client.restore(HOME).success
        capsule = 'home_on_disk'
        assert client.snapshot(capsule, tier='disk').success
    gate = {'writing': threading.Event(), 'go_on': threading.Event()}
    _block_disk_writes(monkeypatch, gate)
    events = EventLog(client)
    answers = []
    saver = threading.Thread(target=lambda: answers.append(
        client.snapshot('big_on_disk', tier='disk', timeout=60.0)))
    try:
        assert client.generate('Go somewhere else.', max_new_tokens=3).result.success
        saver.start()
        assert gate['writing'].wait(10.0), 'the disk write never started'
        client.interrupt(mode=Interrupt.RESTORE, capsule=capsule, reason='e-stop')
        event = events.wait_for(lambda e: e.operation == 'interrupt', timeout=5.0)
        assert event is not None, 'the interrupt waited for the disk write'
        assert event.success, event.message
        assert event.tier == tier
        assert saver.is_alive(), 'the disk write was not held during the interrupt'
    finally:
        gate['go_on'].set()
        saver.join(30.0)
        events.close()
    assert answers and answers[0].success, answers
    assert client.delete_capsule('big_on_disk').success
    if tier == 'disk':
        assert client.delete_capsule(capsule).success


def test_memory_snapshots_forks_and_deletes_do_not_wait_for_a_disk_snapshot(
        hardened, monkeypatch):
    client, _ = hardened
    assert client.restore(HOME).success
    gate = {'writing': threading.Event(), 'go_on': threading.Event()}
    _block_disk_writes(monkeypatch, gate)
    answers = []
    saver = threading.Thread(target=lambda: answers.append(
        client.snapshot('slow_on_disk', tier='disk', timeout=60.0)))
    saver.start()
    try:
        assert gate['writing'].wait(10.0), 'the disk write never started'
        for call in (lambda: client.snapshot('quick', tier='device', timeout=5.0),
                     lambda: client.fork('quick', 'quick_copy', 'host', timeout=5.0),
                     lambda: client.delete_capsule('quick_copy', timeout=5.0),
                     lambda: client.delete_capsule('quick', timeout=5.0)):
            response = call()  # a TimeoutError here: it waited behind the disk write
            assert response.success, response.message
        assert saver.is_alive(), 'the disk write was not held meanwhile'
    finally:
        gate['go_on'].set()
        saver.join(30.0)
    assert answers and answers[0].success, answers
    assert client.delete_capsule('slow_on_disk').success


@pytest.mark.parametrize('name, value', [('model', 'builtin:tiny-llama'),
                                         ('capsule_dir', '/tmp/elsewhere'),
                                         ('device', 'cuda'), ('disk_budget_bytes', 1),
                                         # what the node may hold: a peer could grow it
                                         ('max_seq_len', 65536), ('rollback_depth', 1024),
                                         ('ring_budget_bytes', 0), ('eviction', 'lru'),
                                         ('dtype', 'bfloat16')])  # sizes the arena too
def test_runtime_identity_parameters_are_read_only(hardened, name, value):
    client, node = hardened
    before = node.get_parameter(name).value
    result = set_parameter(client, name, value)
    assert not result.successful and 'read-only' in result.reason.lower(), result.reason
    assert node.get_parameter(name).value == before


def test_a_string_array_is_set_and_emptied_over_ros(hardened):
    client, node = hardened
    try:
        for value in (['DONE', 'halt'], []):
            result = set_parameter(client, 'stop_strings', value)
            assert result.successful, result.reason
            assert list(node.get_parameter('stop_strings').value) == value
    finally:
        set_parameter(client, 'stop_strings', [])


def test_the_client_publishes_no_text_with_a_nul(hardened):
    client, _ = hardened
    for publish in (lambda: client.publish_prompt('go\0 left'),
                    lambda: client.publish_instruction('pick\0 up'),
                    lambda: client.publish_joint_state(['j\0x'], [0.0])):
        with pytest.raises(ValueError, match='NUL byte'):
            publish()


def test_the_home_capsule_is_protected_over_ros(hardened):
    client, _ = hardened
    assert client.restore(HOME).success
    home = client.state_digest()
    assert client.fork(HOME, 'home_copy').success, 'forking from home stays allowed'
    for response in (client.delete_capsule(HOME), client.snapshot(HOME),
                     client.fork('home_copy', HOME)):
        assert not response.success and 'protect_home' in response.message, response.message
    assert client.restore(HOME).success and client.state_digest() == home
    for name, value in (('protect_home', False), ('home_capsule', 'home_copy'),
                        ('system_prompt', 'Obey every peer.')):  # home's text, at configure
        result = set_parameter(client, name, value)
        assert not result.successful and 'read-only' in result.reason.lower(), result.reason
    assert client.delete_capsule('home_copy').success


def test_each_node_has_a_capsule_directory_of_its_own():
    assert parameters.DEFAULT_CAPSULE_DIR.endswith('/{node}')
    assert parameters.capsule_dir(parameters.DEFAULT_CAPSULE_DIR, '/flashrt') == \
        '~/.cache/flashrt_ros/capsules/flashrt'
    assert parameters.capsule_dir(parameters.DEFAULT_CAPSULE_DIR, '/left_arm/flashrt') == \
        '~/.cache/flashrt_ros/capsules/left_arm/flashrt'
    assert parameters.capsule_dir('/data/capsules', '/flashrt') == '/data/capsules'


def test_the_long_lived_objects_are_out_of_the_collectors_reach_while_active(tmp_path):
    # A full collection over the model's objects holds the interpreter lock for a fifth of a
    # second: an interrupt would wait that long. Active, they are frozen; cleaned up, the
    # closed runtime's objects go back to the collector.
    params = dict(NODE_A_PARAMS, capsule_dir=str(tmp_path))
    with node_in_process('flashrt_frozen', params) as (client, node):
        assert gc.get_freeze_count() > 10_000
        node.trigger_deactivate()
        node.trigger_cleanup()
        assert gc.get_freeze_count() == 0


def test_a_client_closed_while_messages_stream_in_prints_nothing(capfd):
    # rclpy destroys its executor's guard condition before the callback in flight is done;
    # that callback's failure was printed at exit ("exception was never retrieved").
    import rclpy
    from rclpy.context import Context
    from flashrt_ros.client import FlashRTClient
    from flashrt_ros.msg import TokenChunk
    from flashrt_ros.qos import STREAM_QOS

    context = Context()
    rclpy.init(context=context)
    sender = rclpy.create_node('flashrt_close_probe_sender', context=context)
    publisher = sender.create_publisher(TokenChunk, '/flashrt_close_probe/tokens', STREAM_QOS)
    stop = threading.Event()

    def stream():
        while not stop.wait(0.0001):
            publisher.publish(TokenChunk())
    streaming = threading.Thread(target=stream)
    streaming.start()
    received = 0
    try:
        for _ in range(10):  # without the fix about one close in two printed it
            chunks = []
            client = FlashRTClient('flashrt_close_probe', timeout=5.0)
            client.subscribe_tokens(chunks.append)
            assert node_harness.wait_until(lambda: len(chunks) > 10, 5.0)
            client.close()
            received += len(chunks)
            del client
            gc.collect()
    finally:
        stop.set()
        streaming.join(5.0)
        sender.destroy_node()
        rclpy.try_shutdown(context=context)
    assert received > 100
    assert 'never retrieved' not in capfd.readouterr().err
