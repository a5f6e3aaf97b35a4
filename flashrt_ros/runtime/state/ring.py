"""
The rollback ring: the last `rollback_depth` committed boundaries, newest last.

A boundary is a device capsule OUTSIDE the user's device budget: the ring is the runtime's
own undo history, with its own budget (ring_budget_bytes): a push drops the oldest entries
until the ring fits, but never the newest, the live state's own boundary (what a failed
step goes back to), so the ring holds at most max(budget, one entry). The budget counts
the bytes the entries hold, each blob once (repeated restores of one capsule push it
again), also a blob a stored capsule shares.

Three kinds of entry:
  * a lineage entry (`on_lineage`, what a commit pushes) holds only the head of the state
    at its boundary: the tensors without a sequence axis and the non-tensor state. Its
    sequence rows are the live arena's first `position` rows, which are append-only within
    a lineage (arena.py), so a commit copies the head whatever the context length, and a
    rollback to it copies the head back and zeroes the rows written since. When the live
    state stops holding those rows (a restore of another branch, a reset, a fork of the
    lineage that rewrote them), the entry cannot be restored any more: prune() takes it
    off the ring. The ring built with head_only=False keeps whole copies instead (a
    reference that never relies on the live rows) and prunes them by the same rule;
  * a delta entry, what a commit pushes when the state has windows (arena.py: a sliding-
    window cache, a stream's last tokens): a step overwrites a few rows of each window, so
    besides the rest of the head the entry keeps only the rows the next step will overwrite
    (the adapter says which: StateAdapter.window_writes), as they are at its boundary. A
    rollback to it writes back its rows and those of every delta entry newer than it (a
    row kept twice from the older: path()), so the windows are byte for byte what they
    were; the cost is what the frames wrote, not the window. That holds while the live
    state came from it by steps alone (arena.descends): prune() takes it off the ring
    otherwise (a reset, another branch restored);
  * a restored capsule: a device capsule goes on the ring by reference (capsules are
    immutable), so deleting it frees its memory only once it has left the ring; so does
    the device-side blob a full host restore copied from. It is self-contained and never
    pruned.

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
import itertools
from typing import Iterable

from .capsule import Capsule


class RollbackRing(collections.deque):
    """Committed boundaries, oldest first (a deque of capsules), and the retired ones."""

    def __init__(self, depth: int, budget: int = 0, head_only: bool = True):
        super().__init__(maxlen=max(depth, 1))
        self.depth = depth  # 0: no rollback; the ring then stays empty
        self.budget = budget  # bytes; 0 = unlimited
        self.head_only = head_only  # whether commits keep the head alone (module docstring)
        # A deque with maxlen: appending, dropping the oldest and clearing are each atomic,
        # so threads outside the step lock (delete_capsule, fork) may clear it.
        self.retired: collections.deque[Capsule] = collections.deque(maxlen=self.maxlen)
        self.last_commit_bytes = 0  # bytes the last commit copied into its entry
        self.lineage_drops = 0  # lineage entries pruned because the live rows moved on

    def commit(self, entry: Capsule) -> None:
        """Push the boundary a commit captured (a lineage entry; its blob is all it copied)."""
        self.last_commit_bytes = entry.nbytes
        self.push(entry)

    def push(self, entry: Capsule) -> None:
        """Push a boundary; the oldest one retires when the ring is full."""
        if len(self) == self.maxlen:
            self.retired.append(self[0])  # full: drops (frees) the oldest retired one
        self.append(entry)
        if self.budget:
            while len(self) > 1 and self.nbytes() > self.budget:
                self.retired.append(self.popleft())

    def prune(self, arena) -> None:
        """
        Retire the lineage entries whose rows the live state no longer holds (lock held).

        That is: rows of the row block past what the live state shares with the entry's
        epoch (arena.rows_shared), and for a delta entry its windows, unless the live state
        came from it by steps (arena.descends). Every other entry stays, in order.
        """
        shared: dict[int | None, int] = {}
        stale = []
        for entry in self:
            if entry.window_rows is not None:
                if not arena.descends(entry.epoch, entry.position):
                    stale.append(entry)
            elif entry.on_lineage:
                rows = shared.get(entry.epoch)
                if rows is None:
                    rows = shared[entry.epoch] = arena.rows_shared(entry.epoch)
                if rows < entry.position:
                    stale.append(entry)
        for entry in stale:
            self.remove(entry)
            self.retired.append(entry)
        self.lineage_drops += len(stale)

    def path(self, index: int, descends) -> tuple:
        """
        Return what takes the live windows back to delta entry self[index]: (base, deltas).

        base: the oldest entry newer than it that holds the whole head and that the live
        state came from (descends(epoch, position)), whose windows are copied first; None:
        start from the live windows. deltas: the delta entries between, oldest first.
        """
        deltas = []
        for entry in itertools.islice(self, index + 1, None):
            if entry.window_rows is not None:
                deltas.append(entry)
            elif descends(entry.epoch, entry.position):
                return entry, deltas
        return None, deltas

    def retire_newest(self, n: int) -> None:
        """Take the n newest boundaries off the ring (a rollback past them)."""
        for _ in range(n):
            self.retired.append(self.pop())

    def drop_all(self) -> None:
        """Forget every boundary, retired ones included (the runtime closes)."""
        self.clear()
        self.retired.clear()

    def nbytes(self) -> int:
        """Bytes the entries hold, each blob once."""
        return sum({c.blob.data_ptr(): c.nbytes for c in self}.values())

    def retired_nbytes(self, stored: Iterable[Capsule]) -> int:
        """Bytes only the retired entries keep (not the ring, nor `stored`): the next capture's."""
        retired = list(self.retired)
        held = {c.blob.data_ptr() for c in [*self, *stored] if c.blob is not None}
        waiting = {c.blob.data_ptr(): c.nbytes for c in retired
                   if c.blob is not None and c.blob.data_ptr() not in held}
        return sum(waiting.values())
