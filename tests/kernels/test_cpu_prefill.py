"""The C++ CPU paged prefill kernel (kernels.cpu_prefill) against the torch oracle.

The oracle is ``reference.paged_attention`` in fp32 over the same cache. Caches are NaN
outside the slots a sequence owns (kernel_cases.paged_cache), so a read past a
sequence's end shows as NaN; the reference gets the cache with the NaN zeroed. Cases:
fp32 and bf16, head_dim 32/40/64/128/256, GQA groups 1/3/4, block sizes 16/32, plain
prefill, cached context (chunked prefill) on and off block boundaries, query_len 1,
ragged batches, shuffled block tables, int32/int64 indices, a ~1100-token sequence,
an fp32 query over bf16 caches (an fp32 model's bf16 KV cache), sliding windows
(shorter than a row block's span of positions, longer than a key chunk)
and attention soft caps, bad inputs, the AVX-512 build without AVX512-BF16, the AVX2 build
(built on AVX-512 machines too) and the portable build (slow: a compile each).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernel_cases import assert_close, block_tables_for, cpu_flags, paged_cache
from kernels import cpu_prefill, reference
from kernels.cpu_extension import LazyExtension, build_extension

if not cpu_prefill.available():
    pytest.skip("the cpu_prefill extension did not build", allow_module_level=True)

Seqs = list[tuple[int, int]]  # (query_len, context_len) of each sequence


def _inputs(
    seqs: Seqs, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype, index_dtype: torch.dtype = torch.int32, seed: int = 0,
    cache_dtype: torch.dtype | None = None,  # None: dtype
) -> tuple[torch.Tensor, ...]:  # query, k, v, query_start_loc, seq_lens, tables
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in seqs]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    tables = block_tables_for(seq_lens, block_size, num_blocks, gen)
    k, v = paged_cache(seq_lens, tables, num_blocks, block_size, num_kv_heads, head_dim,
                       cache_dtype or dtype, gen)
    starts = [0]
    for q, _ in seqs:
        starts.append(starts[-1] + q)
    query = torch.randn(starts[-1], num_heads, head_dim, generator=gen).to(dtype)
    return (
        query, k, v, torch.tensor(starts, dtype=index_dtype),
        torch.tensor(seq_lens, dtype=index_dtype), tables.to(index_dtype),
    )


def _reference(
    query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
    lens: torch.Tensor, tables: torch.Tensor, scale: float, window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # fp32 [num_tokens, heads, head_dim]
    k, v = k.float().nan_to_num(0.0), v.float().nan_to_num(0.0)
    return reference.paged_attention(query.float(), k, v, starts, lens, tables, scale, window,
                                     softcap)


def _check(
    seqs: Seqs, *shape: int, dtype: torch.dtype, index_dtype: torch.dtype = torch.int32,
    window: int | None = None, softcap: float | None = None,
    cache_dtype: torch.dtype | None = None,
) -> None:
    query, k, v, starts, lens, tables = _inputs(seqs, *shape, dtype, index_dtype,
                                                cache_dtype=cache_dtype)
    scale = query.shape[-1] ** -0.5
    out = cpu_prefill.paged_prefill_attention(query, k, v, starts, lens, tables, scale,
                                              window=window, softcap=softcap)
    assert out.dtype == dtype and out.shape == query.shape
    what = (f"seqs={seqs} heads/kv/D/bs={shape} {index_dtype} window={window} "
            f"softcap={softcap} cache={cache_dtype}")
    ref = _reference(query, k, v, starts, lens, tables, scale, window, softcap)
    assert_close(out, ref, dtype, what)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 2)])
def test_matches_reference(
    dtype: torch.dtype, head_dim: int, block_size: int, num_heads: int, num_kv_heads: int
) -> None:
    # plain prefills short and past a tile, query_len 1 with and without context, cached
    # context on and off block boundaries, in one ragged batch
    seqs = [(1, 0), (37, 0), (150, 0), (1, 70), (20, block_size), (45, 2 * block_size + 3)]
    _check(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_ragged_batch(dtype: torch.dtype, index_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    q_lens = torch.randint(1, 120, (9,), generator=gen).tolist()
    contexts = torch.randint(0, 200, (9,), generator=gen).tolist()
    _check(list(zip(q_lens, contexts)), 9, 3, 64, 16, dtype=dtype, index_dtype=index_dtype)


@pytest.mark.parametrize("head_dim", [32, 40, 256])  # small, a masked 16-chunk, the largest
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_other_head_dims(head_dim: int, dtype: torch.dtype) -> None:
    _check([(5, 28), (70, 0), (1, 3)], 8, 2, head_dim, 16, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_sequence(dtype: torch.dtype) -> None:
    _check([(1100, 0)], 9, 3, 64, 16, dtype=dtype)
    _check([(300, 801), (64, 1000)], 9, 3, 64, 32, dtype=dtype)  # chunked prefill


def test_large_group() -> None:  # a row block narrower than its tile of positions
    _check([(50, 10), (3, 0)], 16, 1, 64, 16, dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(1, None), (7, None), (100, None), (None, 0.8),
                                            (20, 2.0)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (16, 1)])
def test_window_and_softcap(dtype: torch.dtype, window: int | None, softcap: float | None,
                            num_heads: int, num_kv_heads: int) -> None:
    # fresh prompts past the window (row blocks whose last rows see none of the first key
    # chunk), chunks over context reaching back past the window, decode rows, one prompt
    # shorter than the window; group 16: a row block holds 3 positions
    seqs = [(150, 0), (1, 70), (45, 35), (3, 200), (5, 0), (70, 130)]
    _check(seqs, num_heads, num_kv_heads, 64, 16, dtype=dtype, window=window, softcap=softcap)


@pytest.mark.parametrize("head_dim", [40, 64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (8, 2)])
def test_fp32_query_over_bf16_caches(head_dim: int, num_heads: int, num_kv_heads: int) -> None:
    """An fp32 model's bf16 KV cache: fp32 query, out and sums over the cache's bf16 K/V
    (fp32 tolerances against the reference on the same values widened); prompts past a
    key chunk, chunks over context, decode rows, and a window with a soft cap."""
    seqs = [(1, 0), (31, 0), (60, 45), (150, 0), (1, 70), (70, 130)]
    _check(seqs, num_heads, num_kv_heads, head_dim, 16, dtype=torch.float32,
           cache_dtype=torch.bfloat16)
    _check(seqs, num_heads, num_kv_heads, head_dim, 16, dtype=torch.float32,
           cache_dtype=torch.bfloat16, window=20, softcap=2.0)


def test_bad_window_or_softcap_raise_value_error() -> None:
    query, k, v, starts, lens, tables = _inputs([(4, 60)], 4, 2, 32, 16, torch.float32)
    for bad in ({"window": 0}, {"softcap": 0.0}):
        with pytest.raises(ValueError):
            cpu_prefill.paged_prefill_attention(query, k, v, starts, lens, tables, 0.2, **bad)


def test_mixed_index_dtypes_out_and_untouched_rows() -> None:
    query, k, v, starts, lens, tables = _inputs([(7, 9), (40, 0)], 9, 3, 64, 16, torch.bfloat16)
    padded = torch.cat([query, torch.randn(3, 9, 64).bfloat16()])  # rows no sequence owns
    out = torch.full_like(padded, 5.0)
    got = cpu_prefill.paged_prefill_attention(
        padded, k, v, starts.long(), lens.int(), tables.long(), 0.125, out
    )
    assert got is out
    ref = cpu_prefill.paged_prefill_attention(query, k, v, starts, lens.long(), tables, 0.125)
    assert torch.equal(out[: len(query)], ref)
    assert bool((out[len(query) :] == 5.0).all())


def test_thread_count_does_not_change_results() -> None:
    query, k, v, starts, lens, tables = _inputs([(300, 0), (5, 40), (129, 7)], 9, 3, 64, 16,
                                                torch.float32)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            outs.append(cpu_prefill.paged_prefill_attention(query, k, v, starts, lens, tables, 0.1))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


def _bad_inputs() -> list[tuple[str, tuple]]:
    query, k, v, starts, lens, tables = _inputs([(7, 0), (20, 4)], 4, 2, 32, 16, torch.float32)
    i32 = torch.int32
    return [
        ("query dtype", (query.bfloat16(), k, v, starts, lens, tables)),
        ("v dtype", (query, k, v.double(), starts, lens, tables)),
        ("k bf16, v fp32", (query, k.bfloat16(), v, starts, lens, tables)),
        ("fp16", (query.half(), k.half(), v.half(), starts, lens, tables)),
        ("query ndim", (query[0], k, v, starts, lens, tables)),
        ("cache ndim", (query, k[0], v[0], starts, lens, tables)),
        ("k/v shapes", (query, k, v[:, :8], starts, lens, tables)),
        ("head_dim", (query[..., :16].contiguous(), k, v, starts, lens, tables)),
        ("heads", (query[:, :3].contiguous(), k, v, starts, lens, tables)),
        ("table dtype", (query, k, v, starts, lens, tables.float())),
        ("starts dtype", (query, k, v, starts.float(), lens, tables)),
        ("table ndim", (query, k, v, starts, lens, tables[0])),
        ("lens shape", (query, k, v, starts, lens[:1], tables)),
        ("starts shape", (query, k, v, starts[:2], lens, tables)),
        ("non-contiguous", (query.mT.contiguous().mT, k, v, starts, lens, tables)),
        ("out of range start", (query, k, v, torch.tensor([0, 7, 28], dtype=i32), lens, tables)),
        ("decreasing starts", (query, k, v, torch.tensor([0, 8, 7], dtype=i32), lens, tables)),
        ("seq_len < query_len", (query, k, v, starts, torch.tensor([6, 24], dtype=i32), tables)),
        ("seq_len too long", (query, k, v, starts, torch.tensor([7, 33], dtype=i32), tables)),
        ("block id", (query, k, v, starts, lens, torch.full_like(tables, k.shape[0]))),
    ]


@pytest.mark.parametrize("case", _bad_inputs(), ids=lambda c: c[0])
def test_bad_inputs_raise_value_error(case: tuple[str, tuple]) -> None:
    with pytest.raises(ValueError):
        cpu_prefill.paged_prefill_attention(*case[1], 0.1)


def test_bad_out_raises_value_error() -> None:
    query, k, v, starts, lens, tables = _inputs([(7, 0)], 4, 2, 32, 16, torch.float32)
    with pytest.raises(ValueError):
        cpu_prefill.paged_prefill_attention(
            query, k, v, starts, lens, tables, 0.1, out=torch.empty_like(query).bfloat16()
        )


def test_failed_build_is_reported_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(
        cpu_prefill, "_extension", LazyExtension("cpu_prefill kernel", cpu_prefill.build_library)
    )
    monkeypatch.setattr(cpu_prefill, "_SOURCE", tmp_path / "missing.cpp")
    assert not cpu_prefill.available() and not cpu_prefill.available()
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1
    query, k, v, starts, lens, tables = _inputs([(3, 0)], 4, 2, 32, 16, torch.float32)
    with pytest.raises(RuntimeError, match="did not build"):
        cpu_prefill.paged_prefill_attention(query, k, v, starts, lens, tables, 0.1)


def _check_build(ops: object, name: str, seqs: Seqs,
                 shapes: list[tuple[int, int, int, int]]) -> None:
    """A variant build's op against the oracle, plain and with a window and soft cap: fp32,
    bf16, and an fp32 query over bf16 caches."""
    for dtype, cache_dtype in ((torch.float32, None), (torch.bfloat16, None),
                               (torch.float32, torch.bfloat16)):
        for shape in shapes:
            query, k, v, starts, lens, tables = _inputs(seqs, *shape, dtype,
                                                        cache_dtype=cache_dtype)
            out = torch.empty_like(query)
            scale = shape[2] ** -0.5
            ops.prefill(out, query, k, v, starts, lens, tables, scale)  # type: ignore[attr-defined]
            ref = _reference(query, k, v, starts, lens, tables, scale)
            assert_close(out, ref, dtype, f"{name} {shape} {dtype}")
            ops.prefill(out, query, k, v, starts, lens, tables, scale, 9, 1.5)  # type: ignore[attr-defined]
            ref = _reference(query, k, v, starts, lens, tables, scale, 9, 1.5)
            assert_close(out, ref, dtype, f"{name} {shape} {dtype} window, softcap")


@pytest.mark.slow
def test_portable_build() -> None:
    namespace = "pagoda_cpu_prefill_portable"
    cpu_prefill.build_library(namespace, defines=("PAGODA_PORTABLE",))
    ops = getattr(torch.ops, namespace)
    assert not ops.uses_avx512() and not ops.uses_avx2()
    _check_build(ops, "portable", [(1, 0), (31, 0), (60, 45)], [(9, 3, 64, 16), (8, 2, 40, 32)])


@pytest.mark.slow
def test_avx2_build() -> None:
    """The 256-bit rows of machines without AVX-512, built on one with it too: head_dim a
    multiple of 8 (64 = one 8-ymm slice, 40 = a 5-ymm slice, 136 = 8 + 1), else the scalar
    rows (36); prompts past a key chunk, chunks over context, decode rows."""
    ops = getattr(torch.ops, cpu_prefill.OP_NAMESPACE)
    if ops.uses_avx512() or not ops.uses_avx2():  # else the native build is this one
        namespace = "pagoda_cpu_prefill_avx2"
        cpu_prefill.build_library(namespace, defines=("PAGODA_NO_AVX512",))
        ops = getattr(torch.ops, namespace)
    if not ops.uses_avx2():
        pytest.skip("no AVX2 + FMA on this machine")
    assert not ops.uses_avx512()
    _check_build(ops, "avx2", [(1, 0), (31, 0), (60, 45), (150, 0), (70, 130)],
                 [(9, 3, 64, 16), (8, 2, 40, 32), (4, 2, 136, 16), (6, 3, 36, 16)])


@pytest.mark.slow
def test_avx512_without_bf16_build() -> None:
    # AVX-512 machines without AVX512-BF16 widen bf16 to fp32 words in the same tiles
    if "avx512f" not in cpu_flags():  # before a compile that could only skip
        pytest.skip("no AVX-512 on this machine")
    namespace = "pagoda_cpu_prefill_no_bf16"
    build_extension(namespace, cpu_prefill._SOURCE, cpu_prefill._HEADERS,
                    extra_cflags=("-mno-avx512bf16",))
    ops = getattr(torch.ops, namespace)
    if not ops.uses_avx512():
        pytest.skip("no AVX-512 on this machine")
    assert not ops.uses_avx512_bf16()
    for dtype, cache_dtype in ((torch.float32, None), (torch.bfloat16, None),
                               (torch.float32, torch.bfloat16)):
        for shape in [(9, 3, 64, 16), (8, 2, 40, 32)]:
            query, k, v, starts, lens, tables = _inputs([(1, 0), (31, 0), (60, 45), (150, 0)],
                                                        *shape, dtype, cache_dtype=cache_dtype)
            out = torch.empty_like(query)
            scale = shape[2] ** -0.5
            ops.prefill(out, query, k, v, starts, lens, tables, scale)
            ref = _reference(query, k, v, starts, lens, tables, scale)
            assert_close(out, ref, dtype, f"no-bf16 {shape} {dtype}")
            ops.prefill(out, query, k, v, starts, lens, tables, scale, 9, 1.5)
            ref = _reference(query, k, v, starts, lens, tables, scale, 9, 1.5)
            assert_close(out, ref, dtype, f"no-bf16 {shape} {dtype} window, softcap")
