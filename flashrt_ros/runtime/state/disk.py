"""
The disk tier's format: one safetensors file per capsule in capsule_dir, and its index.

A file holds the blob as a uint8 tensor and, as safetensors metadata, the header under the
key MAGIC (format version, manifest, packing, meta, fingerprint, ...), a sha256 checksum
over the blob bytes and the header and, with a capsule key, a MAC over that checksum. Only
a file with that header is a capsule; any other file (a model's `model.safetensors`, a
symbolic link) is foreign and left alone. A file is written atomically (temp file, fsync,
rename, fsync dir), so any process with the same model finds it by name, and it is always
checked against its checksum (and MAC) when read whole. Files are opened without following
links, so a link planted under a capsule's name is never read through.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import hmac
import json
import os
from pathlib import Path
import stat
import tempfile
import threading
import time
from typing import NamedTuple

import torch

from .arena import ManifestEntry, Packing
from .capsule import Capsule, Origin, validate_name
from ..errors import CapsuleNotFoundError, CorruptCapsuleError, FlashRTError, InvalidNameError

FORMAT_VERSION = 2  # 2: arena prefix blobs (row-block layout)
MAGIC = 'flashrt'  # the metadata key of the header: a file without it is not a capsule
SUFFIX = '.safetensors'
STALE_TEMP_S = 3600.0  # a write's temp file older than this was left by a killed process
# A temp file of ours is locked while it is written; one that is unlocked and this old has
# no writer left (the age covers the moment between creating and locking it).
UNLOCKED_TEMP_S = 60.0
TEMP_MARK = '.w-'  # in our temp files' names: .<name>.w-XXXXXXXX.tmp
MAX_HEADER = 64 << 20  # bytes of safetensors header JSON read at most
READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)
# No link is followed; O_NONBLOCK: a FIFO planted under a capsule's name does not block.
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class NotACapsuleError(CapsuleNotFoundError):
    """A file has a capsule's name but is not one (no flashrt_ros header, or a link)."""


class Entry(NamedTuple):
    """One file of capsule_dir as the index knows it."""

    key: tuple  # lstat identity; the header is read again when it changes
    size: int
    mtime: float
    kind: str  # 'capsule', 'corrupt' (our header, unreadable) or 'foreign'
    head: Capsule | None  # header-only capsule of kind 'capsule'
    fingerprint: str  # '' when unknown


def path_of(directory: Path, name: str) -> Path:
    return directory / (name + SUFFIX)


def header(cap: Capsule) -> dict:
    """Everything but the blob and the checksum; what the checksum covers besides the bytes."""
    head = {
        'format': FORMAT_VERSION,
        'fingerprint': cap.fingerprint,
        'position': cap.position,
        'created': cap.created,
        'pinned': cap.pinned,
        'components': list(cap.components),
        'packing': cap.packing.to_json(),
        'manifest': [e.to_json() for e in cap.manifest],
        'meta': cap.meta_json,
    }
    if cap.origin is not None:  # only an imported capsule's: other headers stay as they were
        head['origin'] = cap.origin.to_json()
    return head


def checksum(blob: torch.Tensor, header_json: str, blob_sha256=None) -> str:
    """sha256 over the blob's bytes, then the header; blob_sha256: the blob's, hashed already."""
    if blob_sha256 is not None:
        h = blob_sha256.copy()
    else:
        h = hashlib.sha256()
        data = blob if blob.device.type == 'cpu' else blob.cpu()
        h.update(memoryview(data.contiguous().numpy()))
    h.update(header_json.encode())
    return h.hexdigest()


def mac(key: bytes, checksum_hex: str) -> str:
    """HMAC-SHA256 over the checksum, itself a sha256 over the blob and the header."""
    return hmac.new(key, b'flashrt-capsule:' + checksum_hex.encode(), 'sha256').hexdigest()


def capsule_checksum(cap: Capsule) -> str:
    return checksum(cap.blob, json.dumps(header(cap), sort_keys=True))


def io_error(what: str, path, exc: OSError) -> FlashRTError:
    """Return the FlashRTError for a failed write or delete (read-only said as such)."""
    if exc.errno in READ_ONLY:
        return FlashRTError(
            f'{what} failed: capsule_dir {str(Path(path).parent)!r} is read-only here '
            f'({exc.strerror}); nothing was changed: snapshot to another tier or set '
            'capsule_dir to a writable directory')
    return FlashRTError(f'{what} failed at {str(path)!r} ({exc}); nothing was changed')


