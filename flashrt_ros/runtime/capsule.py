"""
Capsules (immutable snapshots of the arena + metadata) and the tiered CapsuleStore.

Tiers
  device  blob on the arena's device: restore is one device-local copy (the fast path).
          Allocations come from torch's caching allocator, which recycles freed capsule
          blocks of the same size, so repeated snapshots do not hit cudaMalloc.
  host    blob in host memory (pinned on CUDA, so the copy back is a DMA transfer).
  disk    one safetensors file per capsule in capsule_dir: the blob as a uint8 tensor,
          the header (manifest, packing, meta, fingerprint) and checksum as metadata.
          Written atomically (temp file, fsync, rename, fsync dir); any process with
          the same model finds it by name.

Checksum: sha256 over the blob bytes and the header. It is NOT computed when a device or
host capsule is taken: hashing runs at ~1-2 GB/s on a CPU (and needs a device->host copy
on a GPU), which would turn a sub-millisecond snapshot into tens of milliseconds. It is
computed lazily — on verify_capsule(), when written to disk, and when a capsule is forked
to disk — and cached. A file read from disk is ALWAYS checked against its stored checksum.
A memory capsule is never handed out writable, so what the lazy checksum protects against
there is hardware/bug corruption between the first verify and later ones.

Budgets: exact bytes of blobs held per memory tier, and the exact file sizes of the
capsule files present in capsule_dir for the disk tier (the directory is the budget's
unit, also for files written by other processes). Policy "refuse" raises
BudgetExceededError; "lru" evicts least-recently-used unpinned capsules of that tier,
and only when that makes enough room (otherwise it refuses without evicting anything).
Every eviction is recorded; `drain_evicted()` hands the records to whoever reports them.

Names are one namespace across tiers: a name refers to one capsule, so a snapshot under
an existing name replaces that capsule whatever its tier (like overwriting a file). To
keep a copy in another tier, fork it under a new name.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
from pathlib import Path
import re
import tempfile
import threading
import time
from typing import Any, Callable, NamedTuple
import weakref

import torch

from .arena import ManifestEntry, Packing
from .errors import (
    BudgetExceededError,
    CapsuleNotFoundError,
    CorruptCapsuleError,
    FlashRTError,
    InvalidNameError,
)

TIERS = ('device', 'host', 'disk')
FORMAT_VERSION = 2  # 2: arena prefix blobs (row-block layout)
MAX_NAME_LEN = 128
_NAME_RE = re.compile(r'[A-Za-z0-9][A-Za-z0-9_.\-]*')  # whole name: fullmatch
_SUFFIX = '.safetensors'
STALE_TEMP_S = 3600.0  # a write's temp file older than this was left by a killed process


def validate_name(name: Any) -> str:
    """Return name if it is a safe capsule name, else raise InvalidNameError."""
    if not isinstance(name, str) or not name:
        raise InvalidNameError('capsule name must be a non-empty string')
    if len(name) > MAX_NAME_LEN:
        raise InvalidNameError(
            f'capsule name is {len(name)} characters; the limit is {MAX_NAME_LEN}'
        )
    if '/' in name or '\\' in name or '..' in name or not _NAME_RE.fullmatch(name):
        raise InvalidNameError(
            f"capsule name {name!r} is not allowed; use letters, digits, '_', '-', '.' "
            "(starting with a letter or digit, no '..', no path separators)"
        )
    return name


def _not_found(name: str) -> CapsuleNotFoundError:
    return CapsuleNotFoundError(f'capsule {name!r} not found; list_capsules() shows what exists')


def validate_tier(tier: Any) -> str:
    if tier not in TIERS:
        raise FlashRTError(f"tier {tier!r} is not valid; use one of {', '.join(TIERS)}")
    return tier


class CapsuleInfo(NamedTuple):
    """What a capsule operation reports (immutable; built on every restore, so a tuple)."""

    name: str
    tier: str
    nbytes: int
    position: int
    created: float  # unix seconds
    checksum: str  # hex; "" if not computed yet
    fingerprint: str
    components: tuple[str, ...]
    pinned: bool = False
    latency_s: float = 0.0


class Capsule:
    """An immutable snapshot: blob bytes, how they map onto the arena, and the non-tensor state."""

    def __init__(
        self,
        *,
        name: str,
        tier: str,
        blob: torch.Tensor | None,
        packing: Packing,
        manifest: tuple[ManifestEntry, ...],
        fingerprint: str,
        position: int,
        meta_json: str | Callable[[], str],
        components: tuple[str, ...],
        created: float | None = None,
        pinned: bool = False,
        checksum: str = '',
        nbytes: int | None = None,
        path: Path | None = None,
        epoch: int | None = None,
    ):
        self.name, self.tier, self.blob, self.packing = name, tier, blob, packing
        self.manifest, self.fingerprint, self.position = manifest, fingerprint, position
        self._meta_json, self.components = meta_json, components
        self.created = time.time() if created is None else created
        self.pinned, self.checksum, self.path = pinned, checksum, path
        self.nbytes = int(blob.numel()) if nbytes is None else nbytes
        self.last_used = time.monotonic()
        self.restore_cache: dict = {}  # checked meta, copy views of the blob (its runtime's)
        # The arena epoch the state was taken in (arena.rows_shared); None when unknown, as
        # for a capsule read from disk. In memory only: epochs are per process.
        self.epoch = epoch

    @property
    def meta_json(self) -> str:
        """Return the non-tensor state as JSON (a capture may defer building it to first use)."""
        if callable(self._meta_json):
            self._meta_json = self._meta_json()
        return self._meta_json

    def header(self) -> dict:
        """Everything but the blob and the checksum; what the checksum covers besides the bytes."""
        return {
            'format': FORMAT_VERSION,
            'fingerprint': self.fingerprint,
            'position': self.position,
            'created': self.created,
            'pinned': self.pinned,
            'components': list(self.components),
            'packing': self.packing.to_json(),
            'manifest': [e.to_json() for e in self.manifest],
            'meta': self.meta_json,
        }

    def compute_checksum(self) -> str:
        return _checksum(self.blob, json.dumps(self.header(), sort_keys=True))

    def info(self, latency_s: float = 0.0, tier: str | None = None) -> CapsuleInfo:
        # tuple.__new__ skips the named tuple's Python-level __new__ (every restore ends here)
        return tuple.__new__(CapsuleInfo, (
            self.name,
            tier or self.tier,
            self.nbytes,
            self.position,
            self.created,
            self.checksum,
            self.fingerprint,
            self.components,
            self.pinned,
            latency_s,
        ))

    def with_blob(self, name: str, tier: str, blob: torch.Tensor) -> 'Capsule':
        """Copy this capsule's identity around another blob (fork, tier moves)."""
        return Capsule(
            name=name,
            tier=tier,
            blob=blob,
            packing=self.packing,
            manifest=self.manifest,
            fingerprint=self.fingerprint,
            position=self.position,
            meta_json=self._meta_json,
            components=self.components,
            created=time.time(),
            checksum='',
            epoch=self.epoch,  # the same state bytes
        )


