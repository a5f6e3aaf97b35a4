"""
CapsuleStore: named capsules in device and host memory and on disk (state/disk.py).

Budgets: exact bytes of blobs held per memory tier, and for the disk tier the exact sizes
of the capsule files in capsule_dir (the directory is the budget's unit, also for capsules
other processes wrote) plus the temp files of writes in progress. Policy "refuse" raises
BudgetExceededError; "lru" evicts least-recently-used unpinned capsules of that tier and
of this runtime's model, and only when that makes enough room (otherwise it refuses
without evicting anything). Every eviction is recorded; `drain_evicted()` hands the
records to whoever reports them.

The store touches only its own capsules: a file in capsule_dir without the capsule header
(disk.py) is foreign and never counted, evicted, deleted or read; a capsule of another
model is never replaced or evicted. The directory is listed through an index that reads a
file's header once (disk.DiskIndex), and the disk tier's LRU clock is kept in memory, so a
read-only capsule directory serves restores.

Disk writes: a disk snapshot encodes and writes its file outside the store's lock, so
restores, lists and memory snapshots (an interrupt's restore of a disk capsule too) never
wait for one. Under the lock it first reserves the name (another snapshot or a delete of
that name is refused until the write ends) and its bytes (counted against the budget by
everyone until the file is published), then publishes the file under the lock: it replaces
a same-named memory capsule and the budget's victims go, chosen again from what the
directory holds then.

Checksums: a device or host capsule is not hashed when it is taken (hashing is much
slower than the copy and needs a device->host copy on a GPU). Its checksum is computed
lazily (verify(), a disk write, a fork to disk) and cached; a file read from disk is always
checked against its stored one (and its MAC, with a capsule key). A memory capsule is never
handed out writable, so what the lazy checksum protects against there is hardware/bug
corruption between two verifies.
"""

from __future__ import annotations

import collections
from pathlib import Path
import threading
import time
from typing import Any

import torch

from . import disk
from .capsule import Capsule, CapsuleInfo, not_found, validate_name
from ..errors import BudgetExceededError, CapsuleNotFoundError, CorruptCapsuleError
from ..errors import FingerprintMismatchError, InvalidRequestError


