"""``cpu_memory``: the CPU KV cache on transparent huge pages.

``huge_page_zeros`` must hand back a zeroed, contiguous tensor on a 2 MiB boundary whose
memory the kernel marks eligible for huge pages (the ``THPeligible`` flag of its mapping
in /proc/self/smaps: deterministic, unlike whether a huge page was free at the fault);
``allocate_kv_caches`` must give each layer its own contiguous K and V inside one such
pool, not overlapping. ``HugePageArena`` (the packed linear weights) must hand back equal,
contiguous copies, cache-line aligned and not overlapping, in 2 MiB-aligned chunks the
kernel marks eligible for huge pages.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from services.worker.cpu_memory import HUGE_PAGE_BYTES, HugePageArena, huge_page_zeros

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_enabled() -> bool:
    try:
        mode = THP_MODE.read_text()
    except OSError:
        return False
    return "[never]" not in mode


def _mapping_fields(address: int) -> dict[str, str]:
    """The smaps fields of the mapping holding ``address``."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            start, end = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = start <= address < end
        elif inside and ":" in head:
            fields[head.rstrip(":")] = line.split(":", 1)[1].strip()
    return fields


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_huge_page_zeros_is_aligned_zeroed_and_contiguous(dtype: torch.dtype) -> None:
    t = huge_page_zeros((3, 5, 1000, 7), dtype)
    assert t.shape == (3, 5, 1000, 7) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not t.any()


@pytest.mark.skipif(not _thp_enabled(), reason="transparent huge pages are off here")
def test_huge_page_zeros_asks_for_huge_pages() -> None:
    t = huge_page_zeros((3 * HUGE_PAGE_BYTES // 4,), torch.float32)  # 3 whole huge pages
    fields = _mapping_fields(t.data_ptr())
    if "THPeligible" not in fields:
        pytest.skip("this kernel's smaps has no THPeligible field")
    assert fields["THPeligible"] == "1"


def test_arena_copies_are_equal_aligned_and_apart() -> None:
    arena = HugePageArena(chunk_bytes=HUGE_PAGE_BYTES)
    g = torch.Generator().manual_seed(0)
    sources = [torch.randn(37, 11, generator=g).to(torch.bfloat16),  # 814 bytes: unaligned end
               torch.randn(5, 3, generator=g),
               torch.randn(HUGE_PAGE_BYTES // 4 + 5, generator=g),  # beyond a chunk: its own
               torch.randn(100, 7, generator=g).t(),  # not contiguous: copied contiguous
               torch.randint(0, 255, (3,), dtype=torch.uint8, generator=g)]
    placed = [arena.place(t) for t in sources]
    spans = []
    for src, out in zip(sources, placed, strict=True):
        assert torch.equal(out, src) and out.dtype == src.dtype and out.is_contiguous()
        assert out.data_ptr() % 64 == 0 and arena.holds(out) and not arena.holds(src)
        spans.append((out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    # the first starts a chunk and the second follows it at the next cache line (814
    # bytes -> 832); the one larger than a chunk starts a chunk of its own
    assert placed[0].data_ptr() % HUGE_PAGE_BYTES == 0
    assert placed[1].data_ptr() - placed[0].data_ptr() == 832
    assert placed[2].data_ptr() % HUGE_PAGE_BYTES == 0
    placed[1].fill_(0)  # a copy: the source keeps its values
    assert sources[1].count_nonzero() == sources[1].numel()


@pytest.mark.skipif(not _thp_enabled(), reason="transparent huge pages are off here")
def test_arena_chunks_ask_for_huge_pages() -> None:
    arena = HugePageArena(chunk_bytes=3 * HUGE_PAGE_BYTES)
    out = arena.place(torch.ones(1000))
    assert arena.advised_bytes == 3 * HUGE_PAGE_BYTES
    fields = _mapping_fields(out.data_ptr())
    if "THPeligible" not in fields:
        pytest.skip("this kernel's smaps has no THPeligible field")
    assert fields["THPeligible"] == "1"


def test_kv_caches_on_the_cpu_are_one_pool_of_separate_layers(tiny_llama_dir: Path) -> None:
    from services.worker.loader import load_model
    from services.worker.model_runner import allocate_kv_caches

    model = load_model(tiny_llama_dir)
    caches = allocate_kv_caches(model, num_blocks=6, block_size=4, dtype=torch.bfloat16,
                                device="cpu")
    cfg = model.config
    assert len(caches) == cfg.num_hidden_layers
    shape = (6, 4, model.shard.num_kv_heads, cfg.head_dim)
    spans = []
    for k, v in caches:
        for t in (k, v):
            assert t.shape == shape and t.is_contiguous() and t.dtype == torch.bfloat16
            assert not t.any()
            spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    caches[0][1].fill_(1)  # one layer's V: no other tensor sees it
    assert sum(int(t.count_nonzero()) for kv in caches for t in kv) == caches[0][1].numel()
