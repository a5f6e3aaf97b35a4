"""A LeRobot SmolVLA checkpoint over real DDS: an instruction topic, a camera, joint states."""

from flashrt_ros.node_process import NodeProcess
from flashrt_ros.runtime.models.smolvla import save_smolvla_checkpoint, save_tiny_vlm
from node_harness import EventLog, HOME, start_client, wait_active, wait_until
import pytest

JOINTS = [f'joint_{i}' for i in range(6)]
HEIGHT, WIDTH = 48, 64  # the tiny SmolVLA's camera


@pytest.fixture(scope='module')
def vla(tmp_path_factory, capsule_dir):
    """Start a node serving a tiny SmolVLA; its instruction is published before it starts."""
    workdir = tmp_path_factory.mktemp('vla_node')
    vlm = save_tiny_vlm(workdir / 'vlm')
    folder = save_smolvla_checkpoint(workdir / 'smolvla', vlm_folder=vlm, seed=5)
    client = start_client('flashrt_vla')
    client.publish_instruction('pick up the cube')  # transient local: the node gets it late
    proc = NodeProcess(str(workdir), {
        'mode': 'policy', 'model': str(folder), 'capsule_dir': capsule_dir,
        'joint_names': JOINTS, 'max_observation_age': 0.0,
    }, name='flashrt_vla')
    try:
        wait_active(client, proc)
        assert client.wait_for_subscribers(10.0, 'observation')
        chunks, events = [], EventLog(client)
        assert client.wait_for_publishers(client.subscribe_actions(chunks.append))
        # The client makes its camera and joint-state publishers on first use and the camera
        # is best effort: a first image can be lost. Observe until a chunk comes (each test
        # restores home first).
        assert any(_chunk_for(client, chunks, 1, 5.0) is not None for _ in range(5))
        yield client, chunks, events
    finally:
        client.close()
        assert proc.stop() == 0, proc.log()[-3000:]


def _chunk_for(client, chunks, level, timeout):
    """Publish an image and a joint state with one stamp; return the chunk's actions or None."""
    start, stamp = len(chunks), client.now()
    client.publish_image('top', bytes([level]) * (3 * HEIGHT * WIDTH), HEIGHT, WIDTH,
                         stamp=stamp)
    client.publish_joint_state(JOINTS, [0.1 * i for i in range(6)], stamp=stamp)
    if not wait_until(lambda: len(chunks) > start, timeout=timeout):
        return None
    return list(chunks[start].actions)


def _observe(client, chunks, level=100):
    actions = _chunk_for(client, chunks, level, 10.0)
    assert actions is not None, 'no ActionChunk'
    return actions


def test_the_home_capsule_holds_the_instruction_given_before_activation(vla):
    client, chunks, events = vla
    assert client.restore(HOME).success
    home_chunk = _observe(client, chunks)
    start = len(events.events)
    client.publish_instruction('open the drawer')
    event = events.wait_for(lambda e: e.operation == 'instruction', start=start)
    assert event is not None and event.success and 'queue dropped' in event.message
    assert _observe(client, chunks) != home_chunk, 'the new instruction must change the plan'
    assert client.restore(HOME).success
    assert _observe(client, chunks) == home_chunk, 'home holds the instruction and the RNG'


def test_a_too_long_instruction_is_refused_and_the_one_in_force_stays(vla):
    client, chunks, events = vla
    assert client.restore(HOME).success
    digest, start = client.state_digest(), len(events.events)
    client.publish_instruction('pick up the cube ' * 40)
    event = events.wait_for(lambda e: e.operation == 'instruction', start=start)
    assert event is not None and not event.success
    assert 'the instruction in force is unchanged' in event.message, event.message
    assert client.state_digest() == digest
