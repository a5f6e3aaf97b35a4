"""A LeRobot ACT checkpoint over real DDS: a camera and joint states in, stamped chunks out."""

import time

from builtin_interfaces.msg import Time
from flashrt_ros.node_process import NodeProcess
from flashrt_ros.runtime.models.lerobot import save_act_checkpoint
from node_harness import EventLog, HOME, start_client, wait_active, wait_until
import pytest

JOINTS = [f'joint_{i}' for i in range(6)]
HEIGHT, WIDTH = 48, 64  # the checkpoint's camera (save_act_checkpoint's tiny ACT)
CAMERA_TOPIC = '/camera/top/image_raw'


@pytest.fixture(scope='module')
def act(tmp_path_factory, capsule_dir):
    """Start a node serving a tiny ACT checkpoint; its client, chunks and events."""
    workdir = tmp_path_factory.mktemp('act_node')
    folder = save_act_checkpoint(workdir / 'act', seed=3)
    proc = NodeProcess(str(workdir), {
        'mode': 'policy', 'model': str(folder), 'capsule_dir': capsule_dir,
        'joint_names': JOINTS, 'image_topics': [f'top={CAMERA_TOPIC}'],
        'control_rate': 20.0, 'max_observation_age': 1.0, 'sync_slop': 0.02,
    }, name='flashrt_act')
    client = start_client('flashrt_act')
    try:
        wait_active(client, proc)
        assert client.wait_for_subscribers(10.0, 'observation')
        assert wait_until(lambda: client.node.count_subscribers(CAMERA_TOPIC) > 0)
        chunks, events = [], EventLog(client)
        assert client.wait_for_publishers(client.subscribe_actions(chunks.append))
        # The client creates its camera and joint-state publishers on first use, and a
        # message sent before the node has matched one is lost: observe until a chunk comes.
        assert any(_observe(client, chunks, level=1) is not None for _ in range(5))
        assert client.restore(HOME).success
        yield client, chunks, events
    finally:
        client.close()
        assert proc.stop() == 0, proc.log()[-3000:]


def _pixels(level, height=HEIGHT, width=WIDTH):
    return bytes([level % 256]) * (3 * height * width)


def _observe(client, chunks, level=100, stamp=None, image=True, height=HEIGHT, width=WIDTH,
             encoding='rgb8', pixels=None):
    """Publish a joint state and (optionally) an image with one stamp; return the new chunk."""
    start = len(chunks)
    stamp = stamp or client.now()
    if image:
        pixels = pixels if pixels is not None else _pixels(level, height, width)
        client.publish_image('top', pixels, height, width, encoding, stamp, topic=CAMERA_TOPIC)
    client.publish_joint_state(JOINTS, [level / 100.0 + 0.1 * i for i in range(6)], stamp=stamp)
    wait_until(lambda: len(chunks) > start, timeout=5.0)
    return chunks[start] if len(chunks) > start else None


def test_a_camera_and_a_joint_state_give_a_chunk_stamped_with_their_time(act):
    client, chunks, _ = act
    assert client.restore(HOME).success
    stamp = Time(sec=int(time.time()), nanosec=123456789)
    chunk = _observe(client, chunks, stamp=stamp)
    assert chunk is not None, 'no ActionChunk for the matched observation'
    assert (chunk.header.stamp.sec, chunk.header.stamp.nanosec) == (stamp.sec, stamp.nanosec)
    assert chunk.horizon == 10 and chunk.action_dim == 6 and list(chunk.names) == JOINTS
    assert chunk.dt == pytest.approx(0.05)


def test_a_restore_replays_the_same_chunk_bit_for_bit(act):
    client, chunks, _ = act
    assert client.restore(HOME).success
    _observe(client, chunks, level=30)
    assert client.snapshot('act_decision').success
    first = _observe(client, chunks, level=60)
    assert client.restore('act_decision').success
    again = _observe(client, chunks, level=60)
    assert first is not None and again is not None
    assert list(again.actions) == list(first.actions)
    other = _observe(client, chunks, level=200)
    assert list(other.actions) != list(first.actions), 'the camera must change the chunk'


def test_a_picture_of_another_size_is_resized(act):
    client, chunks, _ = act
    assert _observe(client, chunks, height=2 * HEIGHT, width=2 * WIDTH) is not None


@pytest.mark.parametrize('bad, says', [
    ({'encoding': 'yuv422'}, "image encoding 'yuv422' is not taken"),
    ({'pixels': _pixels(1)[:-5]}, 'must hold'),
    ({'stamp': Time(sec=int(time.time()) - 30)}, 'more than max_observation_age'),
    ({'image': False}, 'no observation.images.top came within sync_slop'),
])
def test_a_bad_or_missing_camera_input_is_refused_and_changes_nothing(act, bad, says):
    client, chunks, events = act
    assert client.restore(HOME).success
    time.sleep(1.2)  # older than max_observation_age: the last good picture
    digest, start = client.state_digest(), len(events.events)
    assert _observe(client, chunks, **bad) is None
    if not bad.get('image', True):  # a robot streams joint states: the camera stays silent
        for _ in range(30):
            client.publish_joint_state(JOINTS, [0.0] * 6)
            time.sleep(0.05)
    event = events.wait_for(lambda e: e.operation == 'observation' and says in e.message,
                            start=start, timeout=5.0)
    assert event is not None and not event.success, [e.message for e in events.events[start:]]
    assert 'state unchanged' in event.message
    assert client.state_digest() == digest
