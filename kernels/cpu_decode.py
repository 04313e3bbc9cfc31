"""CPU paged-attention decode: a C++ extension built at runtime, for the worker's CPU path.

Same contract as ``reference.paged_decode_attention`` (cache layout in ``reference``)
without its gather: the kernel in ``csrc/cpu_decode.cpp`` walks each sequence's block
table and reads every K/V row once for all query heads of its KV head, on torch's own
intra-op thread pool. It is compiled on first use with ``-march=native`` (the machine
that builds it runs it) into the torch extensions cache (``TORCH_EXTENSIONS_DIR``);
the extension name carries a hash of the source, so an edited source rebuilds.
``available()`` reports whether the build worked; callers fall back to the reference.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "cpu_decode.cpp"
_OP_NAMESPACE = "pagoda_cpu_decode"  # must match TORCH_LIBRARY in the source
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]
# -fopenmp links libgomp.so.1, which resolves to the copy torch already loaded (same
# soname), so at::parallel_for runs on torch's pool and no second runtime appears.
_LDFLAGS = ["-fopenmp"]
DTYPES = (torch.float32, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256

_lock = threading.Lock()
_built: bool | None = None  # None until the first available() call


def _build() -> None:
    from torch.utils.cpp_extension import load_inline

    source = _SOURCE.read_text()
    digest = hashlib.sha256(" ".join([source, *_CFLAGS, *_LDFLAGS]).encode()).hexdigest()[:10]
    start = time.perf_counter()
    load_inline(
        name=f"pagoda_cpu_decode_{digest}",
        cpp_sources=[source],
        extra_cflags=_CFLAGS,
        extra_ldflags=_LDFLAGS,
        is_python_module=False,  # the library registers torch.ops.pagoda_cpu_decode
        no_implicit_headers=True,  # skip torch/extension.h (pybind): a faster build
        verbose=False,
    )
    logger.info("cpu_decode extension ready in %.1f s", time.perf_counter() - start)


def available() -> bool:
    """Build (once per process) and report whether the kernel can run; never raises."""
    global _built
    if _built is None:
        with _lock:
            if _built is None:
                try:
                    _build()
                    _built = True
                except Exception as exc:  # a missing compiler, headers or source file
                    logger.warning("cpu_decode kernel unavailable, build failed: %s", exc)
                    _built = False
    return _built


def _check(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    """Raise ValueError for anything the kernel does not read as documented."""
    if query.ndim != 3 or k_cache.ndim != 4:
        raise ValueError(f"query must be 3-D and k_cache 4-D, got {query.ndim}-D, {k_cache.ndim}-D")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    if query.dtype not in DTYPES or k_cache.dtype != query.dtype or v_cache.dtype != query.dtype:
        raise ValueError(
            f"query/k_cache/v_cache must share a dtype in {DTYPES}, got "
            f"{query.dtype}/{k_cache.dtype}/{v_cache.dtype}"
        )
    batch, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or head_dim % 8 or not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim {head_dim} (cache {k_cache.shape[3]}) must match, be a multiple "
            f"of 8 and at most {MAX_HEAD_DIM}"
        )
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [batch={batch}, max_blocks], got {tuple(block_tables.shape)}")
    if seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must be [batch={batch}], got {tuple(seq_lens.shape)}")
    if block_tables.dtype not in INDEX_DTYPES or seq_lens.dtype not in INDEX_DTYPES:
        raise ValueError(f"block_tables/seq_lens must be int32 or int64, got {block_tables.dtype}/{seq_lens.dtype}")
    tensors = [query, k_cache, v_cache, block_tables, seq_lens]
    if out is not None:
        if out.shape != query.shape or out.dtype != query.dtype:
            raise ValueError(f"out must be {tuple(query.shape)} {query.dtype}, got {tuple(out.shape)} {out.dtype}")
        tensors.append(out)
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        raise ValueError("all tensors must be contiguous CPU tensors")


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
) -> torch.Tensor:  # [batch, num_heads, head_dim], query dtype
    """Decode attention over the paged cache; fp32 or bf16 in, fp32 accumulation.

    Every seq_len must be at least 1 (a decode token always sees itself) and fit its
    block-table row; the kernel checks this and every block id it reads, raising
    ValueError. Query head h reads KV head h // (num_heads // num_kv_heads).
    """
    _check(query, k_cache, v_cache, block_tables, seq_lens, out)
    if not available():
        raise RuntimeError("the cpu_decode extension failed to build; see the logged warning")
    if out is None:
        out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    op = getattr(torch.ops, _OP_NAMESPACE).decode
    op(out, query, k_cache, v_cache, block_tables, seq_lens, float(scale), partition_size or 0)
    return out
