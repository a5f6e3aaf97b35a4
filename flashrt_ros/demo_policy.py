"""
The `make demo-policy` session: execution-state capsules for a robot policy, over ROS 2.

Starts the flashrt node in policy mode with an ACT policy in LeRobot's checkpoint format
(builtin:act-arm: seeded weights, one top camera, temporal ensembling; one control step per
observation) and closes the loop with a simulated planar 2-link arm, integrated here in
plain Python (deterministic): each step publishes the arm's JointState on ~/observation and
a picture of it from above on ~/image/top with the same stamp, waits for the ActionChunk on
~/actions and applies its first action (joint torques) for one control period. Then:
snapshot at a decision point, try branch A, restore, try branch B (a push on the elbow),
restore again and replay A (its actions must be equal bit for bit: the ensembling buffer is
in the capsule), roll back a few control steps, e-stop (the action queue is dropped), and
~/reset to home. Prints a short report, stops the node by PID, exits 0 when every check holds.
`--model builtin:tiny-policy` runs the same session on the joint-state-only policy.
"""

import math
import sys
import time

from flashrt_ros.demo import _wait_event, run_demo  # the `make demo` helpers
import numpy as np

JOINTS = ('shoulder', 'elbow')
DT = 0.05  # s per control step
BRANCH_STEPS = 15


class Arm:
    """A horizontal planar 2-link arm (unit masses at the link ends, unit lengths, damped)."""

    def __init__(self, q=(0.3, 0.6), dq=(0.0, 0.0)):
        self.q, self.dq = list(q), list(dq)

    def copy(self):
        return Arm(self.q, self.dq)

    def step(self, torque, substeps=5, damping=0.5):
        """Integrate M(q) ddq + c(q, dq) + b dq = torque for DT (semi-implicit Euler)."""
        h = DT / substeps
        for _ in range(substeps):
            c2, s2 = math.cos(self.q[1]), math.sin(self.q[1])
            m11, m12, m22 = 3.0 + 2.0 * c2, 1.0 + c2, 1.0
            coriolis = (-s2 * (2.0 * self.dq[0] * self.dq[1] + self.dq[1] ** 2),
                        s2 * self.dq[0] ** 2)
            f = [torque[i] - coriolis[i] - damping * self.dq[i] for i in range(2)]
            det = m11 * m22 - m12 * m12
            ddq = ((m22 * f[0] - m12 * f[1]) / det, (m11 * f[1] - m12 * f[0]) / det)
            for i in range(2):
                self.dq[i] += h * ddq[i]
                self.q[i] += h * self.dq[i]

    def tip(self):
        """Return the end-effector (x, y)."""
        a, b = self.q[0], self.q[0] + self.q[1]
        return math.cos(a) + math.cos(b), math.sin(a) + math.sin(b)


CAMERA = (96, 128)  # height, width of the top camera's picture


def picture(q):
    """Draw the arm at joint angles q from above: rgb8 bytes, CAMERA[0] rows of CAMERA[1]."""
    h, w = CAMERA
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    scale, base = h / 5.0, (w / 2.0, h / 2.0)
    elbow = (base[0] + scale * math.cos(q[0]), base[1] + scale * math.sin(q[0]))
    tip = (elbow[0] + scale * math.cos(q[0] + q[1]), elbow[1] + scale * math.sin(q[0] + q[1]))
    image = np.full((h, w, 3), (40, 40, 48), dtype=np.uint8)
    for (ax, ay), (bx, by), colour in ((base, elbow, (230, 120, 40)),
                                       (elbow, tip, (60, 160, 230))):
        dx, dy = bx - ax, by - ay
        t = np.clip(((x - ax) * dx + (y - ay) * dy) / (dx * dx + dy * dy), 0.0, 1.0)
        near = (x - ax - t * dx) ** 2 + (y - ay - t * dy) ** 2 < 9.0  # a 3-pixel half width
        image[near] = colour
    return image.tobytes()


class Loop:
    """The arm and the node in lock step: one observation out, one ActionChunk back."""

    def __init__(self, client, camera):
        self.client, self.camera = client, camera
        self.chunks = []
        client.subscribe_actions(self.chunks.append)
        time.sleep(0.3)

    def observe(self, q, dq, timeout=10.0):
        """Publish one JointState (and picture); return the ActionChunk of its control step."""
        start = len(self.chunks)
        stamp = self.client.now()
        if self.camera:
            self.client.publish_image('top', picture(q), *CAMERA, stamp=stamp)
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
        arm.step(chunk.actions[:chunk.action_dim])  # execute the first action of the chunk
        return tuple(chunk.actions)

    def run(self, arm, steps):
        return [self.step(arm) for _ in range(steps)]


