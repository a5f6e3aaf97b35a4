"""
Capsule transfer between runtimes: the sender's exports, the receiver's staging.

What travels is the disk tier's file format (disk.encode): the header (fingerprint,
manifest, packing, the non-tensor state), the content checksum over blob and header (and a
MAC with a capsule key) and the blob. The protocol, whatever carries it:

1. The receiver asks for a manifest. The sender encodes the capsule once and keeps those
   bytes as an export: what it serves is a consistent snapshot, whatever happens to the
   name meanwhile (replaced, deleted, evicted).
2. The receiver checks the manifest against its own runtime (model and layout fingerprint,
   arena manifest, name, tier budget) before it asks for a single byte.
3. It reads chunks in order into a staging buffer it owns (`Staging`).
4. A complete buffer is decoded and verified (disk.decode: checksum, MAC) and must be the
   capsule the manifest announced; only then does it become a capsule in the store.
   A transfer that stops early, or bytes that fail a check, leave nothing behind: the
   staging buffer is dropped.

On one host (the same kernel boot, `host_id()`), the sender also writes the export to a
file in shared memory (/dev/shm, mode 0600, named for its process and export) and the
receiver reads it from there in one pass instead of chunk by chunk: the same bytes, checked
the same way in step 4. Where it cannot (another mount namespace, another user, no such
file) it reads the chunks. The file goes with the export (closed, idle, or its process
gone: swept by the next runtime on the host).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
import secrets
import socket
import stat
import threading
import time

from . import disk
from .capsule import Capsule, Origin
from .memory import huge_page_memory
from ..errors import CapsuleNotFoundError, CorruptCapsuleError, FingerprintMismatchError
from ..errors import InvalidRequestError

# Fits Fast DDS's default shared-memory segment (512 KiB) between processes on one host;
# with config/fastdds_large_data.xml 1 MiB is faster. docs/transfer.md has the numbers.
DEFAULT_CHUNK_BYTES = 256 << 10
MAX_CHUNK_BYTES = 16 << 20
EXPORT_IDLE_S = 60.0  # an export nobody read from for this long is dropped
# One never read from goes sooner: manifests asked for and left unread cannot hold every
# export slot (a same-host receiver reads the shared file and closes it well within this).
UNREAD_IDLE_S = 10.0
MAX_EXPORTS = 8  # open exports per runtime (each holds one encoded capsule in memory)
LOCAL_DIR = Path('/dev/shm')  # where same-host exports are shared (tmpfs: memory)
LOCAL_PREFIX = 'flashrt-export-'  # + '<pid>-<export id>'
LOCAL_READ_BYTES = 4 << 20  # one read of a local export: a feedback step


def host_id() -> str:
    """Name this kernel boot ('' where unknown): equal ids can share LOCAL_DIR files."""
    try:
        boot = Path('/proc/sys/kernel/random/boot_id').read_text().strip()
    except OSError:
        return ''
    return f'{socket.gethostname()}/{boot}' if boot else ''


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What the receiver learns before any bytes move."""

    export_id: str  # names the sender's consistent snapshot of the capsule's bytes
    name: str  # the capsule's name on the sender
    total_bytes: int  # bytes that will travel (the encoded capsule)
    checksum: str  # the capsule's content checksum (sha256 over blob and header)
    header_json: str  # disk.header(): fingerprint, manifest, packing, position, meta
    local_path: str = ''  # the same bytes in shared memory, for a receiver on this host

    @property
    def header(self) -> dict:
        return json.loads(self.header_json)

    @property
    def fingerprint(self) -> str:
        return self.header['fingerprint']

    @property
    def position(self) -> int:
        return int(self.header['position'])

    @property
    def state_bytes(self) -> int:
        return int(self.header['packing']['nbytes'])


