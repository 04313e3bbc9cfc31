"""CPU worker memory: allocator settings, and the KV cache on transparent huge pages.

A CPU decode step allocates and frees the same large temporaries in every layer (the
gathered K/V blocks, activations of a big batch). glibc serves blocks above its mmap
threshold with fresh ``mmap`` pages and gives them back on free, so every layer paid
one page fault per 4 KiB again: at batch 32 and context 512 the K/V gathers ran at
~2.5 GB/s instead of memory speed, and a whole decode step took twice as long.
Raising the mmap threshold to glibc's maximum (32 MiB on 64-bit) and the trim
threshold keeps those blocks in the heap, where freed memory is reused. Called once
by the runner builder when the device is the CPU; a no-op where glibc is absent.

``huge_page_zeros`` allocates the CPU KV cache so the kernel may back it with 2 MiB
transparent huge pages (``madvise(MADV_HUGEPAGE)`` on 2 MiB-aligned memory, before the
first touch), which Linux's default THP mode (``madvise``) grants only on request. A
decode step reads its sequences' blocks scattered over the pool (a long-running server's
free list is shuffled by requests coming and going), a new 4 KiB page every few rows
with small pages; with huge pages the TLB covers the pool, and the decode kernel read
K/V from randomly placed blocks 16-22 % faster (bf16 and fp32, batch 32, context 400,
one A/B process). A fresh pool, whose sequences hold runs of adjacent blocks, showed no
difference beyond noise (a batch-32 step, ``pagoda.bench.step_profile``). Where THP is
off or the call fails, the pool is plain pages, as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math

import torch

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc's largest allowed value on 64-bit
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024
HUGE_PAGE_BYTES = 2 * 1024 * 1024
_MADV_HUGEPAGE = 14  # Linux's value on every architecture


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def keep_large_allocations_in_heap() -> bool:
    """Apply the settings; True when glibc took both."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and ok
    if not ok:
        log.warning("mallopt refused the CPU allocator settings; decode steps may be slower")
    return ok


def advise_huge_pages(address: int, length: int) -> bool:
    """Ask for transparent huge pages on [address, address + length) (both multiples of
    HUGE_PAGE_BYTES); True when the kernel took the advice."""
    madvise = getattr(_libc(), "madvise", None)
    if madvise is None or length <= 0:
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise(address, length, _MADV_HUGEPAGE) == 0


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed, contiguous CPU tensor that starts on a 2 MiB boundary, its whole 2 MiB
    pages advised for transparent huge pages before the zeroing touches them (the last
    partial page stays small; the 2 MiB of slack allocated for the alignment, before the
    start and past the end, is never touched, so it takes no memory)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    region = raw[start:start + nbytes]
    whole_pages = nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if whole_pages and not advise_huge_pages(region.data_ptr(), whole_pages):
        log.debug("madvise(MADV_HUGEPAGE) refused; the KV cache uses small pages")
    out = region.view(dtype).view(shape)
    out.zero_()
    return out
