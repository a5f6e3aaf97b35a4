"""
The disk tier's format: one safetensors file per capsule in capsule_dir.

A file holds the blob as a uint8 tensor and, as metadata, the header (format version,
manifest, packing, meta, fingerprint, ...) and a sha256 checksum over the blob bytes and
the header. It is written atomically (temp file, fsync, rename, fsync dir), so any process
with the same model finds it by name, and it is always checked against its checksum when
read whole.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
import tempfile
import time

import torch

from .arena import ManifestEntry, Packing
from .capsule import Capsule, validate_name
from ..errors import CorruptCapsuleError, FlashRTError, InvalidNameError

FORMAT_VERSION = 2  # 2: arena prefix blobs (row-block layout)
SUFFIX = '.safetensors'
STALE_TEMP_S = 3600.0  # a write's temp file older than this was left by a killed process


def path_of(directory: Path, name: str) -> Path:
    return directory / (name + SUFFIX)


def header(cap: Capsule) -> dict:
    """Everything but the blob and the checksum; what the checksum covers besides the bytes."""
    return {
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


def checksum(blob: torch.Tensor, header_json: str) -> str:
    h = hashlib.sha256()
    data = blob if blob.device.type == 'cpu' else blob.cpu()
    h.update(memoryview(data.contiguous().numpy()))
    h.update(header_json.encode())
    return h.hexdigest()


def capsule_checksum(cap: Capsule) -> str:
    return checksum(cap.blob, json.dumps(header(cap), sort_keys=True))


def list_files(directory: Path) -> list[tuple[str, int, float]]:
    """(name, bytes, mtime) of every capsule file in `directory` with a valid name."""
    if not directory.is_dir():
        return []
    out = []
    for entry in os.scandir(directory):
        if entry.name.endswith(SUFFIX) and not entry.name.startswith('.'):
            name = entry.name[: -len(SUFFIX)]
            try:
                validate_name(name)
                st = entry.stat()
            except (InvalidNameError, OSError):
                continue
            out.append((name, st.st_size, st.st_mtime))
    return out


def sweep_stale_temps(directory: Path) -> None:
    """Remove temp files of disk writes that a killed process left behind."""
    try:
        entries = list(os.scandir(directory))
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


def encode(cap: Capsule) -> bytes:
    """Return the file's bytes; seals the capsule (sets its checksum) if it was not yet."""
    from safetensors.torch import save

    blob = cap.blob if cap.blob.device.type == 'cpu' else cap.blob.cpu()
    header_json = json.dumps(header(cap), sort_keys=True)
    cap.checksum = cap.checksum or checksum(blob, header_json)
    return save({'blob': blob}, metadata={'flashrt': header_json, 'checksum': cap.checksum})


def write(directory: Path, name: str, data: bytes) -> Path:
    """Write `data` as capsule `name`'s file atomically (the directory's fsync: sync_dir)."""
    path, tmp = path_of(directory, name), None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f'.{name}.', suffix='.tmp', dir=directory)
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
                f'capsule {name!r} could not be written to {str(path)!r} ({exc}); '
                'nothing was replaced or evicted: free space or fix capsule_dir, or '
                'snapshot to another tier'
            ) from exc
        raise
    return path


def sync_dir(directory: Path) -> None:
    """Make the renames in `directory` durable."""
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def remove(directory: Path, name: str) -> bool:
    """Delete capsule `name`'s file; return whether there was one."""
    path = os.path.join(directory, name + SUFFIX)
    try:  # every memory snapshot comes here: one syscall, no Path object
        os.unlink(path)
        return True
    except OSError:
        if os.path.isfile(path):  # there, and it cannot be removed: nothing was changed
            raise
        return False  # no such file (or no capsule directory at all)


def read(name: str, path: Path, header_only: bool = False) -> Capsule:
    """Read a capsule file; header_only leaves the blob out (and unverified)."""
    from safetensors import safe_open

    try:
        size = path.stat().st_size
        with safe_open(str(path), framework='pt', device='cpu') as f:
            meta = f.metadata() or {}
            header_json, stored = meta['flashrt'], meta['checksum']
            head = json.loads(header_json)
            blob = None if header_only else f.get_tensor('blob')
        if head.get('format') != FORMAT_VERSION:
            raise ValueError(f"capsule format {head.get('format')!r}, this version reads "
                             f'{FORMAT_VERSION}: written by another flashrt_ros release')
        cap = Capsule(
            name=name,
            tier='disk',
            blob=blob,
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
        if checksum(blob, json.dumps(head, sort_keys=True)) != stored:
            raise CorruptCapsuleError(
                f'capsule {name!r} failed its checksum (the file was modified or '
                'damaged); delete it and take a new snapshot'
            )
    return cap