def not_a_capsule(name: str, path, why: str) -> NotACapsuleError:
    return NotACapsuleError(
        f'{str(path)!r} is {why}, so it is not a capsule: flashrt_ros leaves it alone '
        f'(there is no capsule {name!r}; remove or rename the file yourself, or use another '
        'name)')


def foreign_reason(entry: Entry) -> str:
    """Say what a foreign file is, for not_a_capsule."""
    mode = entry.key[-1]
    if stat.S_ISLNK(mode):
        return 'a symbolic link'
    if not stat.S_ISREG(mode):
        return 'not a regular file'
    return 'a file without the flashrt_ros capsule header'


def _open(name: str, path) -> int:
    """Open a capsule file for reading without following a link; raise for a missing one."""
    try:
        return os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise CapsuleNotFoundError(
            f'capsule {name!r} not found; list_capsules() shows what exists') from None
    except NotADirectoryError:  # capsule_dir is not a directory: no disk capsules at all
        raise CapsuleNotFoundError(
            f'capsule {name!r} not found; list_capsules() shows what exists') from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise not_a_capsule(name, path, 'a symbolic link') from None
        raise FlashRTError(f'capsule file {str(path)!r} cannot be opened ({exc}); check '
                           'the permissions of capsule_dir') from exc


def _safetensors_head(pread, size: int) -> tuple[dict, int] | None:
    """
    Return (the safetensors header JSON, its length) of a file of ours, None if foreign.

    pread(n, offset) reads the file's bytes (os.pread of a descriptor, or a slice of memory).
    """
    raw = pread(8, 0)
    n = int.from_bytes(raw, 'little') if len(raw) == 8 else 0
    if not 2 <= n <= min(MAX_HEADER, size - 8):
        return None
    try:
        top = json.loads(pread(n, 8))
    except ValueError:  # not JSON, or not UTF-8
        return None
    meta = top.get('__metadata__') if isinstance(top, dict) else None
    if not isinstance(meta, dict) or MAGIC not in meta:
        return None
    return top, n


# What to do about a bad capsule: a file is deleted and taken again, received bytes are
# transferred again (nothing of them was stored).
ON_FILE = 'delete it and take a new snapshot'
ON_RECEIVED = 'nothing was stored: transfer it again'


def _parse_head(name: str, where: str, top: dict, n: int, size: int,
                path: Path | None, advice: str = ON_FILE) -> tuple[Capsule, dict, dict, int]:
    """Return the header-only capsule, its header, the metadata and the blob's byte count."""
    try:
        meta = top['__metadata__']
        header_json, stored = meta[MAGIC], meta['checksum']
        head = json.loads(header_json)
        if head.get('format') != FORMAT_VERSION:
            raise ValueError(f"capsule format {head.get('format')!r}, this version reads "
                             f'{FORMAT_VERSION}: written by another flashrt_ros release')
        entry = top['blob']
        nbytes = int(entry['shape'][0])
        if (entry['dtype'] != 'U8' or entry['data_offsets'] != [0, nbytes]
                or size != 8 + n + nbytes):
            raise ValueError(f'the file holds {size} bytes, its header says '
                             f'{8 + n + nbytes} (truncated or garbled)')
        cap = Capsule(
            name=name,
            tier='disk',
            blob=None,
            packing=Packing.from_json(head['packing']),
            manifest=tuple(ManifestEntry.from_json(e) for e in head['manifest']),
            fingerprint=head['fingerprint'],
            position=int(head['position']),
            meta_json=head['meta'],
            components=tuple(head['components']),
            created=float(head['created']),
            pinned=bool(head['pinned']),
            checksum=stored,
            nbytes=size,
            path=path,
            origin=Origin.from_json(head.get('origin')),
        )
    except Exception as exc:  # garbled header: json, key, type and value errors
        raise CorruptCapsuleError(
            f'{where} cannot be read ({exc}); {advice}') from exc
    return cap, head, meta, nbytes


