"""
CapsuleStore: named capsules in device and host memory and on disk (state/disk.py).

Budgets: exact bytes of blobs held per memory tier, and the exact file sizes of the
capsule files present in capsule_dir for the disk tier (the directory is the budget's
unit, also for files written by other processes). Policy "refuse" raises
BudgetExceededError; "lru" evicts least-recently-used unpinned capsules of that tier,
and only when that makes enough room (otherwise it refuses without evicting anything).
Every eviction is recorded; `drain_evicted()` hands the records to whoever reports them.

Checksums: a device or host capsule is not hashed when it is taken (hashing is much
slower than the copy and needs a device->host copy on a GPU). Its checksum is computed
lazily (verify(), a disk write, a fork to disk) and cached; a file read from disk is always
checked against its stored one. A memory capsule is never handed out writable, so what the
lazy checksum protects against there is hardware/bug corruption between two verifies.

The store touches only its own capsules: nothing outside them is counted, moved or deleted.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path
import threading
import time
from typing import Any

import torch

from . import disk
from .capsule import Capsule, CapsuleInfo, not_found, validate_name
from ..errors import BudgetExceededError, CorruptCapsuleError


class CapsuleStore:
    """Named capsules in device/host memory and on disk, with per-tier byte budgets."""

    def __init__(
        self, device: torch.device, budgets: dict[str, int], eviction: str, capsule_dir: Path
    ):
        self.device = device
        self.budgets = dict(budgets)
        self.eviction = eviction
        self.dir = capsule_dir
        self._mem: dict[str, Capsule] = {}  # device + host tiers
        self._lock = threading.RLock()  # store bookkeeping; independent of the step lock
        self._evicted: collections.deque[CapsuleInfo] = collections.deque(maxlen=256)
        disk.sweep_stale_temps(self.dir)

    # ---- accounting ------------------------------------------------------------------

    def used_bytes(self, tier: str) -> int:
        with self._lock:
            if tier == 'disk':
                return sum(size for _, size, _ in disk.list_files(self.dir))
            return sum(c.nbytes for c in self._mem.values() if c.tier == tier)

    def count(self, tier: str) -> int:
        with self._lock:
            if tier == 'disk':
                return len(disk.list_files(self.dir))
            return sum(1 for c in self._mem.values() if c.tier == tier)

    def _make_room(self, tier: str, nbytes: int, replacing: str) -> list[str]:
        """Names to evict so nbytes fit in tier (replacing `replacing`); raises if impossible."""
        budget = self.budgets.get(tier, 0)
        if budget <= 0:
            return []
        if tier == 'disk':
            entries = [
                (n, size, mtime, self._disk_pinned(n))
                for n, size, mtime in disk.list_files(self.dir)
            ]
        else:
            entries = [
                (c.name, c.nbytes, c.last_used, c.pinned)
                for c in self._mem.values()
                if c.tier == tier
            ]
        entries = [e for e in entries if e[0] != replacing]
        used = sum(e[1] for e in entries)
        if used + nbytes <= budget:
            return []
        if nbytes > budget:
            raise BudgetExceededError(
                f'capsule needs {nbytes} bytes but the {tier} budget is {budget} bytes; '
                f'raise {tier}_budget_bytes or use another tier'
            )
        if self.eviction != 'lru':
            raise BudgetExceededError(
                f'{tier} tier is full ({used} of {budget} bytes used, {nbytes} more needed); '
                "delete capsules, raise the budget, or set eviction to 'lru'"
            )
        victims, freed = [], 0
        for name, size, _, pinned in sorted(entries, key=lambda e: e[2]):  # oldest use first
            if used - freed + nbytes <= budget:
                break
            if not pinned:
                victims.append(name)
                freed += size
        if used - freed + nbytes > budget:
            raise BudgetExceededError(
                f'{tier} tier is full of pinned capsules ({used} of {budget} bytes); '
                'delete or unpin some, or raise the budget'
            )
        return victims

    # ---- put / get / delete ----------------------------------------------------------

    def put(self, capsule: Capsule) -> Capsule:
        """Store a memory capsule or write a disk one, replacing any of the same name."""
        with self._lock:
            if capsule.tier == 'disk':
                return self._write_disk(capsule)
            for victim in self._make_room(capsule.tier, capsule.nbytes, capsule.name):
                self._evict(victim)
            self._delete_locked(capsule.name, missing_ok=True)
            self._mem[capsule.name] = capsule
            return capsule

    def check_name(self, name: Any) -> None:
        """Raise InvalidNameError for a bad name (a dict lookup for a stored, valid one)."""
        if not (isinstance(name, str) and name in self._mem):
            validate_name(name)

    def memory_capsules(self) -> list[Capsule]:
        with self._lock:
            return list(self._mem.values())

    def get(self, name: str) -> Capsule:
        """Return the capsule with its blob in memory; disk ones are read and verified."""
        # A memory capsule needs no lock: the dict lookup is atomic, and a capsule deleted
        # meanwhile stays whole for whoever holds it. A stored name is a valid one.
        cap = self._mem.get(name) if isinstance(name, str) else None
        if cap is None:
            return self._lookup(name, header_only=False)
        cap.last_used = time.monotonic()  # the memory tiers' LRU clock
        return cap

    def peek(self, name: str) -> Capsule:
        """Like get, but a disk capsule comes back header-only (blob None, not verified)."""
        return self._lookup(name, header_only=True)

    def _lookup(self, name: str, header_only: bool) -> Capsule:
        """Find `name` in memory or on disk; a full lookup counts as a use (LRU clocks)."""
        validate_name(name)
        with self._lock:
            cap = self._mem.get(name)
            if cap is not None:
                if not header_only:
                    cap.last_used = time.monotonic()
                return cap
            path = disk.path_of(self.dir, name)
            if not path.is_file():
                raise not_found(name)
            cap = disk.read(name, path, header_only=header_only)
            if not header_only:
                os.utime(path)  # mtime is the disk tier's LRU clock
            return cap

    def delete(self, name: str) -> CapsuleInfo:
        validate_name(name)
        with self._lock:
            info = self._info_for_removal(name)
            self._delete_locked(name)
            return info

    def drain_evicted(self) -> list[CapsuleInfo]:
        """Capsules evicted by the lru policy since the last call (oldest first)."""
        with self._lock:
            out = list(self._evicted)
            self._evicted.clear()
            return out

    def _evict(self, name: str) -> None:
        self._evicted.append(self._info_for_removal(name))
        self._delete_locked(name)

    def _info_for_removal(self, name: str) -> CapsuleInfo:
        """Info of a capsule about to be removed; an unreadable disk file still gets one."""
        try:
            return self.peek(name).info()
        except CorruptCapsuleError:
            # The error for an unreadable file tells the user to delete it, so deleting
            # must not need to parse it.
            st = disk.path_of(self.dir, name).stat()
            return CapsuleInfo(name, 'disk', st.st_size, 0, st.st_mtime, '', '', ())

    def drop_memory_tiers(self) -> None:
        """Forget every device and host capsule (used when the runtime closes)."""
        with self._lock:
            self._mem.clear()

    def _delete_locked(self, name: str, missing_ok: bool = False) -> None:
        found = disk.remove(self.dir, name)
        found = self._mem.pop(name, None) is not None or found
        if not found and not missing_ok:
            raise not_found(name)

    def infos(self, tier: str | None = None,
              unreadable: list[str] | None = None) -> list[CapsuleInfo]:
        """Infos of all capsules, oldest first; unreadable disk files are named in unreadable."""
        with self._lock:
            infos = [c.info() for c in self._mem.values()]
            for name, _, _ in disk.list_files(self.dir):
                if name in self._mem:
                    continue
                path = disk.path_of(self.dir, name)
                try:
                    infos.append(disk.read(name, path, header_only=True).info())
                except CorruptCapsuleError:  # restore or verify says why
                    if unreadable is not None and path.is_file():  # not deleted meanwhile
                        unreadable.append(name)
        return sorted(
            (i for i in infos if tier is None or i.tier == tier), key=lambda i: (i.created, i.name)
        )

    def verify(self, name: str) -> CapsuleInfo:
        """Recompute the checksum (CorruptCapsuleError on mismatch); seal unsealed capsules."""
        with self._lock:
            cap = self.get(name)  # a disk capsule is verified while being read
            if cap.tier != 'disk':
                actual = disk.capsule_checksum(cap)
                if cap.checksum and cap.checksum != actual:
                    raise CorruptCapsuleError(
                        f'capsule {name!r} changed since its checksum was taken; '
                        'delete it and take a new snapshot'
                    )
                cap.checksum = actual
            return cap.info()

    # ---- disk ------------------------------------------------------------------------

    def _disk_pinned(self, name: str) -> bool:
        try:
            return disk.read(name, disk.path_of(self.dir, name), header_only=True).pinned
        except CorruptCapsuleError:
            return False

    def _write_disk(self, capsule: Capsule) -> Capsule:
        data = disk.encode(capsule)
        victims = self._make_room('disk', len(data), capsule.name)  # may refuse: nothing changed
        path = disk.write(self.dir, capsule.name, data)
        # Written: only now does it replace a same-named memory capsule (the old file went in
        # the rename) and do the budget's victims go.
        self._mem.pop(capsule.name, None)
        for victim in victims:
            self._evict(victim)
        disk.sync_dir(self.dir)
        return capsule.with_blob(
            capsule.name, 'disk', None, meta_json=capsule.meta_json, created=capsule.created,
            pinned=capsule.pinned, checksum=capsule.checksum, nbytes=len(data), path=path,
            epoch=None)
