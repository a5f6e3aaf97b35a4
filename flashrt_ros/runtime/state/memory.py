"""
Memory for capsule blobs: device, pinned or pageable host memory, and a pool for CPU runtimes.

  device  a blob on the arena's device: restore is one device-local copy (the fast path).
          Allocations come from torch's caching allocator, which recycles freed capsule
          blocks of the same size, so repeated snapshots do not hit cudaMalloc.
  host    host memory, pinned on CUDA, so the copy back is a DMA transfer.
  disk    a disk blob is staged in pageable host memory (it is written once).
On a CPU runtime all of them are plain RAM, and BlobPool hands the memory of dropped blobs
out again instead of page-faulting fresh memory in.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import threading
import weakref

import torch

HUGE_PAGE = 2 << 20  # bytes of a transparent huge page on x86-64 and arm64 (4 KiB base)
_MADV_HUGEPAGE = 14  # Linux


def huge_page_memory(nbytes: int, zero: bool = True) -> torch.Tensor:
    """
    Return nbytes of host memory (zeroed unless zero=False) Linux may back with 2 MiB pages.

    Streaming a large buffer (the weights in a decode step, the arena's rows in attention,
    a whole-state copy) through 4 KiB pages misses the TLB every 4 KiB; advised before its
    first touch, the buffer gets transparent huge pages where the kernel allows them
    (THP "madvise" or "always"). Elsewhere it is plain memory.
    """
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    buf = raw[start:start + nbytes]
    if nbytes >= HUGE_PAGE and _madvise() is not None:
        _madvise()(buf.data_ptr(), nbytes - nbytes % HUGE_PAGE, _MADV_HUGEPAGE)
    return buf.zero_() if zero else buf


@functools.cache
def _madvise():
    """Return libc's madvise (looked up once), or None where there is none."""
    try:
        madvise = ctypes.CDLL(None).madvise
    except (AttributeError, OSError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


class BlobPool:
    """
    Host memory of dropped capsule blobs, handed out again to new ones (CPU runtimes).

    A fresh multi-megabyte host allocation is page-faulted in on its first write, which
    costs many times the copy that fills it. take(nbytes) returns a uint8 tensor of exactly
    nbytes, cut from an idle buffer when one fits (at most 1/8 larger), else from a new
    buffer with 1/16 room to grow (the next turn's capsule is a little larger). When no
    capsule holds the tensor any more, its buffer becomes idle again; idle buffers beyond
    `idle_limit` bytes go back to the allocator, oldest first. On CUDA the caching
    allocators already do this, so the runtime uses a pool on CPU only. A buffer is reused
    only when no other tensor shares its memory; a caller that keeps a capsule blob's
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
