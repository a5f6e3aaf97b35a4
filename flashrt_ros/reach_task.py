"""
The policy default's task: a planar two-link arm that reaches a target it sees.

A horizontal arm (unit links, unit masses at the link ends) whose joint servos track
position targets, as a real arm's do: each action is the pair of joint angles to go to.
A top camera (CAMERA, rgb8) sees both links and the target, a green disc. The scripted
expert that behaviour cloning imitates solves the inverse kinematics (elbow angle in
(0, pi)) and walks each joint toward the goal, CHUNK actions ahead. Everything here is
plain Python and numpy and deterministic for a given random generator: the trainer
(train_policy.py), `make demo-policy` and the tests share it.
"""

from __future__ import annotations

import math

import numpy as np

JOINTS = ('shoulder', 'elbow')
DT = 0.05  # s per control step
CAMERA = (96, 128)  # height, width of the top camera's picture
CHUNK = 20  # actions per chunk (ACT's chunk_size)
SCALE = CAMERA[0] / 5.0  # pixels per link length
KP, KD = 100.0, 20.0  # the servos: critically damped, settle in ~0.5 s
# The expert's reach per chunk step: the first target leads the arm by LEAD rad, each
# later one by STRIDE more (about what the servo covers in a control step).
LEAD, STRIDE = 0.4, 0.1
TARGET_RADIUS = (0.6, 1.8)  # where targets appear: a ring sector in front of the base
TARGET_ANGLE = (-1.0, 2.2)
POSE = ((-1.5, 2.5), (0.1, 2.8))  # joint ranges of start poses


class Arm:
    """The arm's joints (rad) and speeds (rad/s); step() runs its servos for one DT."""

    def __init__(self, q=(0.3, 0.6), dq=(0.0, 0.0)):
        self.q, self.dq = [float(v) for v in q], [float(v) for v in dq]

    def copy(self) -> Arm:
        return Arm(self.q, self.dq)

    def step(self, target, substeps: int = 5) -> None:
        """Track the joint targets for DT (semi-implicit Euler)."""
        h = DT / substeps
        for _ in range(substeps):
            for i in range(2):
                self.dq[i] += h * (KP * (float(target[i]) - self.q[i]) - KD * self.dq[i])
                self.q[i] += h * self.dq[i]

    def tip(self) -> tuple[float, float]:
        """Return the end effector (x, y) in link lengths."""
        a, b = self.q[0], self.q[0] + self.q[1]
        return math.cos(a) + math.cos(b), math.sin(a) + math.sin(b)

    def error(self, target) -> float:
        """Distance from the end effector to `target` (link lengths)."""
        x, y = self.tip()
        return math.hypot(x - target[0], y - target[1])


def picture(q, target=None) -> np.ndarray:
    """Draw the arm at joint angles q (and the target) from above: [H, W, 3] uint8."""
    h, w = CAMERA
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = (w / 2.0, h / 2.0)
    elbow = (base[0] + SCALE * math.cos(q[0]), base[1] + SCALE * math.sin(q[0]))
    tip = (elbow[0] + SCALE * math.cos(q[0] + q[1]), elbow[1] + SCALE * math.sin(q[0] + q[1]))
    image = np.full((h, w, 3), (40, 40, 48), dtype=np.uint8)
    if target is not None:
        tx, ty = base[0] + SCALE * target[0], base[1] + SCALE * target[1]
        image[(x - tx) ** 2 + (y - ty) ** 2 < 16.0] = (90, 220, 90)
    for (ax, ay), (bx, by), colour in ((base, elbow, (230, 120, 40)),
                                       (elbow, tip, (60, 160, 230))):
        dx, dy = bx - ax, by - ay
        t = np.clip(((x - ax) * dx + (y - ay) * dy) / (dx * dx + dy * dy), 0.0, 1.0)
        image[(x - ax - t * dx) ** 2 + (y - ay - t * dy) ** 2 < 9.0] = colour  # 3 px half width
    return image


def inverse_kinematics(target) -> np.ndarray:
    """Joint angles that put the tip on `target`, elbow angle in [0, pi]."""
    r2 = float(target[0]) ** 2 + float(target[1]) ** 2
    elbow = math.acos(max(-1.0, min(1.0, (r2 - 2.0) / 2.0)))
    return np.array([math.atan2(target[1], target[0]) - elbow / 2.0, elbow])


def expert_chunk(q, goal) -> np.ndarray:
    """Return the expert's next CHUNK joint targets from joints q toward goal: [CHUNK, 2]."""
    reach = (LEAD + STRIDE * np.arange(CHUNK))[:, None]
    q = np.asarray(q, dtype=np.float64)
    return q[None] + np.clip(np.asarray(goal) - q, -reach, reach)


def sample_target(rng: np.random.Generator) -> np.ndarray:
    """Draw a target (x, y) in the reachable sector."""
    r, phi = rng.uniform(*TARGET_RADIUS), rng.uniform(*TARGET_ANGLE)
    return np.array([r * math.cos(phi), r * math.sin(phi)])


def sample_pose(rng: np.random.Generator) -> np.ndarray:
    """Draw a start pose: joint angles uniform in POSE."""
    return np.array([rng.uniform(*POSE[0]), rng.uniform(*POSE[1])])
