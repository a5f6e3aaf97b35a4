"""Policy mode over real DDS: observations in, action chunks out, capsules, interrupts."""

import math
import time

from flashrt_ros.msg import Interrupt
from flashrt_ros.node_process import NodeProcess
from node_harness import EventLog, HOME, start_client, wait_active
import pytest
from trajectory_msgs.msg import JointTrajectory

JOINTS = ['shoulder', 'elbow']
POLICY_PARAMS = {
    'mode': 'policy',
    'model': 'builtin:tiny-policy',
    'max_seq_len': 256,
    'publish_joint_trajectory': True,
    'trajectory_field': 'effort',
    'control_rate': 10.0,
    'diagnostics_period': 1.0,
}


@pytest.fixture(scope='module')
def nodes(tmp_path_factory, capsule_dir):
    """Start an observation-stepped and a timer-stepped policy node; they boot in parallel."""
    workdir = str(tmp_path_factory.mktemp('policy_nodes'))
    procs = {
        'flashrt_policy': NodeProcess(workdir, dict(POLICY_PARAMS, capsule_dir=capsule_dir),
                                      name='flashrt_policy'),
        'flashrt_timer': NodeProcess(workdir, dict(POLICY_PARAMS, capsule_dir=capsule_dir,
                                                   stepping='timer'), name='flashrt_timer'),
        # a tick every 2 s: an observation waits long enough for a restore to overtake it
        'flashrt_slow': NodeProcess(workdir, dict(POLICY_PARAMS, capsule_dir=capsule_dir,
                                                  stepping='timer', control_rate=0.5),
                                    name='flashrt_slow'),
    }
    yield procs
    for proc in procs.values():
        assert proc.stop() == 0, proc.log()[-2000:]