class CapsuleStore:
    """Named capsules in device/host memory and on disk, with per-tier byte budgets."""

    def __init__(
        self, device: torch.device, budgets: dict[str, int], eviction: str, capsule_dir: Path,
        fingerprint: str = '', key: bytes | None = None,
    ):
        """fingerprint: this runtime's (what eviction may remove); key: the MAC key or None."""
        self.device = device
        self.budgets = dict(budgets)
        self.eviction = eviction
        self.dir = capsule_dir
        self.fingerprint, self.key = fingerprint, key
        self._mem: dict[str, Capsule] = {}  # device + host tiers
        # Bookkeeping only, never held while a file is listed, read or hashed (_decide);
        # independent of the step lock.
        self._lock = threading.Lock()
        self._evicted: collections.deque[CapsuleInfo] = collections.deque(maxlen=256)
        self.index = disk.DiskIndex(capsule_dir)
        self._disk_used: dict[str, float] = {}  # the disk tier's LRU clock (unix s) of our uses
        self._writing: dict[str, int] = {}  # disk writes in progress: name -> reserved bytes
        self._disk_changes = 0  # our changes to the directory and _writing (_decide)
        disk.sweep_stale_temps(self.dir)

    # ---- accounting ------------------------------------------------------------------

    def _decide(self, decide, name: str | None = None, scan: bool = False, tier: str = ''):
        """
        Return decide(entry, listing), run under the lock from what was read outside it.

        entry: `name`'s (None: no name or no file); listing: a scan of the directory when
        `scan` or `tier` is the disk tier with a budget (else None). Both are read again
        when one of this store's own disk changes (a reservation, a published or removed
        file) came in between, or decide raised _Stale: decide sees what a read under the
        lock would have found.
        """
        while True:
            changes = self._disk_changes
            entry = self.index.entry(name) if name is not None else None
            listing = self.index.scan() if scan or self._needs_listing(tier) else None
            with self._lock:
                if self._disk_changes == changes:
                    try:
                        return decide(entry, listing)
                    except _Stale:
                        pass

    def _needs_listing(self, tier: str) -> bool:
        return tier == 'disk' and self.budgets.get('disk', 0) > 0

    def _changed_disk(self) -> None:
        """Count a change of ours to the directory or the reservations (lock held)."""
        self._disk_changes += 1

    def _temp_bytes(self, listing: disk.Listing, but: str = '') -> int:
        """
        Temp files on disk plus the bytes reserved by writes in progress (lock held).

        A reserved write's temp files are counted as its reservation; `but`'s own write
        is left out (it is the one being checked or published).
        """
        on_disk = sum(n for owner, n in listing.temps.items()
                      if owner == but or owner not in self._writing)
        return on_disk + sum(n for name, n in self._writing.items() if name != but)

    def usage(self) -> tuple[dict[str, tuple[int, int]], int]:
        """Return tier -> (capsules, bytes used) and the temp files' bytes, from one scan."""
        def tally(_, listing):
            out = {tier: (0, 0) for tier in self.budgets}
            for c in self._mem.values():
                count, nbytes = out[c.tier]
                out[c.tier] = (count + 1, nbytes + c.nbytes)
            files = _ours(listing)
            temp = self._temp_bytes(listing)
            out['disk'] = (len(files), sum(e.size for e in files.values()) + temp)
            return out, temp
        return self._decide(tally, scan=True)

    def _make_room(self, tier: str, nbytes: int, replacing: str,
                   listing: disk.Listing | None) -> list[str]:
        """Names to evict so nbytes fit in tier (replacing `replacing`); raises if impossible."""
        budget = self.budgets.get(tier, 0)
        if budget <= 0:
            return []
        if tier == 'disk':
            if listing is None:  # the budget was set since the caller looked
                raise _Stale
            files = _ours(listing)
            extra = self._temp_bytes(listing, but=replacing)
            # Evictable: a readable unpinned capsule of this model, oldest use first (not
            # one a write in progress replaces).
            entries = [
                (n, e.size, max(e.mtime, self._disk_used.get(n, 0.0)),
                 e.kind != 'capsule' or e.head.pinned or e.fingerprint != self.fingerprint
                 or n in self._writing)
                for n, e in files.items()
            ]
        else:
            extra = 0
            entries = [
                (c.name, c.nbytes, c.last_used, c.pinned)
                for c in self._mem.values()
                if c.tier == tier
            ]
        entries = [e for e in entries if e[0] != replacing]
        used = sum(e[1] for e in entries) + extra
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
        for name, size, _, kept in sorted(entries, key=lambda e: e[2]):  # oldest use first
            if used - freed + nbytes <= budget:
                break
            if not kept:
                victims.append(name)
                freed += size
        if used - freed + nbytes > budget:
            raise BudgetExceededError(
                f'{tier} tier is full of capsules lru may not evict ({used} of {budget} bytes: '
                'pinned ones, on disk also unreadable ones, other models and temp files of '
                'writes in progress); delete or unpin some, or raise the budget'
            )
        return victims

    # ---- put / get / delete ----------------------------------------------------------

    def _check_replace(self, name: str, entry: disk.Entry | None) -> None:
        """Raise if the disk file `entry` of a snapshot `name` must not be replaced."""
        if entry is None:
            return
        if entry.kind == 'foreign':
            raise disk.not_a_capsule(name, disk.path_of(self.dir, name),
                                     disk.foreign_reason(entry))
        if entry.fingerprint != self.fingerprint:
            raise FingerprintMismatchError(
                f'capsule {name!r} on disk holds the state of another model or layout '
                f'(fingerprint {entry.fingerprint[:12] or "unknown"}, this runtime '
                f'{self.fingerprint[:12]}); it is not replaced: delete it first or pick '
                'another name')

    def _check_not_writing(self, name: str) -> None:
        if name in self._writing:
            raise InvalidRequestError(
                f'capsule {name!r} is being written to disk now; try again when that '
                'snapshot has returned, or pick another name')

    def put(self, capsule: Capsule) -> Capsule:
        """Store a memory capsule or write a disk one, replacing any of the same name."""
        if capsule.tier == 'disk':
            return self._write_disk(capsule)

        def store(replaced, _):
            self._check_not_writing(capsule.name)
            self._check_replace(capsule.name, replaced)
            victims = self._make_room(capsule.tier, capsule.nbytes, capsule.name, None)
            if replaced is not None:  # may fail (read-only): nothing changed yet
                self._remove(capsule.name, replaced, f'replacing disk capsule {capsule.name!r}')
            for victim in victims:
                self._evicted.append(self._mem.pop(victim).info())
            self._mem[capsule.name] = capsule
            return capsule
        return self._decide(store, name=capsule.name)

    def check_room(self, tier: str, nbytes: int, name: str) -> None:
        """Raise now if nbytes could not be put in tier as capsule `name` (nothing evicted)."""
        def check(entry, listing):
            self._check_replace(name, entry)
            self._make_room(tier, nbytes, name, listing)
        self._decide(check, name=name, tier=tier)

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
        # Read outside the lock (a write replaces a file by a rename, so this reads the old
        # file or the new one whole): a long read holds up no other capsule operation.
        path = disk.path_of(self.dir, name)
        try:
            cap = disk.read(name, path, header_only=header_only, key=self.key)
        except CapsuleNotFoundError:
            cap = self._mem.get(name)  # a memory snapshot replaced the file meanwhile
            if cap is None:
                raise
            return cap
        if not header_only:
            with self._lock:
                self._disk_used[name] = time.time()
            self.index.touch(name, path)  # mtime: the clock other processes see
        return cap

    def delete(self, name: str) -> CapsuleInfo:
        validate_name(name)

        def remove(entry, _):
            self._check_not_writing(name)
            cap = self._mem.pop(name, None)
            if cap is not None:
                return cap.info()
            return self._delete_disk(name, entry, f'deleting capsule {name!r}')
        return self._decide(remove, name=name)

    def drain_evicted(self) -> list[CapsuleInfo]:
        """Capsules evicted by the lru policy since the last call (oldest first)."""
        with self._lock:
            out = list(self._evicted)
            self._evicted.clear()
            return out

    def _remove(self, name: str, entry: disk.Entry, what: str) -> None:
        """Delete file `name` if it is still the one `entry` describes, else _Stale (lock held)."""
        if not self.index.current(name, entry):  # one lstat: the decision was made on it
            raise _Stale
        self.index.remove(name, what)
        self._disk_used.pop(name, None)
        self._changed_disk()

    def _delete_disk(self, name: str, entry: disk.Entry | None, what: str) -> CapsuleInfo:
        """Remove capsule file `name` (`entry`) if it is one of ours; return what it was."""
        if entry is None:
            raise not_found(name)
        if entry.kind == 'foreign':
            raise disk.not_a_capsule(name, disk.path_of(self.dir, name),
                                     disk.foreign_reason(entry))
        self._remove(name, entry, what)
        if entry.kind == 'capsule':
            return entry.head.info()
        # The error for an unreadable file tells the user to delete it, so deleting must not
        # need to parse it.
        return CapsuleInfo(name, 'disk', entry.size, 0, entry.mtime, '', entry.fingerprint, ())

    def drop_memory_tiers(self) -> None:
        """Forget every device and host capsule (used when the runtime closes)."""
        with self._lock:
            self._mem.clear()

    def infos(self, tier: str | None = None, unreadable: list[str] | None = None,
              foreign: list[str] | None = None) -> list[CapsuleInfo]:
        """
        Infos of all capsules, oldest first.

        Disk files of ours that cannot be read are named in `unreadable`, files with a
        capsule file name that are not capsules (no capsule header, links) in `foreign`.
        """
        def collect(_, listing):
            infos = [c.info() for c in self._mem.values()]
            for name, entry in listing.files.items():
                if name in self._mem:
                    continue
                if entry.kind == 'capsule':
                    infos.append(entry.head.info())
                elif entry.kind == 'corrupt':  # restore or verify says why
                    if unreadable is not None:
                        unreadable.append(name)
                elif foreign is not None:
                    foreign.append(name)
            return infos
        infos = self._decide(collect, scan=True)
        return sorted(
            (i for i in infos if tier is None or i.tier == tier), key=lambda i: (i.created, i.name)
        )

    def verify(self, name: str) -> CapsuleInfo:
        """Recompute the checksum (CorruptCapsuleError on mismatch); seal unsealed capsules."""
        # No lock: a capsule is never changed in place, and the read and the hash are long.
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

    def _write_disk(self, capsule: Capsule) -> Capsule:
        """Write a disk capsule: reserve, write outside the lock, publish (module docstring)."""
        name = capsule.name
        data = disk.encode(capsule, self.key)
        disk.sweep_stale_temps(self.dir)  # what a killed write left counts against the budget

        def reserve(entry, listing):
            self._check_not_writing(name)
            self._check_replace(name, entry)
            self._make_room('disk', len(data), name, listing)  # may refuse: nothing changed
            self._writing[name] = len(data)
            self._changed_disk()
        self._decide(reserve, name=name, tier='disk')
        try:
            path = disk.write(self.dir, name, data)
        except BaseException:
            with self._lock:
                self._release(name)
            raise
        self._decide(lambda _, listing: self._publish(name, len(data), listing), tier='disk')
        disk.sync_dir(self.dir)
        return capsule.with_blob(
            name, 'disk', None, meta_json=capsule.meta_json, created=capsule.created,
            pinned=capsule.pinned, checksum=capsule.checksum, nbytes=len(data), path=path,
            epoch=None)

    def _release(self, name: str) -> None:
        """End the reservation of a disk write (lock held)."""
        del self._writing[name]
        self._changed_disk()

    def _publish(self, name: str, nbytes: int, listing: disk.Listing | None) -> None:
        """Make a written file capsule `name` and evict what the budget needs (lock held)."""
        try:
            victims = self._make_room('disk', nbytes, name, listing)
        except BudgetExceededError:
            # The directory changed during the write (another process, pinned capsules): the
            # file stays, as written; the next disk snapshot makes room or refuses.
            victims = []
        files = listing.files if listing is not None else {}
        if not all(self.index.current(v, files[v]) for v in victims):
            raise _Stale  # before anything changed: decide again from a new listing
        self._release(name)
        self._mem.pop(name, None)  # only now does it replace a memory capsule
        self._disk_used[name] = time.time()
        for victim in victims:
            try:
                self._evicted.append(self._delete_disk(victim, files[victim],
                                                       f'evicting capsule {victim!r}'))
            except _Stale:  # another process changed it since the check above: left alone
                pass


class _Stale(Exception):
    """What a decision was made from changed before it was carried out: read it again."""


def _ours(listing: disk.Listing) -> dict[str, disk.Entry]:
    """Capsule files of ours (any model, readable or not); foreign files left out."""
    return {n: e for n, e in listing.files.items() if e.kind != 'foreign'}
