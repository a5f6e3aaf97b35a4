"""
Capsules: immutable snapshots of the live state, their names and tiers.

A Capsule is the arena's used prefix as one blob, how it maps onto the arena (packing and
manifest), the model/layout fingerprint and the non-tensor state as JSON. Names are one
namespace across tiers: a name refers to one capsule, so a snapshot under an existing name
replaces that capsule whatever its tier (like overwriting a file). To keep a copy in
another tier, fork it under a new name.
"""

from __future__ import annotations

import json
from pathlib import Path
import re
import time
from typing import Any, Callable, NamedTuple

import torch

from .arena import ManifestEntry, Packing
from ..config import TIERS
from ..errors import CapsuleNotFoundError, FlashRTError, InvalidNameError

MAX_NAME_LEN = 128
# The name a committed boundary on the rollback ring reports: BOUNDARY_NAME.format(position).
# Not a valid capsule name, so it never clashes with a stored one.
BOUNDARY_NAME = '@boundary-{}'
_NAME_RE = re.compile(r'[A-Za-z0-9][A-Za-z0-9_.\-]*')  # whole name: fullmatch


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


def validate_tier(tier: Any) -> str:
    if tier not in TIERS:
        raise FlashRTError(f"tier {tier!r} is not valid; use one of {', '.join(TIERS)}")
    return tier


def not_found(name: str) -> CapsuleNotFoundError:
    return CapsuleNotFoundError(f'capsule {name!r} not found; list_capsules() shows what exists')


class Origin(NamedTuple):
    """Where an imported capsule came from: the node that served it, its name there, when."""

    node: str  # fully qualified name of the source node, e.g. /left_arm/flashrt
    name: str  # the capsule's name on that node
    imported: float  # unix seconds the import completed

    def to_json(self) -> dict:
        return self._asdict()

    @classmethod
    def from_json(cls, data) -> 'Origin | None':
        """Return the Origin a header holds (None for a capsule taken on this node)."""
        if data is None:
            return None
        return cls(str(data['node']), str(data['name']), float(data['imported']))


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
    origin: Origin | None = None  # set for a capsule imported from another node
    # Role of each conversation message the state holds (system, user, assistant, raw);
    # empty outside a conversation (modes/lm/chat.py).
    roles: tuple[str, ...] = ()


class Capsule:
    """An immutable snapshot: blob bytes, how they map onto the arena, and the non-tensor state."""

    # True for a rollback-ring entry a commit captured: its rows are the live arena's, and it
    # leaves the ring when the lineage moves off them (ring.py). Never a stored capsule.
    on_lineage = False
    # A delta boundary (a commit's entry when the state has windows): the window rows it kept,
    # those the step after it overwrote, as (window, first row, their copy in the blob)
    # (arena.pack_delta); its other rows are the live ones (ring.py). None: the whole head.
    window_rows: tuple | None = None

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
        origin: Origin | None = None,
        roles: tuple[str, ...] | None = None,
    ):
        self.name, self.tier, self.blob, self.packing = name, tier, blob, packing
        self.manifest, self.fingerprint, self.position = manifest, fingerprint, position
        self._meta_json, self.components = meta_json, components
        self.created = time.time() if created is None else created
        self.pinned, self.checksum, self.path = pinned, checksum, path
        self.origin = origin
        self.nbytes = int(blob.numel()) if nbytes is None else nbytes
        self.last_used = time.monotonic()
        self.restore_cache: dict = {}  # checked meta, copy views of the blob (its runtime's)
        # The arena epoch the state was taken in (arena.rows_shared); None when unknown, as
        # for a capsule read from disk. In memory only: epochs are per process.
        self.epoch = epoch
        self._roles = roles  # None: read from meta_json when asked (a disk capsule)

    @property
    def meta_json(self) -> str:
        """Return the non-tensor state as JSON (a capture may defer building it to first use)."""
        if callable(self._meta_json):
            self._meta_json = self._meta_json()
        return self._meta_json

    @property
    def roles(self) -> tuple[str, ...]:
        """Return the role of each conversation message the capsule's state holds."""
        if self._roles is None:
            try:
                chat = json.loads(self.meta_json).get('chat', ())
                self._roles = tuple(str(m[0]) for m in chat)
            except (ValueError, TypeError, IndexError, AttributeError):
                self._roles = ()  # unreadable meta: restore says what is wrong
        return self._roles

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
            self.origin,
            self.roles,
        ))

    def with_blob(self, name: str, tier: str, blob: torch.Tensor | None,
                  **changes) -> 'Capsule':
        """Copy this capsule's identity around another blob (fork, tier moves, a disk file)."""
        fields = {'name': name, 'tier': tier, 'blob': blob, 'packing': self.packing,
                  'manifest': self.manifest, 'fingerprint': self.fingerprint,
                  'position': self.position, 'meta_json': self._meta_json,
                  'components': self.components, 'created': time.time(),
                  'epoch': self.epoch, 'origin': self.origin,
                  'roles': self._roles}  # the same state bytes
        fields.update(changes)
        return Capsule(**fields)