class _Actions:
    """A client of one policy node plus the ActionChunks it published, in arrival order."""

    def __init__(self, name, proc):
        self.client = start_client(name)
        wait_active(self.client, proc)
        assert self.client.wait_for_subscribers(10.0, 'observation'), 'no subscription'
        self.chunks = []
        assert self.client.wait_for_publishers(self.client.subscribe_actions(self.chunks.append))

    def wait_for(self, predicate, timeout=10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [c for c in self.chunks if predicate(c)]
            if found:
                return found[0]
            time.sleep(0.01)
        return None

    def step(self, positions, velocities=(0.0, 0.0)):
        """Publish one JointState and return the chunk of the control step it caused."""
        start = len(self.chunks)
        self.client.publish_joint_state(JOINTS, positions, velocities)
        deadline = time.monotonic() + 10.0
        while len(self.chunks) == start and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(self.chunks) > start, 'no ActionChunk for the observation'
        return self.chunks[start]


@pytest.fixture(scope='module')
def policy(nodes):
    a = _Actions('flashrt_policy', nodes['flashrt_policy'])
    yield a
    a.client.close()


@pytest.fixture(scope='module')
def timer(nodes):
    a = _Actions('flashrt_timer', nodes['flashrt_timer'])
    yield a
    a.client.close()


@pytest.fixture(scope='module')
def slow(nodes):
    a = _Actions('flashrt_slow', nodes['flashrt_slow'])
    yield a
    a.client.close()


def _home(actions):
    assert actions.client.restore(HOME).success
    return actions.client.state_digest()


def test_observations_give_chunks_and_capsule_services_work(policy):
    client = policy.client
    home = {c.name: c for c in client.list_capsules().capsules}[HOME]
    assert home.position == 0 and 'actions' in home.components
    home_digest = _home(policy)
    chunk = policy.step([0.1, -0.2])
    assert chunk.step == 1 and chunk.horizon == 8 and chunk.action_dim == 2
    assert list(chunk.names) == JOINTS and len(chunk.actions) == 16
    assert all(math.isfinite(a) and abs(a) <= 2.0 for a in chunk.actions)

    snap = client.snapshot('decision')
    assert snap.success and snap.capsule.position == 1, snap.message
    digest = client.state_digest()
    branch_a = [list(policy.step([0.1 * i, 0.2]).actions) for i in range(3)]
    assert client.restore('decision').success and client.state_digest() == digest
    branch_b = [list(policy.step([-0.1 * i, 0.5]).actions) for i in range(3)]
    assert branch_b != branch_a
    assert client.fork('decision', 'decision_copy').success
    assert client.restore('decision_copy').success and client.state_digest() == digest
    replay = [list(policy.step([0.1 * i, 0.2]).actions) for i in range(3)]
    assert replay == branch_a, 'replay after restore must give the same actions, bit for bit'

    rolled = client.rollback(1)
    assert rolled.success and rolled.position == 3, rolled.message
    for name in ('decision', 'decision_copy'):
        assert client.delete_capsule(name).success
    assert client.restore(HOME).success and client.state_digest() == home_digest


def test_joint_trajectory_carries_the_chunk(policy):
    trajectories = []
    assert policy.client.wait_for_publishers(policy.client.node.create_subscription(
        JointTrajectory, '/flashrt_policy/joint_trajectory', trajectories.append, 10))
    _home(policy)
    chunk = policy.step([0.3, 0.3])
    deadline = time.monotonic() + 5.0
    while not trajectories and time.monotonic() < deadline:
        time.sleep(0.01)
    assert trajectories, 'no JointTrajectory published'
    trajectory = trajectories[-1]
    assert list(trajectory.joint_names) == JOINTS and len(trajectory.points) == 8
    assert [p.time_from_start.nanosec for p in trajectory.points[:2]] == [100000000, 200000000]
    assert list(trajectory.points[0].effort) == pytest.approx(list(chunk.actions[:2]))


def test_bad_observations_are_rejected_with_an_event(policy):
    digest = _home(policy)
    events = EventLog(policy.client)
    try:
        published = len(policy.chunks)
        bad = [
            (lambda: policy.client.publish_observation([0.1, 0.2, 0.3]), 'shape'),
            (lambda: policy.client.publish_observation([0.1, math.nan, 0.0, 0.0]), 'NaN'),
            (lambda: policy.client.publish_joint_state(['shoulder'], [0.1], [0.0]), 'elbow'),
            (lambda: policy.client.publish_joint_state(JOINTS, [0.1, 0.2]), 'velocity'),
        ]
        for publish, words in bad:
            start = len(events.events)
            publish()
            event = events.wait_for(lambda e: e.operation == 'observation', start=start)
            assert event is not None and not event.success, words
            assert words in event.message and 'state unchanged' in event.message
        assert policy.client.state_digest() == digest
        assert len(policy.chunks) == published, 'a rejected observation produced actions'
        assert policy.step([0.0, 0.0]).step == 1  # and the node keeps serving
    finally:
        events.close()


def test_generate_is_refused_in_policy_mode(policy):
    outcome = policy.client.start_generate('hello', max_new_tokens=2)
    assert not outcome.accepted


def test_reset_restores_home(policy):
    digest = _home(policy)
    policy.step([0.4, 0.1])
    assert policy.client.state_digest() != digest
    policy.client.reset()
    deadline = time.monotonic() + 5.0
    while policy.client.state_digest() != digest and time.monotonic() < deadline:
        time.sleep(0.02)
    assert policy.client.state_digest() == digest


def _stamp(msg):
    return msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9


def test_no_action_of_an_interrupted_chunk_after_the_interrupt(timer):
    _home(timer)
    events = EventLog(timer.client)
    try:
        timer.client.publish_joint_state(JOINTS, [0.2, -0.1], [0.0, 0.0])
        first = timer.wait_for(lambda c: c.step == 1)  # one action per 0.1 s tick
        assert first is not None and first.horizon == 1, 'the timer published no action'
        start = len(events.events)
        timer.client.interrupt(mode=Interrupt.STOP, reason='e-stop')
        event = events.wait_for(lambda e: e.operation == 'interrupt', start=start)
        assert event is not None and event.success, event
        assert 'action queue dropped' in event.message
        time.sleep(1.0)  # more than the rest of the 8-action chunk would take
        interrupted = [c for c in timer.chunks if c.step == 1]
        late = [c for c in interrupted if _stamp(c) > _stamp(event)]
        assert not late, f'{len(late)} actions of the interrupted chunk after the interrupt'
        assert len(interrupted) < 8
        # a fresh observation starts a fresh chunk
        timer.client.publish_joint_state(JOINTS, [0.2, -0.1], [0.0, 0.0])
        assert timer.wait_for(lambda c: c.step == 2) is not None
    finally:
        events.close()
        timer.client.interrupt(mode=Interrupt.STOP)


@pytest.mark.parametrize('how', ['restore', 'deactivate'])
def test_an_observation_from_before_a_restore_or_deactivate_is_not_folded_in(slow, how):
    client = slow.client
    for _ in range(3):
        home = _home(slow)
        ticks = len(slow.chunks)
        client.publish_joint_state(JOINTS, [0.2, -0.1], [0.0, 0.0])  # the next tick is <= 2 s off
        time.sleep(0.05)
        if how == 'restore':
            assert client.restore(HOME).success
        else:
            assert client.change_state('deactivate', timeout=30.0)
        early = len(slow.chunks) > ticks  # a tick took the observation in before it
        if how == 'deactivate':
            assert client.change_state('activate', timeout=30.0)
        if early:
            continue
        time.sleep(2.5)  # more than a tick
        assert client.state_digest() == home, f'an observation from before the {how} was folded in'
        return
    pytest.fail('a control tick came between the observation and the restore every time')
