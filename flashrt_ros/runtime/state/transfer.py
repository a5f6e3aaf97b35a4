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
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import threading
import time

from . import disk
from .capsule import Capsule, Origin
from ..errors import CapsuleNotFoundError, CorruptCapsuleError, FingerprintMismatchError
from ..errors import InvalidRequestError

# Fits Fast DDS's default shared-memory segment (512 KiB) between processes on one host;
# with config/fastdds_large_data.xml 1 MiB is faster. docs/transfer.md has the numbers.
DEFAULT_CHUNK_BYTES = 256 << 10
MAX_CHUNK_BYTES = 16 << 20
EXPORT_IDLE_S = 60.0  # an export nobody read from for this long is dropped
MAX_EXPORTS = 8  # open exports per runtime (each holds one encoded capsule in memory)


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What the receiver learns before any bytes move."""

    export_id: str  # names the sender's consistent snapshot of the capsule's bytes
    name: str  # the capsule's name on the sender
    total_bytes: int  # bytes that will travel (the encoded capsule)
    checksum: str  # the capsule's content checksum (sha256 over blob and header)
    header_json: str  # disk.header(): fingerprint, manifest, packing, position, meta

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
        self._open: dict[str, list] = {}  # export_id -> [manifest, data, last_used]
        self._lock = threading.Lock()

    def add(self, cap: Capsule) -> Manifest:
        """Encode `cap` (a capsule with its blob) and return the manifest of its export."""
        with self._lock:
            self._expire()
            full = len(self._open) >= MAX_EXPORTS
        if full:  # checked before the encoding, which is most of an export's cost
            raise InvalidRequestError(
                f'{MAX_EXPORTS} exports are open on this node; wait for one to finish '
                f'(an idle one is dropped after {EXPORT_IDLE_S:.0f} s) and try again')
        data = disk.encode(cap, self.key)  # seals an unsealed capsule
        with self._lock:
            manifest = Manifest(secrets.token_hex(8), cap.name, len(data), cap.checksum,
                                json.dumps(disk.header(cap), sort_keys=True))
            self._open[manifest.export_id] = [manifest, memoryview(data), self._clock()]
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
            entry[2] = self._clock()
        data = entry[1]
        if not (0 <= offset <= len(data)) or not (0 < length <= MAX_CHUNK_BYTES):
            raise InvalidRequestError(
                f'chunk at offset {offset} of length {length} is outside export {export_id!r} '
                f'({len(data)} bytes; a chunk is 1 to {MAX_CHUNK_BYTES} bytes)')
        return data[offset:offset + length]

    def close(self, export_id: str) -> None:
        with self._lock:
            self._open.pop(export_id, None)

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._open)

    def _expire(self) -> None:
        now = self._clock()
        for export_id in [k for k, v in self._open.items() if now - v[2] > EXPORT_IDLE_S]:
            del self._open[export_id]


def check_manifest(manifest: Manifest, fingerprint: str, arena_manifest) -> None:
    """Refuse a capsule of another model or layout before any of its bytes move."""
    head = manifest.header
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
    if not 0 < manifest.total_bytes <= manifest.state_bytes + disk.MAX_HEADER:
        raise CorruptCapsuleError(
            f'capsule {manifest.name!r} is announced as {manifest.total_bytes} bytes for '
            f'{manifest.state_bytes} bytes of state; nothing was transferred')


class Staging:
    """The receiver's buffer of one transfer: chunks in order, then one verified capsule."""

    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self._buffer = bytearray(manifest.total_bytes)  # dropped with the object on failure
        self.received = 0

    @property
    def complete(self) -> bool:
        return self.received == self.manifest.total_bytes

    def add(self, offset: int, data) -> None:
        """Append the chunk that starts at `offset` (chunks arrive in order)."""
        end = offset + len(data)
        if offset != self.received or not data or end > self.manifest.total_bytes:
            raise CorruptCapsuleError(
                f'chunk of {len(data)} bytes at offset {offset} does not continue the '
                f'{self.received} bytes received of {self.manifest.total_bytes}; nothing was '
                'stored: transfer the capsule again')
        self._buffer[offset:end] = data
        self.received = end

    def capsule(self, name: str, key: bytes | None, origin: Origin) -> Capsule:
        """Decode and verify the complete buffer; return the capsule as `name` (not stored)."""
        m = self.manifest
        if not self.complete:
            raise CorruptCapsuleError(
                f'capsule {m.name!r}: {self.received} of {m.total_bytes} bytes arrived; '
                'nothing was stored: transfer it again')
        cap = disk.decode(name, self._buffer, key)  # the checksum (and MAC) are checked here
        if cap.checksum != m.checksum or (
                json.dumps(disk.header(cap), sort_keys=True) != m.header_json):
            raise CorruptCapsuleError(
                f'the bytes received for capsule {m.name!r} are not the capsule its manifest '
                'announced (another checksum or header); nothing was stored: transfer it again')
        self._buffer = None  # the capsule's blob is a view of it now: no further writes
        cap.origin = origin
        cap.checksum = ''  # the header now names its origin: sealed again when needed
        return cap
