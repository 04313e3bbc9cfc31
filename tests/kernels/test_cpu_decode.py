"""The C++ CPU paged decode kernel (kernels.cpu_decode) against the torch reference.

Caches are NaN outside the slots a sequence owns (kernel_cases.paged_cache), so a read
past a sequence's end shows as NaN; the reference gets the same cache with the NaN
zeroed, as its padded gather would otherwise propagate them. Cases: fp32 and bf16,
head_dim 32/64/128 (and 40, 256), block sizes 16/32, GQA groups 1/3/4, lengths 1, on
and off block boundaries, shuffled block tables, int32/int64 indices, batch 1 and 17,
split-K partitions (forced and heuristic, some empty), an fp32 query over bf16 caches
(an fp32 model's bf16 KV cache), sliding windows (inside a block,
across blocks, longer than short sequences) and attention soft caps, the AVX2 build
(built on AVX-512 machines too) and the portable build (slow: a compile each).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernel_cases import assert_close, block_tables_for, cpu_flags, cpu_vendor, paged_cache
from kernels import cpu_decode, reference
from kernels.cpu_extension import LazyExtension

if not cpu_decode.available():
    pytest.skip("the cpu_decode extension did not build", allow_module_level=True)


def _inputs(
    seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype, index_dtype: torch.dtype = torch.int32, seed: int = 0,
    cache_dtype: torch.dtype | None = None,  # None: dtype
) -> tuple[torch.Tensor, ...]:  # query, k, v, tables, lens
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    tables = block_tables_for(seq_lens, block_size, num_blocks, gen)
    k, v = paged_cache(seq_lens, tables, num_blocks, block_size, num_kv_heads, head_dim,
                       cache_dtype or dtype, gen)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype)
    return query, k, v, tables.to(index_dtype), torch.tensor(seq_lens, dtype=index_dtype)


def _reference(
    query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
    window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:  # fp32 [batch, heads, head_dim]
    k, v = k.float().nan_to_num(0.0), v.float().nan_to_num(0.0)
    max_len, scale = int(lens.max()), query.shape[-1] ** -0.5
    return reference.paged_decode_attention(query.float(), k, v, tables, lens, max_len, scale,
                                            window=window, softcap=softcap)


def _check(
    seq_lens: list[int], *shape: int, dtype: torch.dtype,
    index_dtype: torch.dtype = torch.int32, partition_size: int | None = None,
    window: int | None = None, softcap: float | None = None,
    cache_dtype: torch.dtype | None = None,
) -> None:
    query, k, v, tables, lens = _inputs(seq_lens, *shape, dtype, index_dtype,
                                        cache_dtype=cache_dtype)
    scale = query.shape[-1] ** -0.5
    out = cpu_decode.paged_decode_attention(
        query, k, v, tables, lens, scale, partition_size=partition_size, window=window,
        softcap=softcap,
    )
    assert out.dtype == dtype and out.shape == query.shape
    what = (f"lens={seq_lens} heads/kv/D/bs={shape} {index_dtype} partition={partition_size} "
            f"window={window} softcap={softcap} cache={cache_dtype}")
    assert_close(out, _reference(query, k, v, tables, lens, window, softcap), dtype, what)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 2)])
def test_matches_reference(
    dtype: torch.dtype, head_dim: int, block_size: int, num_heads: int, num_kv_heads: int
) -> None:
    # length 1, one short of a block, exactly one and two blocks, one past, ragged
    lens = [1, block_size - 1, block_size, block_size + 1, 2 * block_size, 3 * block_size - 5]
    _check(lens, num_heads, num_kv_heads, head_dim, block_size, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_batch_17_ragged(dtype: torch.dtype, index_dtype: torch.dtype) -> None:
    lens = torch.randint(1, 300, (17,), generator=torch.Generator().manual_seed(3)).tolist()
    _check(lens, 9, 3, 64, 16, dtype=dtype, index_dtype=index_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# masked last chunks (bf16 on AVX512-BF16: 32 wide, split into even and odd lanes); the
# largest
@pytest.mark.parametrize("head_dim", [24, 40, 80, 96, 256])
def test_other_head_dims(head_dim: int, dtype: torch.dtype) -> None:
    _check([5, 33, 70], 8, 2, head_dim, 16, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partition_size", [None, 16, 48, 200])
def test_partitions(dtype: torch.dtype, partition_size: int | None) -> None:
    # batch 1 with a long context splits under the heuristic; the short sequences leave
    # trailing partitions empty; 200 is rounded up to a multiple of the block size
    _check([1000], 9, 3, 64, 16, dtype=dtype, partition_size=partition_size)
    _check([1, 17, 700, 31], 9, 3, 64, 16, dtype=dtype, partition_size=partition_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partition_size", [None, 16])
@pytest.mark.parametrize("window,softcap", [(1, None), (5, None), (48, None), (None, 0.8),
                                            (20, 2.0)])
def test_window_and_softcap(dtype: torch.dtype, partition_size: int | None, window: int | None,
                            softcap: float | None) -> None:
    # a window starting mid-block, on a boundary, or before the sequence; a partition of
    # 16 splits the longer windows, and the heuristic splits the 1000-token context
    lens = [1, 5, 16, 17, 40, 300, 1000]
    _check(lens, 9, 3, 64, 16, dtype=dtype, partition_size=partition_size, window=window,
           softcap=softcap)


@pytest.mark.parametrize("head_dim", [40, 64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3)])
@pytest.mark.parametrize("partition_size", [None, 16])
def test_fp32_query_over_bf16_caches(head_dim: int, num_heads: int, num_kv_heads: int,
                                     partition_size: int | None) -> None:
    """An fp32 model's bf16 KV cache: the query stays fp32 (so do out and every sum), the
    cache's values are what it reads; fp32 tolerances against the reference on the same
    bf16 K/V widened."""
    lens = [1, 16, 17, 100, 333]
    _check(lens, num_heads, num_kv_heads, head_dim, 16, dtype=torch.float32,
           cache_dtype=torch.bfloat16, partition_size=partition_size)
    _check(lens, num_heads, num_kv_heads, head_dim, 16, dtype=torch.float32,
           cache_dtype=torch.bfloat16, partition_size=partition_size, window=21, softcap=1.5)


def test_window_reads_only_its_blocks() -> None:
    # block ids before the window are never read: out of range there is no error
    query, k, v, tables, lens = _inputs([40], 4, 2, 32, 16, torch.float32)
    tables[0, 0] = k.shape[0]  # positions 0..15; the window of 20 starts at 20
    out = cpu_decode.paged_decode_attention(query, k, v, tables, lens, 0.2, window=20)
    assert not out.isnan().any()
    with pytest.raises(ValueError, match="block_tables"):
        cpu_decode.paged_decode_attention(query, k, v, tables, lens, 0.2, window=30)
    for bad in ({"window": 0}, {"softcap": 0.0}, {"softcap": -1.0}):
        with pytest.raises(ValueError):
            cpu_decode.paged_decode_attention(query, k, v, tables, lens, 0.2, **bad)


def test_mixed_index_dtypes_and_out() -> None:
    query, k, v, tables, lens = _inputs([7, 40, 16], 9, 3, 64, 16, torch.bfloat16)
    out = torch.empty_like(query)
    got = cpu_decode.paged_decode_attention(query, k, v, tables.long(), lens.int(), 0.125, out)
    assert got is out
    ref = cpu_decode.paged_decode_attention(query, k, v, tables.int(), lens.long(), 0.125)
    assert torch.equal(out, ref)


def test_thread_count_does_not_change_results() -> None:
    query, k, v, tables, lens = _inputs([300, 5, 129], 9, 3, 64, 16, torch.float32)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            outs.append(
                cpu_decode.paged_decode_attention(query, k, v, tables, lens, 0.1, partition_size=64)
            )
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_ignores_scores_past_a_shorter_sequence(dtype: torch.dtype) -> None:
    """One thread reuses its score scratch from item to item: sequence 0 (40 keys) leaves
    its softmax numerators (>= 0) at keys 33-39, where sequence 1 (33 keys: 32 + a 1-key
    tail) has none, and every score of sequence 1 is -200. A softmax whose max took in
    the lanes past a row's end would take ~1 as its max and underflow every numerator
    to 0 (NaN out); the reference's max is -200 (uniform weights)."""
    D = 64
    query, k, v, tables, lens = _inputs([40, 33], 9, 3, D, 16, dtype)
    u = torch.randn(D, generator=torch.Generator().manual_seed(5))
    u = u / u.norm()
    query[1] = (-u).to(dtype)  # every head of sequence 1 asks against u
    for pos in range(33):  # and every key of sequence 1 lies along u: scores -200
        k[int(tables[1, pos // 16]), pos % 16] = (200.0 * D ** 0.5 * u).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # items 0 then 1 on one thread, one scratch
        out = cpu_decode.paged_decode_attention(query, k, v, tables, lens, D ** -0.5)
    finally:
        torch.set_num_threads(threads)
    assert torch.isfinite(out.float()).all()
    assert_close(out, _reference(query, k, v, tables, lens), dtype, f"stale scores {dtype}")


def _bad_inputs() -> list[tuple[str, tuple]]:
    query, k, v, tables, lens = _inputs([7, 20], 4, 2, 32, 16, torch.float32)
    return [
        ("query dtype", (query.bfloat16(), k, v, tables, lens)),
        ("v dtype", (query, k, v.double(), tables, lens)),
        ("k bf16, v fp32", (query, k.bfloat16(), v, tables, lens)),
        ("fp32 caches under bf16", (query.bfloat16(), k, v, tables, lens)),
        ("fp16", (query.half(), k.half(), v.half(), tables, lens)),
        ("query ndim", (query[0], k, v, tables, lens)),
        ("cache ndim", (query, k[0], v[0], tables, lens)),
        ("k/v shapes", (query, k, v[:, :8], tables, lens)),
        ("head_dim", (query[..., :16].contiguous(), k, v, tables, lens)),
        ("heads", (query[:, :3].contiguous(), k, v, tables, lens)),
        ("table dtype", (query, k, v, tables.float(), lens)),
        ("table ndim", (query, k, v, tables[0], lens)),
        ("lens shape", (query, k, v, tables, lens[:1])),
        ("non-contiguous", (query.mT.contiguous().mT, k, v, tables, lens)),
        ("seq_len 0", (query, k, v, tables, torch.tensor([0, 20], dtype=torch.int32))),
        ("seq_len too long", (query, k, v, tables, torch.tensor([7, 33], dtype=torch.int32))),
        ("block id", (query, k, v, torch.full_like(tables, k.shape[0]), lens)),
    ]


@pytest.mark.parametrize("case", _bad_inputs(), ids=lambda c: c[0])
def test_bad_inputs_raise_value_error(case: tuple[str, tuple]) -> None:
    with pytest.raises(ValueError):
        cpu_decode.paged_decode_attention(*case[1], 0.1)


def test_failed_build_is_reported_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_decode, "_extension", LazyExtension("cpu_decode kernel", cpu_decode.build_library))
    monkeypatch.setattr(cpu_decode, "_SOURCE", tmp_path / "missing.cpp")
    assert not cpu_decode.available() and not cpu_decode.available()
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1
    query, k, v, tables, lens = _inputs([3], 4, 2, 32, 16, torch.float32)
    with pytest.raises(RuntimeError, match="did not build"):
        cpu_decode.paged_decode_attention(query, k, v, tables, lens, 0.1)


def _check_build(ops: object, name: str, shapes: list[tuple[int, int, int, int]]) -> None:
    """A variant build's op against the oracle, plain and with a window and soft cap: fp32,
    bf16, and an fp32 query over bf16 caches."""
    for dtype, cache_dtype in ((torch.float32, None), (torch.bfloat16, None),
                               (torch.float32, torch.bfloat16)):
        for shape in shapes:
            query, k, v, tables, lens = _inputs([1, 31, 200], *shape, dtype,
                                                cache_dtype=cache_dtype)
            out = torch.empty_like(query)
            ops.decode(out, query, k, v, tables, lens, shape[2] ** -0.5, 64)  # type: ignore[attr-defined]
            ref = _reference(query, k, v, tables, lens)
            assert_close(out, ref, dtype, f"{name} {shape} {dtype}")
            ops.decode(out, query, k, v, tables, lens, shape[2] ** -0.5, 16, 21, 1.5)  # type: ignore[attr-defined]
            ref = _reference(query, k, v, tables, lens, window=21, softcap=1.5)
            assert_close(out, ref, dtype, f"{name} {shape} {dtype} window, softcap")


@pytest.mark.slow
def test_portable_build() -> None:
    namespace = "pagoda_cpu_decode_portable"
    cpu_decode.build_library(namespace, defines=("PAGODA_PORTABLE",))
    ops = getattr(torch.ops, namespace)
    assert not ops.uses_avx512() and not ops.uses_avx2()
    _check_build(ops, "portable", [(9, 3, 64, 16), (8, 2, 40, 32)])


@pytest.mark.slow
def test_avx2_build() -> None:
    """The 256-bit tiles of machines without AVX-512, built on one with it too: head_dim
    64 (two 4-ymm slices), 40 (4 + 1), 136 (4 x 4 + 1), query tiles of 1-4 heads and 5
    (4 + 1), and 36 (not a multiple of 8: the portable loops)."""
    ops = getattr(torch.ops, cpu_decode.OP_NAMESPACE)
    if ops.uses_avx512() or not ops.uses_avx2():  # else the native build is this one
        namespace = "pagoda_cpu_decode_avx2"
        cpu_decode.build_library(namespace, defines=("PAGODA_NO_AVX512",))
        ops = getattr(torch.ops, namespace)
    if not ops.uses_avx2():
        pytest.skip("no AVX2 + FMA on this machine")
    assert not ops.uses_avx512()
    _check_build(ops, "avx2", [(9, 3, 64, 16), (8, 2, 40, 32), (4, 4, 136, 16), (10, 2, 64, 16),
                               (8, 4, 64, 16), (4, 1, 36, 16)])


@pytest.mark.slow
def test_avx512_without_bf16_build() -> None:
    """The AVX-512 tiles of machines without AVX512-BF16 (Ice Lake class: bf16 K/V rows
    widened to fp32, no vdpbf16ps), built on an AVX512-BF16 one too."""
    if "avx512f" not in cpu_flags():  # before a compile that could only skip
        pytest.skip("no AVX-512 on this machine")
    ops = getattr(torch.ops, cpu_decode.OP_NAMESPACE)
    if "avx512_bf16" in cpu_flags():  # else the native build is this one
        namespace = "pagoda_cpu_decode_no_bf16"
        cpu_decode.build_library(namespace, cflags=("-mno-avx512bf16",))
        ops = getattr(torch.ops, namespace)
    assert ops.uses_avx512()
    _check_build(ops, "avx512 without bf16", [(9, 3, 64, 16), (8, 2, 40, 32), (4, 4, 136, 16),
                                              (10, 2, 64, 16)])


@pytest.mark.slow
def test_twin_prefetch_level_builds() -> None:
    """The AVX-512 kernels prefetch the next block's rows into L2 on AMD, into L1
    elsewhere; the other choice, forced by a define, computes the same."""
    ops = getattr(torch.ops, cpu_decode.OP_NAMESPACE)
    if not ops.uses_avx512():
        pytest.skip("no AVX-512 on this machine: the twins' level is the AVX-512 kernels'")
    assert ops.twin_prefetch_l2() == (cpu_vendor() == "AuthenticAMD")
    other = int(not ops.twin_prefetch_l2())
    namespace = f"pagoda_cpu_decode_twin_l2_{other}"
    cpu_decode.build_library(namespace, defines=(f"PAGODA_TWIN_PREFETCH_L2={other}",))
    forced = getattr(torch.ops, namespace)
    assert forced.twin_prefetch_l2() == bool(other)
    _check_build(forced, f"twins into L{2 if other else 1}", [(9, 3, 64, 16), (8, 2, 40, 32)])
