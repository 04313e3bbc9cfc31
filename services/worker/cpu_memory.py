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

``HugePageArena`` does the same for the packed linear weights (``pack_cpu_linears``):
they are copied back to back into 2 MiB-aligned chunks advised for huge pages, one
weight at a time as it is packed. A batch-1 step streams all of them (270 MB in bf16)
once: on 4 KiB pages each of a tile's weight streams meets a new page, a TLB miss and a
restart of the hardware prefetcher every 4 KiB. One A/B process on a Zen 3 (AVX2),
SmolLM2's four layer shapes, weights from DRAM: bf16 at 1 row 1.08-1.09x on huge pages,
fp32 at 1 row 1.00-1.08x; at 64 rows (compute-bound) 0.98-1.08x, level within noise.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap
from dataclasses import dataclass, field

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


def huge_page_region(nbytes: int) -> tuple[torch.Tensor, bool]:
    """``nbytes`` of fresh, untouched memory (a uint8 tensor) that starts on a 2 MiB
    boundary, its whole 2 MiB pages advised for transparent huge pages, and whether the
    kernel took the advice. Mapped anonymously here, not through malloc: glibc serves even
    a large request from free heap memory it kept (``keep_large_allocations_in_heap``),
    whose pages are already faulted in small and stay so. The 2 MiB of slack mapped for
    the alignment is never touched, so it takes no memory."""
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES,  # private: shared memory gets no THP
                    flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # keeps the mapping alive
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    region = raw[start:start + nbytes]
    whole_pages = nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    return region, bool(whole_pages) and advise_huge_pages(region.data_ptr(), whole_pages)


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed, contiguous CPU tensor on a ``huge_page_region`` (the last partial 2 MiB
    page stays small), its memory touched now: the pool is taken at start, not page by
    page in the steps that first write it."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    region, advised = huge_page_region(nbytes)
    if nbytes >= HUGE_PAGE_BYTES and not advised:
        log.debug("madvise(MADV_HUGEPAGE) refused; the KV cache uses small pages")
    out = region.view(dtype).view(shape)
    out.zero_()
    return out


ARENA_CHUNK_BYTES = 64 * 1024 * 1024
_ARENA_ALIGN_BYTES = 64  # a cache line, as torch's own CPU allocations start


@dataclass
class HugePageArena:
    """Copies of tensors, placed back to back in chunks that start on 2 MiB boundaries
    with their whole 2 MiB pages advised for transparent huge pages before the copy
    touches them (``huge_page_zeros``' rule; the untouched tail of the last chunk takes
    no memory). A tensor larger than ``chunk_bytes`` gets a chunk of its own."""

    chunk_bytes: int = ARENA_CHUNK_BYTES
    advised_bytes: int = 0  # of the chunks, the bytes the kernel took the advice on
    _chunks: list[torch.Tensor] = field(default_factory=list)
    _used: int = 0  # bytes of the last chunk taken

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of the CPU tensor ``tensor`` in the arena."""
        nbytes = tensor.numel() * tensor.element_size()
        start = -(-self._used // _ARENA_ALIGN_BYTES) * _ARENA_ALIGN_BYTES
        if not self._chunks or start + nbytes > self._chunks[-1].numel():
            self._chunks.append(self._new_chunk(max(nbytes, self.chunk_bytes)))
            start = 0
        self._used = start + nbytes
        out = self._chunks[-1][start:start + nbytes].view(tensor.dtype).view(tensor.shape)
        out.copy_(tensor)
        return out

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory lies in one of the arena's chunks."""
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        return any(c.data_ptr() <= start and end <= c.data_ptr() + c.numel()
                   for c in self._chunks)

    def _new_chunk(self, nbytes: int) -> torch.Tensor:
        chunk, advised = huge_page_region(-(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES)
        if advised:
            self.advised_bytes += chunk.numel()
        else:
            log.debug("madvise(MADV_HUGEPAGE) refused; packed weights use small pages")
        return chunk