def _checksum(blob: torch.Tensor, header_json: str) -> str:
    h = hashlib.sha256()
    data = blob if blob.device.type == 'cpu' else blob.cpu()
    h.update(memoryview(data.contiguous().numpy()))
    h.update(header_json.encode())
    return h.hexdigest()


class BlobPool:
    """
    Host memory of dropped capsule blobs, handed out again to new ones (CPU runtimes).

    A fresh multi-megabyte host allocation is page-faulted in on its first write: a 33 MiB
    snapshot spent ~14 ms in faults around a 1.5 ms copy. take(nbytes) returns a uint8
    tensor of exactly nbytes, cut from an idle buffer when one fits (at most 1/8 larger),
    else from a new buffer with 1/16 room to grow (the next turn's capsule is a little
    larger). When no capsule holds the tensor any more, its buffer becomes idle again; idle
    buffers beyond `idle_limit` bytes go back to the allocator, oldest first. On CUDA the
    caching allocators already do this, so the runtime uses a pool on CPU only. A buffer is
    reused only when no other tensor shares its memory; a caller that keeps a capsule blob's
    UntypedStorage handle (and no tensor) is not seen by that check, so nothing may.
    """

    def __init__(self, idle_limit: int):
        self.idle_limit = idle_limit
        self._idle: collections.deque[tuple[int, torch.Tensor]] = collections.deque()  # sized
        self._idle_bytes = 0
        # Buffers come back from finalizers, which run wherever a capsule's last reference
        # drops, a garbage collection inside take() included: they append here (atomic)
        # and move on to _idle only when the lock is free.
        self._returned: collections.deque[torch.Tensor] = collections.deque()
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """Return a uint8 tensor of exactly nbytes, in reused memory when some fits."""
        buf = None
        with self._lock:
            self._collect()
            fits = [(size, i) for i, (size, _) in enumerate(self._idle)
                    if nbytes <= size <= nbytes + nbytes // 8]
            if fits:
                size, i = min(fits)
                buf = self._idle[i][1]
                del self._idle[i]
                self._idle_bytes -= size
                if not _unshared(buf):  # a view outlived its capsule: leave the memory to it
                    buf = None
        if buf is None:
            buf = torch.empty(nbytes + nbytes // 16, dtype=torch.uint8)
        blob = buf[:nbytes]
        weakref.finalize(blob, self._give, buf)  # views of blob die with its owner too
        return blob

    def _give(self, buf: torch.Tensor) -> None:
        self._returned.append(buf)
        if self._lock.acquire(blocking=False):  # not if take() on this thread holds it
            try:
                self._collect()
            finally:
                self._lock.release()

    def _collect(self) -> None:
        """Move returned buffers to the idle list; drop the oldest beyond the limit (locked)."""
        while self._returned:
            buf = self._returned.popleft()
            self._idle.append((buf.numel(), buf))
            self._idle_bytes += buf.numel()
        while self._idle_bytes > self.idle_limit:
            self._idle_bytes -= self._idle.popleft()[0]

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            self._collect()
            return self._idle_bytes

    def clear(self) -> None:
        """Drop the idle buffers and keep none from now on."""
        with self._lock:
            self.idle_limit = 0
            self._returned.clear()
            self._idle.clear()
            self._idle_bytes = 0


def _unshared(buf: torch.Tensor) -> bool:
    """Whether no tensor but `buf` uses its memory (False when torch cannot tell)."""
    use_count = getattr(torch._C, '_storage_Use_Count', None)
    if use_count is None:
        return False
    storage = buf.untyped_storage()
    return use_count(storage._cdata) <= 2  # buf and the `storage` handle itself


def host_blob(nbytes: int, tier: str, device: torch.device) -> torch.Tensor:
    """
    Host memory for a blob of `tier` ('host' or 'disk') of a runtime on `device`.

    Pinned for the host tier of a GPU runtime: copies to and from it are DMA transfers. A
    disk blob is written once, so it stays pageable (torch's pinned allocator rounds to a
    power of two and keeps freed blocks pinned); on a CPU runtime all of it is plain RAM.
    """
    return torch.empty(nbytes, dtype=torch.uint8,
                       pin_memory=device.type == 'cuda' and tier == 'host')


def move_blob(blob: torch.Tensor, tier: str, device: torch.device,
              alloc=None) -> torch.Tensor:
    """Copy blob into a new tensor in `tier`'s memory (never aliases the input)."""
    if alloc is not None:  # the caller's memory of the right kind
        out = alloc(blob.numel())
    elif tier == 'device':
        out = torch.empty_like(blob, device=device)
    else:
        out = host_blob(blob.numel(), tier, device)
    out.copy_(blob)
    return out


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
        self._sweep_stale_temps()

    def _sweep_stale_temps(self) -> None:
        """Remove temp files of disk writes that a killed process left behind."""
        try:
            entries = list(os.scandir(self.dir))
        except OSError:  # no capsule directory (yet)
            return
        cutoff = time.time() - STALE_TEMP_S  # a younger one may be another process's write
        for entry in entries:
            if entry.name.startswith('.') and entry.name.endswith('.tmp'):
                try:
                    if entry.stat().st_mtime < cutoff:
                        os.unlink(entry.path)
                except OSError:
                    pass

    # ---- accounting ------------------------------------------------------------------

    def used_bytes(self, tier: str) -> int:
        with self._lock:
            if tier == 'disk':
                return sum(size for _, size, _ in self._disk_files())
            return sum(c.nbytes for c in self._mem.values() if c.tier == tier)

    def count(self, tier: str) -> int:
        with self._lock:
            if tier == 'disk':
                return len(self._disk_files())
            return sum(1 for c in self._mem.values() if c.tier == tier)

    def _make_room(self, tier: str, nbytes: int, replacing: str) -> list[str]:
        """Names to evict so nbytes fit in tier (replacing `replacing`); raises if impossible."""
        budget = self.budgets.get(tier, 0)
        if budget <= 0:
            return []
        if tier == 'disk':
            entries = [
                (n, size, mtime, self._disk_pinned(n)) for n, size, mtime in self._disk_files()
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
            path = self._path(name)
            if not path.is_file():
                raise _not_found(name)
            cap = self._read_disk(name, path, header_only=header_only)
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
            st = self._path(name).stat()
            return CapsuleInfo(name, 'disk', st.st_size, 0, st.st_mtime, '', '', ())

    def drop_memory_tiers(self) -> None:
        """Forget every device and host capsule (used when the runtime closes)."""
        with self._lock:
            self._mem.clear()

    def _delete_locked(self, name: str, missing_ok: bool = False) -> None:
        path = os.path.join(self.dir, name + _SUFFIX)
        try:  # every memory snapshot comes here: one syscall, no Path object
            os.unlink(path)
            found = True
        except OSError:
            if os.path.isfile(path):  # there, and it cannot be removed: nothing was changed
                raise
            found = False  # no such file (or no capsule directory at all)
        found = self._mem.pop(name, None) is not None or found
        if not found and not missing_ok:
            raise _not_found(name)

    def infos(self, tier: str | None = None,
              unreadable: list[str] | None = None) -> list[CapsuleInfo]:
        """Infos of all capsules, oldest first; unreadable disk files are named in unreadable."""
        with self._lock:
            infos = [c.info() for c in self._mem.values()]
            for name, _, _ in self._disk_files():
                if name in self._mem:
                    continue
                try:
                    infos.append(self._read_disk(name, self._path(name), header_only=True).info())
                except CorruptCapsuleError:  # restore or verify says why
                    if unreadable is not None and self._path(name).is_file():  # not deleted
                        unreadable.append(name)
        return sorted(
            (i for i in infos if tier is None or i.tier == tier), key=lambda i: (i.created, i.name)
        )

    def verify(self, name: str) -> CapsuleInfo:
        """Recompute the checksum (CorruptCapsuleError on mismatch); seal unsealed capsules."""
        with self._lock:
            cap = self.get(name)  # a disk capsule is verified while being read
            if cap.tier != 'disk':
                actual = cap.compute_checksum()
                if cap.checksum and cap.checksum != actual:
                    raise CorruptCapsuleError(
                        f'capsule {name!r} changed since its checksum was taken; '
                        'delete it and take a new snapshot'
                    )
                cap.checksum = actual
            return cap.info()

    # ---- disk ------------------------------------------------------------------------

    def _path(self, name: str) -> Path:
        return self.dir / (name + _SUFFIX)

    def _disk_files(self) -> list[tuple[str, int, float]]:
        if not self.dir.is_dir():
            return []
        out = []
        for entry in os.scandir(self.dir):
            if entry.name.endswith(_SUFFIX) and not entry.name.startswith('.'):
                name = entry.name[: -len(_SUFFIX)]
                try:
                    validate_name(name)
                    st = entry.stat()
                except (InvalidNameError, OSError):
                    continue
                out.append((name, st.st_size, st.st_mtime))
        return out

    def _disk_pinned(self, name: str) -> bool:
        try:
            return self._read_disk(name, self._path(name), header_only=True).pinned
        except CorruptCapsuleError:
            return False

    def _write_disk(self, capsule: Capsule) -> Capsule:
        from safetensors.torch import save

        blob = capsule.blob if capsule.blob.device.type == 'cpu' else capsule.blob.cpu()
        capsule.checksum = capsule.checksum or capsule.compute_checksum()
        header_json = json.dumps(capsule.header(), sort_keys=True)
        data = save(
            {'blob': blob}, metadata={'flashrt': header_json, 'checksum': capsule.checksum}
        )
        victims = self._make_room('disk', len(data), capsule.name)  # may refuse: nothing changed
        path, tmp = self._path(capsule.name), None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f'.{capsule.name}.', suffix='.tmp', dir=self.dir)
            with os.fdopen(fd, 'wb') as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # atomic: readers see old or new, never half
        except BaseException as exc:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            if isinstance(exc, OSError):  # disk full, quota, read-only, no directory
                raise FlashRTError(
                    f'capsule {capsule.name!r} could not be written to {str(path)!r} ({exc}); '
                    'nothing was replaced or evicted: free space or fix capsule_dir, or '
                    'snapshot to another tier'
                ) from exc
            raise
        # Written: only now does it replace a same-named memory capsule (the old file went in
        # the rename) and do the budget's victims go.
        self._mem.pop(capsule.name, None)
        for victim in victims:
            self._evict(victim)
        dir_fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # make the rename itself durable
        finally:
            os.close(dir_fd)
        disk = Capsule(
            name=capsule.name,
            tier='disk',
            blob=None,
            packing=capsule.packing,
            manifest=capsule.manifest,
            fingerprint=capsule.fingerprint,
            position=capsule.position,
            meta_json=capsule.meta_json,
            components=capsule.components,
            created=capsule.created,
            pinned=capsule.pinned,
            checksum=capsule.checksum,
            nbytes=len(data),
            path=self._path(capsule.name),
        )
        return disk

    def _read_disk(self, name: str, path: Path, header_only: bool = False) -> Capsule:
        from safetensors import safe_open

        try:
            size = path.stat().st_size
            with safe_open(str(path), framework='pt', device='cpu') as f:
                meta = f.metadata() or {}
                header_json, checksum = meta['flashrt'], meta['checksum']
                header = json.loads(header_json)
                blob = None if header_only else f.get_tensor('blob')
            if header.get('format') != FORMAT_VERSION:
                raise ValueError(f"capsule format {header.get('format')!r}, this version reads "
                                 f'{FORMAT_VERSION}: written by another flashrt_ros release')
            cap = Capsule(
                name=name,
                tier='disk',
                blob=blob,
                packing=Packing.from_json(header['packing']),
                manifest=tuple(ManifestEntry.from_json(e) for e in header['manifest']),
                fingerprint=header['fingerprint'],
                position=int(header['position']),
                meta_json=header['meta'],
                components=tuple(header['components']),
                created=float(header['created']),
                pinned=bool(header['pinned']),
                checksum=checksum,
                nbytes=size,
                path=path,
            )
        except Exception as exc:  # truncated/garbled file: safetensors, json, key and type errors
            raise CorruptCapsuleError(
                f'capsule file {str(path)!r} cannot be read ({exc}); '
                'delete it and take a new snapshot'
            ) from exc
        if blob is not None:
            if blob.dtype != torch.uint8 or blob.dim() != 1 or blob.numel() != cap.packing.nbytes:
                raise CorruptCapsuleError(
                    f'capsule file {str(path)!r} holds {blob.numel()} bytes of state, '
                    f'its header says {cap.packing.nbytes}; delete it'
                )
            if _checksum(blob, json.dumps(header, sort_keys=True)) != checksum:
                raise CorruptCapsuleError(
                    f'capsule {name!r} failed its checksum (the file was modified or '
                    'damaged); delete it and take a new snapshot'
                )
        return cap
