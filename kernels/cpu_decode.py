"""CPU paged-attention decode: a C++ extension built at runtime, for the worker's CPU path.

Same contract as ``reference.paged_decode_attention`` (cache layout in ``reference``)
without its gather: the kernel (``csrc/cpu_decode.cpp``, block kernels in
``csrc/cpu_decode_blocks.h``) walks each sequence's block table and reads every K/V row
once for all query heads of its KV head, on torch's own intra-op thread pool. It is
compiled on first use (``cpu_extension``); ``available()`` reports whether the build
worked; callers fall back to the reference.
"""

from __future__ import annotations

import torch

from kernels.cpu_attention_checks import check_buffers, check_heads, window_and_softcap
from kernels.cpu_extension import CSRC, SCALAR_HEADER, LazyExtension, build_extension

_SOURCE = CSRC / "cpu_decode.cpp"
_HEADERS = [CSRC / "cpu_attention_types.h", CSRC / "cpu_decode_blocks.h", CSRC / "cpu_reduce16.h",
            CSRC / "cpu_softmax_avx2.h", SCALAR_HEADER]
OP_NAMESPACE = "pagoda_cpu_decode"  # the source's default PAGODA_OP_NS


def build_library(namespace: str = OP_NAMESPACE, defines: tuple[str, ...] = (),
                  cflags: tuple[str, ...] = ()) -> None:
    """Compile (or load from the cache) the kernel as ``torch.ops.<namespace>``; tests
    build the portable path as a variant (``defines=("PAGODA_PORTABLE",)``), and the
    AVX-512 path without AVX512-BF16 (``cflags=("-mno-avx512bf16",)``)."""
    build_extension(namespace, _SOURCE, _HEADERS, extra_cflags=cflags, defines=defines)


# a lambda: the source paths are read at build time
_extension = LazyExtension("cpu_decode kernel", lambda: build_library())


def available() -> bool:
    """Build (once per process) and report whether the kernel can run; never raises."""
    return _extension.available()


def _check(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor | None,
) -> None:
    """Raise ValueError for anything the kernel would not read as documented."""
    check_heads(query, k_cache, v_cache)
    batch = query.shape[0]
    if block_tables.ndim != 2 or block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(
            f"block_tables must be [{batch}, max_blocks] and seq_lens [{batch}]; got "
            f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}"
        )
    check_buffers(query, k_cache, v_cache, {"block_tables": block_tables, "seq_lens": seq_lens}, out)


def paged_decode_attention(
    query: torch.Tensor,  # [batch, num_heads, head_dim]: one new token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [batch, max_blocks_per_seq] int32 or int64
    seq_lens: torch.Tensor,  # [batch] int32 or int64: cached tokens, the new one included
    scale: float,
    out: torch.Tensor | None = None,  # [batch, num_heads, head_dim], query dtype
    *,
    partition_size: int | None = None,  # tokens per split-K partition; None: heuristic
    window: int | None = None,  # sliding window: the last `window` keys only; None: all
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap); None: none
) -> torch.Tensor:  # [batch, num_heads, head_dim], query dtype
    """Decode attention over the paged cache: fp32 or bf16 in, fp32 accumulation.

    Every seq_len must be at least 1 (a decode token always sees itself) and fit in its
    block-table row; the kernel checks that and every block id it reads (ValueError;
    with a window, only the window's blocks are read and checked).
    Query head h reads KV head h // (num_heads // num_kv_heads). Raises RuntimeError
    when the extension did not build (check ``available()`` first).
    """
    _check(query, k_cache, v_cache, block_tables, seq_lens, out)
    if partition_size is not None and partition_size < 1:
        raise ValueError(f"partition_size must be positive, got {partition_size}")
    window_arg, softcap_arg = window_and_softcap(window, softcap)
    if not available():
        raise RuntimeError("the cpu_decode extension did not build; see the logged warning")
    if out is None:
        out = torch.empty_like(query)
    op = getattr(torch.ops, OP_NAMESPACE).decode
    op(out, query, k_cache, v_cache, block_tables, seq_lens, float(scale), partition_size or 0,
       window_arg, softcap_arg)
    return out
