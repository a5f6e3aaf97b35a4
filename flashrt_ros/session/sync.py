"""
Observation synchronization: one joint state and one image per camera, matched by stamp.

Each input keeps its last few messages. When one arrives, every other input's message
nearest to it in stamp is looked up; if all lie within `slop` of it, they make one
observation (stamped with the newest of them) and every message up to those is used up, so
each is folded in once. A message that found no partners for long is dropped by expire(),
which names the input that never came. ROS-free: stamps are plain numbers (the node uses
integer nanoseconds, so a stamp goes out exactly as it came in).
"""

from __future__ import annotations

import collections
from typing import Any

KEEP = 8  # messages kept per input: enough for a camera that lags the joint states by 8


class ObservationSync:
    """Match the newest messages of several inputs by stamp (approximate-time, one slop)."""

    def __init__(self, keys, slop):
        self.keys = tuple(keys)
        self.slop = slop
        self._kept = {key: collections.deque(maxlen=KEEP) for key in self.keys}

    def put(self, key: str, value: Any, stamp):
        """
        Take one message; return (observation dict, stamp) when a match is complete.

        Returns (None, missing) when this message completes nothing yet: `missing` names an
        input that has no message within slop of it.
        """
        self._kept[key].append((stamp, value))
        chosen = {key: (stamp, value)}
        missing = self._missing(key, stamp, chosen)
        if missing:
            return None, missing
        for other, (used, _) in chosen.items():
            kept = self._kept[other]
            while kept and kept[0][0] <= used:
                kept.popleft()
        return {k: v for k, (_, v) in chosen.items()}, max(s for s, _ in chosen.values())

    def _missing(self, key, stamp, chosen=None) -> str:
        """Return the first input with no message within slop of `stamp` ('' if none)."""
        for other in self.keys:
            if other == key:
                continue
            near = min(self._kept[other], key=lambda m: abs(m[0] - stamp), default=None)
            if near is None or abs(near[0] - stamp) > self.slop:
                return other
            if chosen is not None:
                chosen[other] = near
        return ''

    def expire(self, before) -> str:
        """Drop messages stamped before `before`; return an input they waited for in vain."""
        missing = ''
        for key, kept in self._kept.items():
            while kept and kept[0][0] < before:
                stamp, _ = kept.popleft()
                missing = missing or self._missing(key, stamp)
        return missing

    def newest(self, key: str):
        """Return the stamp of the newest kept message of `key` (None: none kept)."""
        kept = self._kept[key]
        return kept[-1][0] if kept else None

    def clear(self) -> None:
        for kept in self._kept.values():
            kept.clear()
