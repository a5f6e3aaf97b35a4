"""
Observation synchronization: one joint state and one image per camera, matched by stamp.

Each input keeps its last few messages. When one arrives, every other input's message
nearest to it in stamp is looked up; if all lie within `slop` seconds of it, they make one
observation (stamped with the newest of them) and every message up to those is used up, so
each is folded in once. ROS-free: the node feeds it converted messages and wall stamps.
"""

from __future__ import annotations

import collections
from typing import Any

KEEP = 8  # messages kept per input: enough for a camera that lags the joint states by 8


class ObservationSync:
    """Match the newest messages of several inputs by stamp (approximate-time, one slop)."""

    def __init__(self, keys, slop: float):
        self.keys = tuple(keys)
        self.slop = float(slop)
        self._kept = {key: collections.deque(maxlen=KEEP) for key in self.keys}

    def put(self, key: str, value: Any, stamp: float):
        """
        Take one message; return (observation dict, stamp) when a match is complete.

        Returns (None, why) when this message completes nothing yet: `why` names the input
        that has no message within slop of it ('' while every input has sent something).
        """
        self._kept[key].append((stamp, value))
        chosen, missing = {key: (stamp, value)}, ''
        for other in self.keys:
            if other == key:
                continue
            near = min(self._kept[other], key=lambda m: abs(m[0] - stamp), default=None)
            if near is None or abs(near[0] - stamp) > self.slop:
                missing = missing or other
                continue
            chosen[other] = near
        if missing:
            return None, missing
        for other, (used, _) in chosen.items():
            kept = self._kept[other]
            while kept and kept[0][0] <= used:
                kept.popleft()
        return {k: v for k, (_, v) in chosen.items()}, max(s for s, _ in chosen.values())

    def newest(self, key: str) -> float | None:
        """Return the stamp of the newest kept message of `key` (None: none kept)."""
        kept = self._kept[key]
        return kept[-1][0] if kept else None

    def clear(self) -> None:
        for kept in self._kept.values():
            kept.clear()
