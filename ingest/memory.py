"""Memory in the pipeline's actor processes: Arrow's pool (``DataConfig.arrow_memory_pool``), glibc's heap, and
reused block buffers.

Every Parquet read and every Arrow-built column of a stage allocates from Arrow's default pool. Arrow's Linux wheels
default to mimalloc, which takes fresh memory as transparent huge pages whose first touches cost more than it saves
here; the system allocator (glibc malloc, set here to keep freed heap for the next block) is the default. The
block-sized outputs (a block's decoded pixels, its patches) go into ``ReusedBuffers``. Measurements: docs/design.md.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import numpy as np
import pyarrow as pa

_POOLS = {"system": pa.system_memory_pool, "mimalloc": pa.mimalloc_memory_pool, "jemalloc": pa.jemalloc_memory_pool}
ARROW_MEMORY_POOLS = (*_POOLS, "default")
DEFAULT_ARROW_MEMORY_POOL = "system"


def use_arrow_memory_pool(name: str = DEFAULT_ARROW_MEMORY_POOL) -> None:
    """Make ``name`` (``system``, ``mimalloc``, ``jemalloc``) Arrow's default memory pool in this process;
    ``default`` leaves Arrow's choice. Buffers allocated before keep their own pool. ``system`` also has glibc keep
    freed memory for the next block (``keep_freed_heap``). Called by the pipeline's actors, in their own processes."""
    if name != "default":
        pa.set_memory_pool(_POOLS[name]())
    if name == "system":
        keep_freed_heap()


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def _glibc_function(name: str):
    """A function of the C library this process runs on, where that is glibc; None elsewhere."""
    import ctypes

    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


def keep_freed_heap(trim_bytes: int = 512 << 20) -> bool:
    """glibc malloc in this process: allocations up to 32 MB (its largest mmap threshold) from the heap, and up to
    ``trim_bytes`` of freed heap kept rather than returned to the kernel. By default glibc returns the top of the heap
    once more than twice its (adaptive) mmap threshold is free: a stage that frees a block's decoded images after
    packing them then touches fresh pages again for the next block, and first touches are dear (docs/design.md).
    False where the C library is not glibc (nothing changed)."""
    mallopt = _glibc_function("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_bytes))


def return_freed_heap() -> bool:
    """Give the free pages of glibc's heap back to the kernel now (``malloc_trim``): for a process that has just
    dropped something large it will not rebuild, made of allocations too small for glibc to unmap on free (a
    tokenizer's vocabulary). False where the C library is not glibc."""
    malloc_trim = _glibc_function("malloc_trim")
    return malloc_trim is not None and bool(malloc_trim(0))


# references to a free kept buffer during ``ReusedBuffers.take``'s check: the list's and ``getrefcount``'s argument
_POOL_REFS = 2


class ReusedBuffers:
    """Large output buffers of a stage, each reused once the block that held it has left this process.

    A stage's block-sized outputs (a block's decoded pixels, its uint8 patches) are above glibc's largest mmap threshold
    (32 MB), so each fresh one is mapped and, once freed, unmapped: every block touches new pages, and a first touch
    costs many times the write itself (docs/design.md). Here a buffer comes back when nothing else refers to it any more
    (Ray has copied the block into the object store and dropped it): Arrow's wrapper (``pa.py_buffer``) and numpy or
    torch views all hold a reference to the array this hands out, so a held buffer is never handed out again."""

    def __init__(self, keep: int = 2, slack: float = 1.25, allocate: Callable[[int], np.ndarray] | None = None):
        self._buffers: list[np.ndarray] = []
        self._keep, self._slack = keep, slack
        self._allocate = allocate or _pageable
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A writable 1-D uint8 array of ``nbytes``: a free kept buffer, else a new one (kept when there is room)."""
        with self._lock:
            free = [k for k in range(len(self._buffers)) if sys.getrefcount(self._buffers[k]) <= _POOL_REFS]
            fits = [k for k in free if self._buffers[k].size >= nbytes]
            if fits:  # the smallest that fits: a pool of many sizes (per-row values) keeps large ones for large rows
                return self._buffers[min(fits, key=lambda k: self._buffers[k].size)][:nbytes]
            new = self._allocate(int(nbytes * self._slack))
            if free:  # a free one too small: replace it
                self._buffers[free[0]] = new
            elif len(self._buffers) < self._keep:
                self._buffers.append(new)
            return new[:nbytes]


def _pageable(nbytes: int) -> np.ndarray:
    """A 1-D uint8 array of ``nbytes`` on its own private anonymous mapping, in small pages. numpy advises
    transparent huge pages for every array of 4 MB or more, and a first touch of a huge page has the kernel find
    (often compact) 2 MB of contiguous memory. Huge pages pay off for memory faulted again and again; these buffers
    are faulted once per process, then reused (docs/design.md has the measurements)."""
    import mmap

    if nbytes == 0 or not hasattr(mmap, "MAP_PRIVATE"):  # nothing to map; Windows: no such mapping flags
        return np.empty(nbytes, dtype=np.uint8)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # private: anonymous memory, not shmem
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux; elsewhere the mapping keeps the system's default
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(mapping, dtype=np.uint8)


def pinned_or_pageable(nbytes: int) -> np.ndarray:
    """A 1-D uint8 array of ``nbytes`` in page-locked (pinned) host memory where CUDA is there, else ordinary memory.
    A device-to-host copy into pinned memory is one DMA at the link's speed; into pageable memory the driver stages
    it through its own pinned buffer and a CPU copy, which dominated the GPU profiles (docs/design.md). The array keeps
    the pinned tensor (and so its memory) alive."""
    import torch

    if torch.cuda.is_available():
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
        except RuntimeError:  # pinning refused (locked-memory limit): the copy still works, staged by the driver
            pass
    return _pageable(nbytes)
