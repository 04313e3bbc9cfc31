"""Allocator settings for the CPU worker: keep big temporaries out of fresh mmap pages.

A CPU decode step allocates and frees the same large temporaries in every layer (the
gathered K/V blocks, activations of a big batch). glibc serves blocks above its mmap
threshold with fresh ``mmap`` pages and gives them back on free, so every layer paid
one page fault per 4 KiB again: at batch 32 and context 512 the K/V gathers ran at
~2.5 GB/s instead of memory speed, and a whole decode step took twice as long.
Raising the mmap threshold to glibc's maximum (32 MiB on 64-bit) and the trim
threshold keeps those blocks in the heap, where freed memory is reused. Called once
by the runner builder when the device is the CPU; a no-op where glibc is absent.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc's largest allowed value on 64-bit
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024


def keep_large_allocations_in_heap() -> bool:
    """Apply the settings; True when glibc took both."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and ok
    if not ok:
        log.warning("mallopt refused the CPU allocator settings; decode steps may be slower")
    return ok