def _check_blob_size(where: str, cap: Capsule, nbytes: int, advice: str = ON_FILE) -> None:
    if nbytes != cap.packing.nbytes:
        raise CorruptCapsuleError(
            f'{where} holds {nbytes} bytes of state, its header says {cap.packing.nbytes}; '
            f'{advice}')


def _verify(name: str, blob: torch.Tensor, head: dict, meta: dict, key: bytes | None,
            blob_sha256=None, advice: str = ON_FILE) -> None:
    """Raise CorruptCapsuleError unless blob + header match the checksum (and the MAC)."""
    stored = meta['checksum']
    if checksum(blob, json.dumps(head, sort_keys=True), blob_sha256) != stored:
        raise CorruptCapsuleError(
            f'capsule {name!r} failed its checksum (the file was modified or '
            f'damaged); {advice}')
    if key is not None and not hmac.compare_digest(str(meta.get('mac', '')), mac(key, stored)):
        raise CorruptCapsuleError(
            f'capsule {name!r} was not written with this key ($FLASHRT_CAPSULE_KEY_FILE): its MAC '
            'is missing or wrong, so it is refused; take a new snapshot, or restore it in a '
            'runtime with the key that wrote it')


def read(name: str, path: Path, header_only: bool = False, key: bytes | None = None) -> Capsule:
    """Read a capsule file; header_only leaves the blob out (and unverified)."""
    fd = _open(name, path)
    where = f'capsule file {str(path)!r}'
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise not_a_capsule(name, path, 'not a regular file')
        found = _safetensors_head(functools.partial(os.pread, fd), st.st_size)
        if found is None:
            raise not_a_capsule(name, path, 'a file without the flashrt_ros capsule header')
        top, n = found
        cap, head, meta, nbytes = _parse_head(name, where, top, n, st.st_size, path)
        if header_only:
            return cap
        _check_blob_size(where, cap, nbytes)
        blob = torch.empty(nbytes, dtype=torch.uint8)
        view, done = memoryview(blob.numpy()), 0
        while done < nbytes:  # one read of up to 2 GiB per call on Linux
            got = os.preadv(fd, [view[done:]], 8 + n + done)
            if got <= 0:
                raise CorruptCapsuleError(f'{where} was truncated while it was read; '
                                          'try again')
            done += got
    except OSError as exc:
        raise FlashRTError(f'{where} cannot be read ({exc})') from exc
    finally:
        os.close(fd)
    _verify(name, blob, head, meta, key)
    cap.blob = blob
    return cap


def decode(name: str, data, key: bytes | None = None, blob_sha256=None) -> Capsule:
    """
    Parse and verify capsule file bytes held in memory (what encode() returned, received).

    The blob is a view of `data` (a writable buffer the caller hands over). Raises
    CorruptCapsuleError for bytes that are not a whole capsule or fail the checksum or MAC.
    blob_sha256: a sha256 the receiver fed every byte after the safetensors header with as
    they arrived; used when the blob is exactly those bytes.
    """
    view = memoryview(data)
    where = f'received capsule {name!r}'
    found = _safetensors_head(lambda k, off: bytes(view[off:off + k]), len(view))
    if found is None:
        raise CorruptCapsuleError(f'{where} has no flashrt_ros capsule header (garbled in '
                                  f'transit); {ON_RECEIVED}')
    top, n = found
    cap, head, meta, nbytes = _parse_head(name, where, top, n, len(view), None, ON_RECEIVED)
    _check_blob_size(where, cap, nbytes, ON_RECEIVED)
    blob = torch.frombuffer(view, dtype=torch.uint8, offset=8 + n, count=nbytes) \
        if nbytes else torch.empty(0, dtype=torch.uint8)
    if 8 + n + nbytes != len(view):
        blob_sha256 = None
    _verify(name, blob, head, meta, key, blob_sha256, ON_RECEIVED)
    cap.blob = blob
    return cap


def _load_entry(name: str, path: Path, st: os.stat_result, key: tuple) -> Entry:
    """Read the header of one file for the index."""
    if not stat.S_ISREG(st.st_mode):
        return Entry(key, st.st_size, st.st_mtime, 'foreign', None, '')
    try:
        head = read(name, path, header_only=True)
        return Entry(key, st.st_size, st.st_mtime, 'capsule', head, head.fingerprint)
    except NotACapsuleError:
        return Entry(key, st.st_size, st.st_mtime, 'foreign', None, '')
    except FlashRTError:  # ours, unreadable: keep what its header says about its model
        return Entry(key, st.st_size, st.st_mtime, 'corrupt', None, _fingerprint_of(path))