def _takes_images(client, timeout=3.0):
    """Whether the node subscribes to ~/image/top (a camera policy) once its inputs are up."""
    client.wait_for_subscribers(10.0, 'observation')
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if client.node.count_subscribers(f'{client.base}/image/top'):
            return True
        time.sleep(0.05)
    return False


def _tip(arm):
    x, y = arm.tip()
    return f'({x:+.3f}, {y:+.3f})'


def _run_session(client, report, events):
    from flashrt_ros.msg import Interrupt

    loop = Loop(client, camera=_takes_images(client))
    report.section('Home capsule (empty policy state, taken at activation)')
    home = {c.name: c for c in client.list_capsules().capsules}['home']
    home_digest = client.state_digest()
    report.line(f'home: step {home.position}, {home.size_bytes} bytes on {home.tier}, '
                f'components {", ".join(home.components)}')

    report.section('Close the loop: arm -> ~/observation -> policy -> ~/actions -> arm')
    arm = Arm()
    t0 = time.perf_counter()
    history = [(list(arm.q), list(arm.dq))]
    for _ in range(20):
        loop.step(arm)
        history.append((list(arm.q), list(arm.dq)))
    history.pop()  # the observations the policy has seen
    loop_ms = (time.perf_counter() - t0) / 20 * 1e3
    report.line(f'20 control steps, {loop_ms:.1f} ms per round trip over DDS; tip now '
                f'{_tip(arm)}')

    report.section('Decision point: snapshot the policy state (the demo keeps the arm state)')
    snap = client.snapshot('decision')
    decision_arm, decision_digest = arm.copy(), client.state_digest()
    report.line(f'snapshot decision: step {snap.capsule.position}, {snap.capsule.size_bytes} '
                f'bytes, {snap.latency_ms:.3f} ms')
    report.check(snap.success, 'snapshot taken at a committed control step')

    report.section(f'Branch A: {BRANCH_STEPS} steps as is')
    arm = decision_arm.copy()
    arms_a = []
    branch_a = []
    for _ in range(BRANCH_STEPS):
        arms_a.append(arm.copy())
        branch_a.append(loop.step(arm))
    tip_a, digest_a = _tip(arm), client.state_digest()
    report.line(f'tip after A: {tip_a}')

    report.section('Restore `decision`; branch B: the elbow gets a push')
    restore = client.restore('decision')
    report.check(restore.success and client.state_digest() == decision_digest,
                 f'restored in {restore.latency_ms:.3f} ms, state byte-identical to the '
                 'snapshot')
    arm = decision_arm.copy()
    arm.dq[1] += 2.0
    branch_b = loop.run(arm, BRANCH_STEPS)
    report.line(f'tip after B: {_tip(arm)}')
    report.check(branch_b != branch_a, 'branch B acts differently from branch A')

    report.section('Restore `decision` again and replay A')
    restore = client.restore('decision')
    arm = decision_arm.copy()
    replay = loop.run(arm, BRANCH_STEPS)
    same = sum(x == y for x, y in zip(replay, branch_a))
    report.check(replay == branch_a, f'replayed actions equal A bit for bit ({same}/'
                 f'{BRANCH_STEPS} chunks)')
    report.check(client.state_digest() == digest_a and _tip(arm) == tip_a,
                 'policy state digest and arm position equal the end of A')

    report.section('Roll back 5 control steps and redo them')
    rolled = client.rollback(5)
    redo = loop.run(arms_a[-5].copy(), 5)
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


def _policy_session(node, client, workdir, params, report, events):
    _run_session(client, report, events)
    return node, client


def main(argv=None):
    """Run the policy demo; return 0 when every check passed."""
    return run_demo(argv, doc=__doc__, title='policy demo', default_model='builtin:act-arm',
                    params={'mode': 'policy', 'max_seq_len': 1024, 'interrupt_policy': 'stop',
                            'joint_names': list(JOINTS)},
                    random_note='seeded weights: the arm does not reach for anything; the '
                                'state handling is real',
                    session=_policy_session)


if __name__ == '__main__':
    sys.exit(main())
