"""
The `make demo-policy` session: execution-state capsules for a robot policy, over ROS 2.

Starts the flashrt node in policy mode with an ACT policy in LeRobot's checkpoint format
(builtin:act-arm: trained here by behaviour cloning to reach a target it sees, one top
camera, temporal ensembling; one control step per observation) and closes the loop with the
simulated planar 2-link arm of reach_task, integrated in plain Python (deterministic): each
step publishes the arm's JointState on ~/observation and a picture of the arm and a green
target from above on ~/image/top with the same stamp, waits for the ActionChunk on ~/actions
and sends its first action (joint targets) to the arm's servos for one control period. The
arm reaches for the target; mid-reach the demo takes a snapshot, lets branch A run, restores,
runs branch B (a push on the elbow, from which the policy recovers), restores again and
replays A (its actions must be equal bit for bit: the ensembling buffer is in the capsule),
rolls back a few control steps, e-stops (the action queue is dropped) and resets to home.
Prints a short report and writes a plot of the reach (demo-policy.png, in FLASHRT_DEMO_OUT or
the current folder), stops the node by PID, exits 0 when every check holds.
`--model builtin:tiny-policy` runs the same session on the joint-state-only random policy.
"""

import math
import os
import sys
import time

from flashrt_ros import reach_task as task
from flashrt_ros.demo import _wait_event, run_demo  # the `make demo` helpers
from flashrt_ros.reach_task import Arm, CAMERA, JOINTS

DECISION_STEP = 8  # the snapshot is taken mid-reach
BRANCH_STEPS = 30
TARGET = (-0.55, 1.45)  # the green disc; the training scenes drew targets at random
START = (-1.2, 0.4)
PUSH = 3.0  # rad/s added to the elbow's speed in branch B
PLOT = 'demo-policy.png'
NOTE = ('act-arm is trained by behaviour cloning, flashrt_ros.train_policy; a random-weight '
        'policy does not aim')


class Loop:
    """The arm and the node in lock step: one observation out, one ActionChunk back."""

    def __init__(self, client, camera, target):
        self.client, self.camera, self.target = client, camera, target
        self.chunks = []
        client.wait_for_publishers(client.subscribe_actions(self.chunks.append), timeout=5.0)

    def observe(self, q, dq, timeout=10.0):
        """Publish one JointState (and picture); return the ActionChunk of its control step."""
        start = len(self.chunks)
        stamp = self.client.now()
        if self.camera:
            self.client.publish_image('top', task.picture(q, self.target).tobytes(), *CAMERA,
                                      stamp=stamp)
        self.client.publish_joint_state(JOINTS, q, dq, stamp=stamp)
        deadline = time.monotonic() + timeout
        while len(self.chunks) == start:
            if time.monotonic() > deadline:
                raise TimeoutError(f'no ActionChunk within {timeout} s; see the node log')
            time.sleep(0.001)
        return self.chunks[start]

    def step(self, arm):
        """Run one control step; return the chunk's actions (a tuple of float32 values)."""
        chunk = self.observe(arm.q, arm.dq)
        arm.step(chunk.actions[:chunk.action_dim])  # the first action: the joint targets
        return tuple(chunk.actions)

    def run(self, arm, steps, path=None):
        """Run `steps` control steps; append the arm after each to `path` (a list) if given."""
        actions = []
        for _ in range(steps):
            actions.append(self.step(arm))
            if path is not None:
                path.append(arm.copy())
        return actions


def _takes_images(client, timeout=3.0):
    """Whether the node subscribes to ~/image/top (a camera policy) once its inputs are up."""
    client.wait_for_subscribers(10.0, 'observation')
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if client.node.count_subscribers(f'{client.base}/image/top'):
            return True
        time.sleep(0.05)
    return False