def _fingerprint_of(path: Path) -> str:
    try:
        fd = os.open(path, _OPEN_FLAGS)
        try:
            top, _ = _safetensors_head(functools.partial(os.pread, fd), os.fstat(fd).st_size)
        finally:
            os.close(fd)
        return str(json.loads(top['__metadata__'][MAGIC])['fingerprint'])
    except Exception:  # noqa: B902 - any failure means: unknown
        return ''


def _stat_key(st: os.stat_result) -> tuple:
    return (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode)


class Listing(NamedTuple):
    """One scan of capsule_dir."""

    files: dict[str, Entry]  # every file with a capsule file name (foreign ones too)
    temps: dict[str | None, int]  # temp files' bytes by the capsule they are written for


class DiskIndex:
    """
    The files of capsule_dir, each header read once and again only when the file changes.

    scan() lists the directory and lstats each entry (cheap); a header is re-read only when
    a file's stat identity (inode, size, mtime, ctime, mode) changed. Safe to use from
    several threads: its lock guards only the cache, never held while a file is touched
    (an entry is used only while its stat identity matches, so a stale one is harmless).
    """

    def __init__(self, directory: Path):
        self.dir = directory
        self._entries: dict[str, Entry] = {}
        self._lock = threading.Lock()

    def scan(self) -> Listing:
        """List every file with a capsule file name (foreign ones too) and the temp files."""
        with self._lock:
            known = dict(self._entries)
        entries, temps = {}, {}
        try:
            listing = os.scandir(self.dir)
        except OSError:  # no capsule directory (yet), or not one
            listing = None
        if listing is not None:
            with listing:
                for item in listing:
                    fname = item.name
                    try:
                        if fname.startswith('.'):
                            if fname.endswith('.tmp') and item.is_file(follow_symlinks=False):
                                owner = temp_owner(fname)
                                temps[owner] = (temps.get(owner, 0)
                                                + item.stat(follow_symlinks=False).st_size)
                            continue
                        if not fname.endswith(SUFFIX):
                            continue
                        name = fname[:-len(SUFFIX)]
                        old = known.get(name)  # a known name is a valid one
                        if old is None:
                            validate_name(name)
                        st = item.stat(follow_symlinks=False)
                    except (InvalidNameError, OSError):
                        continue
                    key = _stat_key(st)
                    entries[name] = (old if old is not None and old.key == key
                                     else _load_entry(name, Path(item.path), st, key))
        with self._lock:
            self._entries = dict(entries)
        return Listing(entries, temps)

    def entry(self, name: str) -> Entry | None:
        """Return the Entry of one name, refreshed from one lstat (None: no such file)."""
        path = os.path.join(self.dir, name + SUFFIX)
        try:
            st = os.lstat(path)
        except OSError:  # every memory snapshot comes here: one syscall, no Path object
            with self._lock:
                self._entries.pop(name, None)
            return None
        key = _stat_key(st)
        with self._lock:
            old = self._entries.get(name)
        if old is None or old.key != key:
            old = _load_entry(name, Path(path), st, key)
            with self._lock:
                self._entries[name] = old
        return old

    def current(self, name: str, entry: Entry) -> bool:
        """Whether `name`'s file is still the one `entry` describes (one lstat)."""
        try:
            return _stat_key(os.lstat(os.path.join(self.dir, name + SUFFIX))) == entry.key
        except OSError:
            return False

    def touch(self, name: str, path: Path) -> None:
        """Set the file's mtime (the LRU clock other processes see); never fails."""
        try:
            os.utime(path, follow_symlinks=False)
            st = os.lstat(path)
        except OSError:  # read-only file or directory: the in-memory clock is enough
            return
        with self._lock:
            old = self._entries.get(name)
            if old is not None and old.key[:3] == _stat_key(st)[:3]:  # the same file, touched
                self._entries[name] = old._replace(key=_stat_key(st), mtime=st.st_mtime)

    def remove(self, name: str, what: str) -> None:
        """Delete capsule `name`'s file (the caller checked it is one of ours)."""
        path = os.path.join(self.dir, name + SUFFIX)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise io_error(what, path, exc) from exc
        with self._lock:
            self._entries.pop(name, None)


