"""
Policy mode: a robot policy folds observations into the state and yields action chunks.

position counts observations and every act() is a committed boundary. The action chunk and
its queue of not-yet-executed actions are arena state (PolicyEngine, kind "actions"): a
capsule, a restore or a rollback carries them like the rest of the state; interrupt()
drops the queue.
"""

from __future__ import annotations

from dataclasses import dataclass
import time

import torch

from .errors import InvalidRequestError
from .preemption import guarded_forward


@dataclass(frozen=True, eq=False)
class ActionChunk:
    step: int  # observations consumed into the state (the committed boundary it ends at)
    actions: torch.Tensor  # [horizon, action_dim] float32 on the host; a copy
    names: tuple[str, ...]  # joint / axis name of each action dimension (may be empty)
    latency_s: float  # wall time of the control step


def control_step(rt, observations: torch.Tensor, t0: float) -> ActionChunk:
    """Fold checked observations [T, obs_dim] into the state (lock held; see Runtime.act)."""
    cursor = rt.cursor
    if cursor.position + len(observations) > rt.config.max_seq_len:
        raise InvalidRequestError(
            f'episode is full: position {cursor.position} + {len(observations)} '
            f'observations > max_seq_len {rt.config.max_seq_len}; reset() or '
            'restore a capsule first, or raise max_seq_len')
    cursor.extent = max(cursor.extent, cursor.position + len(observations))
    left = int(rt.engine.left)  # next_action/drop_actions change it, uncommitted
    try:
        with guarded_forward(rt):
            actions = rt.engine.step(observations, cursor.position, rt.generator)
    except BaseException:
        if rt.ring.depth > 0:  # (else the state was reset)
            rt.engine.left.fill_(left)  # the queue as it was before the call
        raise
    cursor.position += len(observations)
    rt.writer.commit()
    if rt._cuda:  # the commit's copy is queued, not done: bill it to this step
        torch.cuda.synchronize(rt.device)
    rt._control_step_s = time.perf_counter() - t0
    return ActionChunk(cursor.position, actions, rt.adapter.spec.joint_names,
                       rt._control_step_s)