class Exports:
    """A runtime's open exports: encoded capsules served by offset until closed or idle."""

    def __init__(self, key: bytes | None, clock=time.monotonic):
        self.key, self._clock = key, clock
        self._open: dict[str, list] = {}  # export_id -> [manifest, data, last_used, read]
        self._lock = threading.Lock()
        _sweep_local()

    def add(self, cap: Capsule, local: bool = False) -> Manifest:
        """
        Encode `cap` (a capsule with its blob) and return the manifest of its export.

        local: also share the bytes in LOCAL_DIR for a receiver on this host (skipped,
        local_path empty, when that directory cannot take them).
        """
        with self._lock:
            self._expire()
            full = len(self._open) >= MAX_EXPORTS
        if full:  # checked before the encoding, which is most of an export's cost
            raise InvalidRequestError(
                f'{MAX_EXPORTS} exports are open on this node; wait for one to finish '
                f'(an idle one is dropped after {EXPORT_IDLE_S:.0f} s, one never read from after '
                f'{UNREAD_IDLE_S:.0f} s) and try again')
        export_id = secrets.token_hex(8)
        data = _write_local(export_id, cap, self.key) if local else None
        path = data.name if data is not None else ''
        if data is None:  # in memory (seals an unsealed capsule)
            data = memoryview(disk.encode(cap, self.key))
        with self._lock:
            manifest = Manifest(export_id, cap.name, len(data), cap.checksum,
                                manifest_header(cap), path)
            self._open[export_id] = [manifest, data, self._clock(), False]
        return manifest

    def chunk(self, export_id: str, offset: int, length: int) -> memoryview:
        """Return bytes [offset, offset + length) of an open export (shorter at its end)."""
        with self._lock:
            self._expire()
            entry = self._open.get(export_id)
            if entry is None:
                raise CapsuleNotFoundError(
                    f'export {export_id!r} is not open here (finished, or idle for more than '
                    f'{EXPORT_IDLE_S:.0f} s); ask for the manifest again')
            entry[2], entry[3] = self._clock(), True
        data = entry[1]
        if not (0 <= offset <= len(data)) or not (0 < length <= MAX_CHUNK_BYTES):
            raise InvalidRequestError(
                f'chunk at offset {offset} of length {length} is outside export {export_id!r} '
                f'({len(data)} bytes; a chunk is 1 to {MAX_CHUNK_BYTES} bytes)')
        return data[offset:offset + length]

    def close(self, export_id: str) -> None:
        with self._lock:
            entry = self._open.pop(export_id, None)
        if entry is not None:
            _drop(entry)

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._open)

    def _expire(self) -> None:
        now = self._clock()
        for export_id in [k for k, v in self._open.items()
                          if now - v[2] > (EXPORT_IDLE_S if v[3] else UNREAD_IDLE_S)]:
            _drop(self._open.pop(export_id))

    def close_all(self) -> None:
        """Drop every export (the runtime closes)."""
        with self._lock:
            entries, self._open = list(self._open.values()), {}
        for entry in entries:
            _drop(entry)


def _drop(entry: list) -> None:
    """Free an export's bytes: close a local file and remove it."""
    if isinstance(entry[1], LocalFile):
        entry[1].close()
    _unlink(entry[0].local_path)