def temp_owner(fname: str) -> str | None:
    """Return the capsule name a temp file of ours (.<name>.w-XXXXXXXX.tmp) is written for."""
    name, mark, rand = fname[1:-len('.tmp')].rpartition(TEMP_MARK)
    return name if mark and len(rand) == 8 else None


def sweep_stale_temps(directory: Path) -> None:
    """
    Remove temp files of disk writes that a killed process left behind.

    Any temp file older than STALE_TEMP_S goes; one of ours (TEMP_MARK) goes sooner, once
    it is UNLOCKED_TEMP_S old and no process holds its lock (its writer is gone).
    """
    try:
        entries = list(os.scandir(directory))
    except OSError:  # no capsule directory (yet)
        return
    now = time.time()
    for entry in entries:
        if not (entry.name.startswith('.') and entry.name.endswith('.tmp')):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                continue
            age = now - st.st_mtime
            if age > STALE_TEMP_S:
                os.unlink(entry.path)
            elif TEMP_MARK in entry.name and age > UNLOCKED_TEMP_S:
                fd = os.open(entry.path, _OPEN_FLAGS)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while written
                    os.unlink(entry.path)
                finally:
                    os.close(fd)
        except OSError:  # locked, gone meanwhile, or a read-only directory
            pass


def encode(cap: Capsule, key: bytes | None = None) -> bytes:
    """Return the file's bytes; seals the capsule (sets its checksum) if it was not yet."""
    from safetensors.torch import save

    blob, meta = _sealed(cap, key)
    return save({'blob': blob}, metadata=meta)


def file_parts(cap: Capsule, key: bytes | None = None) -> tuple[bytes, torch.Tensor]:
    """
    Return a capsule file as (head, blob): head + blob's bytes decode() like encode()'s.

    For a writer that streams the blob where it goes (a shared-memory export) instead of
    building the whole file in memory first. The head is safetensors' layout: 8 bytes of
    length, the compact JSON header, spaces to a multiple of 8 (the same length as
    encode()'s; safetensors orders the metadata keys its own way, this sorts them).
    """
    blob, meta = _sealed(cap, key)
    n = blob.numel()
    top = {'__metadata__': dict(sorted(meta.items())),
           'blob': {'dtype': 'U8', 'shape': [n], 'data_offsets': [0, n]}}
    text = json.dumps(top, separators=(',', ':'), ensure_ascii=False).encode()
    text += b' ' * (-(8 + len(text)) % 8)
    return len(text).to_bytes(8, 'little') + text, blob


def _sealed(cap: Capsule, key: bytes | None) -> tuple[torch.Tensor, dict]:
    """Return the capsule's blob on the host and its file metadata; set its checksum."""
    blob = cap.blob if cap.blob.device.type == 'cpu' else cap.blob.cpu()
    header_json = json.dumps(header(cap), sort_keys=True)
    cap.checksum = cap.checksum or checksum(blob, header_json)
    meta = {MAGIC: header_json, 'checksum': cap.checksum}
    if key is not None:
        meta['mac'] = mac(key, cap.checksum)
    return blob, meta


def write(directory: Path, name: str, data: bytes) -> Path:
    """Write `data` as capsule `name`'s file atomically (the directory's fsync: sync_dir)."""
    path, tmp = path_of(directory, name), None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f'.{name}{TEMP_MARK}', suffix='.tmp', dir=directory)
        with os.fdopen(fd, 'wb') as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # a sweep leaves a locked temp file alone
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)  # atomic: readers see old or new, never half
    except BaseException as exc:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(exc, OSError):  # disk full, quota, read-only, no directory
            if exc.errno in READ_ONLY:
                raise io_error(f'writing capsule {name!r}', path, exc) from exc
            raise FlashRTError(
                f'capsule {name!r} could not be written to {str(path)!r} ({exc}); '
                'nothing was replaced or evicted: free space or fix capsule_dir, or '
                'snapshot to another tier'
            ) from exc
        raise
    return path


def sync_dir(directory: Path) -> None:
    """Make the renames in `directory` durable."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        raise FlashRTError(f'capsule_dir {str(directory)!r} could not be synced ({exc}); the '
                           'capsule was written but may not survive a power loss') from exc
