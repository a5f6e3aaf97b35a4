"""
The rollback ring: the last `rollback_depth` committed boundaries, newest last.

A boundary is a device capsule OUTSIDE the user's device budget: the ring is the runtime's
own undo history, with its own budget (ring_budget_bytes): a push drops the oldest entries
until the ring fits, but never the newest, the live state's own boundary (what a failed
step goes back to), so the ring holds at most max(budget, one entry). Every entry counts in
full, also one that shares its blob with a stored capsule. A restored device capsule goes
on the ring by reference (capsules are immutable), so deleting it frees its memory only once
it has left the ring; so does the device-side blob a full host restore copied from.

An entry that leaves the ring is retired, not dropped: the last reference to a capsule
costs its teardown (its views, a pooled blob's return), which a restore of a device capsule,
the interrupt path, should not pay. What frees the retired entries: the next capture,
before it allocates (so their memory is reused at once), a transfer from another tier,
delete_capsule and fork. Between those only restores and rollbacks run, which put stored
capsules on the ring, so the ring and the retired entries together hold at most one more
private state than the ring did.
"""

from __future__ import annotations

import collections
from typing import Iterable

from .capsule import Capsule


class RollbackRing(collections.deque):
    """Committed boundaries, oldest first (a deque of capsules), and the retired ones."""

    def __init__(self, depth: int, budget: int = 0):
        super().__init__(maxlen=max(depth, 1))
        self.depth = depth  # 0: no rollback; the ring then stays empty
        self.budget = budget  # bytes; 0 = unlimited
        # A deque with maxlen: appending, dropping the oldest and clearing are each atomic,
        # so threads outside the step lock (delete_capsule, fork) may clear it.
        self.retired: collections.deque[Capsule] = collections.deque(maxlen=self.maxlen)

    def push(self, entry: Capsule) -> None:
        """Push a boundary; the oldest one retires when the ring is full."""
        if len(self) == self.maxlen:
            self.retired.append(self[0])  # full: drops (frees) the oldest retired one
        self.append(entry)
        if self.budget:
            used = self.nbytes()
            while used > self.budget and len(self) > 1:
                used -= self[0].nbytes
                self.retired.append(self.popleft())

    def retire_newest(self, n: int) -> None:
        """Take the n newest boundaries off the ring (a rollback past them)."""
        for _ in range(n):
            self.retired.append(self.pop())

    def drop_all(self) -> None:
        """Forget every boundary, retired ones included (the runtime closes)."""
        self.clear()
        self.retired.clear()

    def nbytes(self) -> int:
        return sum(c.nbytes for c in self)

    def retired_nbytes(self, stored: Iterable[Capsule]) -> int:
        """Bytes only the retired entries keep (not the ring, nor `stored`): the next capture's."""
        retired = list(self.retired)
        held = {c.blob.data_ptr() for c in [*self, *stored] if c.blob is not None}
        waiting = {c.blob.data_ptr(): c.nbytes for c in retired
                   if c.blob is not None and c.blob.data_ptr() not in held}
        return sum(waiting.values())