def _errors(path):
    """Return the tip's distance to the target along a path, every fifth step and the last."""
    picks = [a.error(TARGET) for a in path[4::5]]
    if (len(path) - 1) % 5 != 4:
        picks.append(path[-1].error(TARGET))
    return ' -> '.join(f'{e:.2f}' for e in picks)


def plot(before, branch_a, branch_b, path):
    """Draw the reach (top view) and the tip's error per control step; return the PNG path."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    fig, (top, err) = plt.subplots(1, 2, figsize=(10, 4.2))
    top.add_patch(plt.Circle(TARGET, 4 / task.SCALE, color=(0.35, 0.86, 0.35), label='target'))
    for arms, colour, label in ((before + branch_a, 'tab:blue', 'A: as is'),
                                (branch_b, 'tab:orange', 'B: the elbow pushed')):
        tips = [a.tip() for a in arms]
        top.plot(*zip(*tips), '.-', color=colour, ms=3, lw=1, label=label)
    for arm, style in ((before[0], ':'), (before[-1], '--'), (branch_a[-1], '-')):
        x1, y1 = arm.tip()
        ex, ey = math.cos(arm.q[0]), math.sin(arm.q[0])
        top.plot([0, ex, x1], [0, ey, y1], style, color='0.3', lw=2)
    top.set_aspect('equal')
    top.set_xlim(-2.2, 2.2)
    top.set_ylim(-2.2, 2.2)
    top.set_title("top view: the tip's path (arm at start, decision point, end of A)")
    top.legend(loc='lower left', fontsize=8)
    n = len(before)
    err.plot(range(1, n + len(branch_a) + 1), [a.error(TARGET) for a in before + branch_a],
             color='tab:blue', label='A: as is')
    err.plot(range(n + 1, n + len(branch_b) + 1), [a.error(TARGET) for a in branch_b],
             color='tab:orange', label='B: the elbow pushed at the decision point')
    err.axvline(n, color='0.5', ls='--', lw=1)
    err.set_xlabel(f'control step ({task.DT * 1e3:.0f} ms)')
    err.set_ylabel('tip to target (link lengths)')
    err.set_title('error to the target; the snapshot at the dashed line')
    err.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _run_session(client, report, events, trained):
    from flashrt_ros.msg import Interrupt

    loop = Loop(client, camera=_takes_images(client), target=TARGET)
    report.section('Home capsule (empty policy state, taken at activation)')
    home = {c.name: c for c in client.list_capsules().capsules}['home']
    home_digest = client.state_digest()
    report.line(f'home: step {home.position}, {home.size_bytes} bytes on {home.tier}, '
                f'components {", ".join(home.components)}')

    report.section('Reach: camera + joints -> ~/image/top, ~/observation -> policy -> ~/actions')
    arm = Arm(START)
    report.line(f'target at ({TARGET[0]:+.2f}, {TARGET[1]:+.2f}); the tip starts '
                f'{arm.error(TARGET):.2f} link lengths away')
    t0 = time.perf_counter()
    before, history = [arm.copy()], []
    for _ in range(DECISION_STEP):
        history.append((list(arm.q), list(arm.dq)))
        loop.step(arm)
        before.append(arm.copy())
    loop_ms = (time.perf_counter() - t0) / DECISION_STEP * 1e3
    report.line(f'{DECISION_STEP} control steps, {loop_ms:.1f} ms per round trip over DDS; '
                f'error {_errors(before)}')

    report.section('Decision point: snapshot the policy state (the demo keeps the arm state)')
    snap = client.snapshot('decision')
    decision_arm, decision_digest = arm.copy(), client.state_digest()
    report.line(f'snapshot decision: step {snap.capsule.position}, {snap.capsule.size_bytes} '
                f'bytes, {snap.latency_ms:.3f} ms')
    report.check(snap.success, 'snapshot taken at a committed control step')

    report.section(f'Branch A: {BRANCH_STEPS} more steps as is')
    arm = decision_arm.copy()
    path_a = []
    branch_a = loop.run(arm, BRANCH_STEPS, path_a)
    tip_a, digest_a = task.Arm(arm.q).tip(), client.state_digest()
    report.line(f'error {_errors(path_a)}')
    if trained:
        report.check(arm.error(TARGET) < before[0].error(TARGET) / 4,
                     f'the arm reached for the target: error {before[0].error(TARGET):.2f} -> '
                     f'{arm.error(TARGET):.3f}')

    report.section('Restore `decision`; branch B: the elbow gets a push')
    restore = client.restore('decision')
    report.check(restore.success and client.state_digest() == decision_digest,
                 f'restored in {restore.latency_ms:.3f} ms, state byte-identical to the '
                 'snapshot')
    arm = decision_arm.copy()
    arm.dq[1] += PUSH
    path_b = []
    branch_b = loop.run(arm, BRANCH_STEPS, path_b)
    report.line(f'error {_errors(path_b)}')
    report.check(branch_b != branch_a, 'branch B acts differently from branch A')

    report.section('Restore `decision` again and replay A')
    restore = client.restore('decision')
    arm = decision_arm.copy()
    replay = loop.run(arm, BRANCH_STEPS)
    same = sum(x == y for x, y in zip(replay, branch_a))
    report.check(replay == branch_a, f'replayed actions equal A bit for bit ({same}/'
                 f'{BRANCH_STEPS} chunks)')
    report.check(client.state_digest() == digest_a and task.Arm(arm.q).tip() == tip_a,
                 'policy state digest and arm position equal the end of A')

    report.section('Roll back 5 control steps and redo them')
    rolled = client.rollback(5)
    redo = loop.run(path_a[-6].copy(), 5)
    report.check(rolled.success and redo == branch_a[-5:],
                 f'rollback to step {rolled.position} in {rolled.latency_ms:.3f} ms; the '
                 'redone steps equal A')

    report.section('The cold alternative: re-run the observation history from home')
    assert client.restore('home').success
    t0 = time.perf_counter()
    for q, dq in history:
        loop.observe(q, dq)
    cold_ms = (time.perf_counter() - t0) * 1e3
    report.check(client.state_digest() == decision_digest,
                 'replaying the history reaches the same state as the snapshot')
    report.line(f'restore decision: {restore.latency_ms:.3f} ms | re-run {len(history)} '
                f'observations: {cold_ms:.1f} ms (grows with the episode; the restore does not)')

    report.section('E-stop: interrupt drops the action queue')
    start = len(events)
    client.interrupt(mode=Interrupt.STOP, reason='e-stop')
    event = _wait_event(events, start, 'interrupt')
    report.check(event is not None and event.success and 'queue dropped' in event.message,
                 f'interrupt event: {event.message if event else "none"} '
                 f'({event.latency_ms if event else 0:.2f} ms from receipt)')

    report.section('~/reset at the episode boundary')
    client.reset()
    deadline = time.monotonic() + 5.0
    while client.state_digest() != home_digest and time.monotonic() < deadline:
        time.sleep(0.02)
    report.check(client.state_digest() == home_digest, 'back to home, byte for byte')

    out = os.environ.get('FLASHRT_DEMO_OUT') or '.'
    os.makedirs(out, exist_ok=True)
    report.line('')
    report.line(f'plot of the reach: {plot(before, path_a, path_b, os.path.join(out, PLOT))}')


def _policy_session(node, client, workdir, params, report, events):
    _run_session(client, report, events, trained=params['model'] == 'builtin:act-arm')
    return node, client


def main(argv=None):
    """Run the policy demo; return 0 when every check passed."""
    return run_demo(argv, doc=__doc__, title='policy demo', default_model='builtin:act-arm',
                    params={'mode': 'policy', 'max_seq_len': 1024, 'interrupt_policy': 'stop',
                            'joint_names': list(JOINTS)},
                    random_note=NOTE, session=_policy_session)


if __name__ == '__main__':
    sys.exit(main())