class LocalFile:
    """
    A local export's bytes, read from its file by offset (data[a:b], len(data)).

    Not a map of the file: any process of this user can truncate it, and reading a mapped
    page past the new end kills the reader (SIGBUS). A read that comes back short instead
    says that the file changed, and only that export fails.
    """

    def __init__(self, name: str, fd: int, size: int):
        self.name, self._fd, self._size = name, fd, size

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, where: slice) -> bytes:
        start, stop, _ = where.indices(self._size)
        want = max(0, stop - start)
        try:
            data = os.pread(self._fd, want, start) if want else b''
        except (OSError, ValueError) as exc:  # closed meanwhile, or an I/O error
            raise InvalidRequestError(f'export file {self.name} cannot be read ({exc}); '
                                      'ask for the manifest again') from exc
        if len(data) != want:
            raise InvalidRequestError(
                f'export file {self.name} was changed by another process (read {len(data)} '
                f'of {want} bytes at offset {start}); ask for the manifest again')
        return data

    def close(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass


def _write_local(export_id: str, cap: Capsule, key: bytes | None) -> LocalFile | None:
    """
    Write an export to LOCAL_DIR, readable by this user only; None where that fails.

    The capsule's header and blob go straight into the file (seals an unsealed capsule).
    Returns the file, which also serves the export's chunks.
    """
    path = LOCAL_DIR / f'{LOCAL_PREFIX}{os.getpid()}-{export_id}'
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError:
        return None  # no shared memory here: the receiver reads the chunks
    try:
        head, blob = disk.file_parts(cap, key)
        size = 0
        with os.fdopen(fd, 'r+b', buffering=0, closefd=False) as f:
            for part in (memoryview(head), memoryview(blob.numpy()).cast('B')):
                done = 0
                while done < len(part):
                    done += f.write(part[done:])
                size += len(part)
        return LocalFile(str(path), fd, size)
    except (OSError, ValueError):
        os.close(fd)
        _unlink(str(path))
        return None


def _unlink(path: str) -> None:
    if path:
        try:
            os.unlink(path)
        except OSError:
            pass


def _sweep_local() -> None:
    """Remove this user's local exports whose process is gone (killed before closing)."""
    try:
        names = [p for p in LOCAL_DIR.iterdir() if p.name.startswith(LOCAL_PREFIX)]
    except OSError:
        return
    for path in names:
        pid = path.name[len(LOCAL_PREFIX):].split('-', 1)[0]
        try:
            if path.lstat().st_uid != os.getuid() or not pid.isdigit():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            _unlink(str(path))
        except OSError:  # alive under another user, or gone meanwhile
            continue


def manifest_header(cap: Capsule) -> str:
    """
    Return the capsule header a manifest carries: what a receiver checks compatibility with.

    Not its metadata (`meta`: a conversation's messages, the system prompt): a peer that asks
    for a manifest learns the model, layout, position and size, not what was said. The
    checksum, which covers the metadata, still ties the bytes to the manifest.
    """
    head = disk.header(cap)
    head.pop('meta', None)
    return json.dumps(head, sort_keys=True)


def check_manifest(manifest: Manifest, fingerprint: str, arena_manifest,
                   arena_nbytes: int) -> None:
    """Refuse a capsule of another model or layout, or a malformed manifest, before any bytes."""
    try:
        head = manifest.header
    except (TypeError, ValueError) as exc:
        raise CorruptCapsuleError(f'the manifest of {manifest.name!r} has a header that is '
                                  f'not JSON ({exc}); nothing was transferred') from exc
    if not isinstance(head, dict):
        raise CorruptCapsuleError(f'the manifest of {manifest.name!r} has a header that is not '
                                  'a JSON object; nothing was transferred')
    ours = [e.to_json() for e in arena_manifest]
    if head.get('fingerprint') != fingerprint or head.get('manifest') != ours:
        raise FingerprintMismatchError(
            f'capsule {manifest.name!r} was taken from a different model, dtype or '
            f'max_seq_len (capsule {str(head.get("fingerprint"))[:12]}, this node '
            f'{fingerprint[:12]}); nothing was transferred: import it into a node built '
            'with the same model configuration')
    if head.get('format') != disk.FORMAT_VERSION:
        raise FingerprintMismatchError(
            f'capsule {manifest.name!r} comes in capsule format {head.get("format")!r}, this '
            f'release reads {disk.FORMAT_VERSION}; nothing was transferred: run the same '
            'flashrt_ros release on both nodes')
    try:
        state_bytes = manifest.state_bytes
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptCapsuleError(f'the manifest of {manifest.name!r} gives no state size '
                                  f'({exc!r}); nothing was transferred') from exc
    # Bounded by this node's own arena, not only by what the sender says its state is: a
    # sender cannot make the receiver stage more than a capsule of this node can hold.
    if not 0 < manifest.total_bytes <= min(state_bytes, arena_nbytes) + disk.MAX_HEADER:
        raise CorruptCapsuleError(
            f'capsule {manifest.name!r} is announced as {manifest.total_bytes} bytes for '
            f"{state_bytes} bytes of state (this node's arena: {arena_nbytes} bytes); "
            'nothing was transferred')


class Staging:
    """The receiver's buffer of one transfer: chunks in order, then one verified capsule."""

    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        # Not zeroed: every byte is written before it is read (a zeroing pass over a large
        # capsule costs as much as reading it). Dropped with the object on failure.
        self._buffer = huge_page_memory(manifest.total_bytes, zero=False).numpy()
        self._view = memoryview(self._buffer)
        self.received = 0
        # The blob's sha256, fed as bytes arrive (so the check after the last one is short):
        # the blob is everything after the safetensors header, whose length is the first
        # 8 bytes. decode() uses it only if the header says the same.
        self._hash = hashlib.sha256()
        self._hashed = 0  # bytes of the buffer up to which the hash was fed (or skipped)

    def _blob_bytes(self, end: int) -> memoryview | None:
        """Return the received blob bytes not yet hashed, up to `end` (None: none yet)."""
        if self._hashed == 0:
            if end < 8:
                return None
            self._hashed = 8 + int.from_bytes(self._view[:8], 'little')
        if end <= self._hashed:
            return None
        part, self._hashed = self._view[self._hashed:end], end
        return part

    @property
    def complete(self) -> bool:
        return self.received == self.manifest.total_bytes

    def read_local(self, path: str, progress=None) -> str | None:
        """
        Read the whole export from its local file; None, or why not (then read the chunks).

        Only a regular file of this user under LOCAL_DIR, of the announced size, is read;
        what it holds is checked by capsule() like any chunk. progress(bytes) runs per read.
        """
        total = self.manifest.total_bytes
        where = Path(path)
        if where.parent != LOCAL_DIR or not where.name.startswith(LOCAL_PREFIX):
            return f'{path!r} is not a local export path'
        try:  # O_NONBLOCK: a FIFO planted under the name must not hang the open
            fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            return f'cannot open {path}: {exc.strerror}'
        hashing = None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                return f'{path} is not a file of this user'
            if st.st_size != total:
                return f'{path} holds {st.st_size} bytes, not {total}'
            view = self._view
            while self.received < total:
                end = min(total, self.received + LOCAL_READ_BYTES)
                n = os.preadv(fd, [view[self.received:end]], self.received)
                if n <= 0:
                    return f'{path} ended early'
                self.received += n
                part = self._blob_bytes(self.received)
                if part is not None:  # hashed on another core while the next part is read
                    if hashing is not None:
                        hashing.join()
                    hashing = threading.Thread(target=self._hash.update, args=(part,))
                    hashing.start()
                if progress is not None:
                    progress(self.received)
        except OSError as exc:
            return f'cannot read {path}: {exc.strerror}'
        finally:
            os.close(fd)
            if hashing is not None:
                hashing.join()
            if self.received != total:  # read the chunks from the start instead
                self.received, self._hashed, self._hash = 0, 0, hashlib.sha256()
        return None

    def add(self, offset: int, data) -> None:
        """Append the chunk that starts at `offset` (chunks arrive in order)."""
        end = offset + len(data)
        if offset != self.received or not data or end > self.manifest.total_bytes:
            raise CorruptCapsuleError(
                f'chunk of {len(data)} bytes at offset {offset} does not continue the '
                f'{self.received} bytes received of {self.manifest.total_bytes}; nothing was '
                'stored: transfer the capsule again')
        self._view[offset:end] = memoryview(data).cast('B')
        self.received = end
        part = self._blob_bytes(end)
        if part is not None:
            self._hash.update(part)

    def capsule(self, name: str, key: bytes | None, origin: Origin) -> Capsule:
        """Decode and verify the complete buffer; return the capsule as `name` (not stored)."""
        m = self.manifest
        if not self.complete:
            raise CorruptCapsuleError(
                f'capsule {m.name!r}: {self.received} of {m.total_bytes} bytes arrived; '
                'nothing was stored: transfer it again')
        # the checksum (and MAC) are checked here
        cap = disk.decode(name, self._buffer, key, self._hash)
        if cap.checksum != m.checksum or manifest_header(cap) != m.header_json:
            raise CorruptCapsuleError(
                f'the bytes received for capsule {m.name!r} are not the capsule its manifest '
                'announced (another checksum or header); nothing was stored: transfer it again')
        self._buffer = self._view = None  # the capsule's blob is a view of it now: no writes
        cap.origin = origin
        cap.checksum = ''  # the header now names its origin: sealed again when needed
        return cap
