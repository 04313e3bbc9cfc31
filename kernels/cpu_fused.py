"""Fused CPU kernels for the decoder layer's small ops: RMSNorm (+ residual add), rotary
embedding, SiLU-and-multiply, and the KV-cache write. A C++ extension built at first
use, like ``cpu_decode``.

At batch 1 a CPU decode step spends much of its time dispatching a few hundred small
torch ops per layer; each kernel here (``csrc/cpu_fused.cpp``) replaces a handful of
them with one call and one pass over memory. Each reproduces the rounding of the torch
code it replaces (``services/worker/layers/norm.py``, ``rotary.py``, the MLP of
``models/llama.py``): fp32 math, bf16 rounded to nearest even wherever torch stores an
intermediate. The only differences are the order of the RMSNorm sum of squares and the
exp inside SiLU (both ~1 fp32 ulp); in bf16, SiLU reads silu(gate) from a table of all
2^16 gate values that the kernel builds with the same code. ``write_kv_cache`` is an
exact copy, as ``reference.write_kv_cache``. fp32 or bf16 activations; the kernels
check their inputs (ValueError). The build (``cpu_extension``, as ``cpu_decode``'s) adds
-ffp-contract=off so that a * b - c * d rounds as torch's separate ops do.
``available()`` reports whether it built; callers keep the torch path.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import CSRC, SCALAR_HEADER, LazyExtension, build_extension

_SOURCE = CSRC / "cpu_fused.cpp"
OP_NAMESPACE = "pagoda_cpu_fused"  # the source's default PAGODA_OP_NS
DTYPES = (torch.float32, torch.bfloat16)


def build_library(namespace: str = OP_NAMESPACE, defines: tuple[str, ...] = ()) -> None:
    """Compile (or load from the cache) the kernels as ``torch.ops.<namespace>``; tests
    build the portable loops as a variant (``defines=("PAGODA_PORTABLE",)``)."""
    build_extension(namespace, _SOURCE, [CSRC / "cpu_rows.h", SCALAR_HEADER, CSRC / "cpu_silu.h"],
                    extra_cflags=("-ffp-contract=off",), defines=defines)


# a lambda: the source path is read at build time
_extension = LazyExtension("cpu_fused kernels", lambda: build_library())


def available() -> bool:
    """Build (once per process) and report whether the kernels can run; never raises."""
    return _extension.available()


def _ops():  # type: ignore[no-untyped-def]
    if not available():
        raise RuntimeError("the cpu_fused extension did not build; see the logged warning")
    return torch.ops.pagoda_cpu_fused


def rms_norm(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor | None,  # [T, H] like x, or None
    weight: torch.Tensor,  # [H], x's dtype
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # norm(x + residual) [T, H], x + residual [T, H]
    """RMSNorm as ``layers/norm.py``: with residual None the new residual is x itself."""
    if residual is None:
        return _ops().rms_norm(x, weight, eps), x
    out, new_residual = _ops().add_rms_norm(x, residual, weight, eps)
    return out, new_residual


def rotary(
    query: torch.Tensor,  # [T, num_heads, D]: heads x D contiguous in a row, any row stride
    key: torch.Tensor,  # [T, num_kv_heads, D]: likewise
    positions: torch.Tensor,  # [T] int64 (or int32), each < P
    cos_cache: torch.Tensor,  # [P, D / 2] float32
    sin_cache: torch.Tensor,  # [P, D / 2] float32
) -> tuple[torch.Tensor, torch.Tensor]:  # contiguous [T, num_heads, D], [T, num_kv_heads, D]
    """Rotate-half rotary embedding as ``layers/rotary.py``; the q / k slices of the fused
    qkv projection are read in place (a query or key in another layout is copied first)."""
    q_out, k_out = _ops().rotary(query, key, positions, cos_cache, sin_cache)
    return q_out, k_out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 * I] -> [T, I]
    """``F.silu(gate) * up`` with gate, up = the two halves of each row."""
    return _ops().silu_mul(gate_up)  # type: ignore[no-any-return]


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]: heads x D contiguous in a row
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]: likewise
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    slot_mapping: torch.Tensor,  # [num_tokens] int64: block * block_size + offset, -1 = skip
) -> None:
    """``reference.write_kv_cache`` in one pass, key / value in the caches' dtype; the k / v
    slices of the fused qkv projection are read in place. A slot outside [-1, num_blocks *
    block_size) raises ValueError before anything is written. Two tokens with the same
    slot: one of them is stored (which one, unspecified, as with index_copy_)."""
    _ops().write_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:  # [R, V] float32 / bfloat16 -> [R] int64
    """``x.argmax(dim=-1)`` of a 2-D fp32 or bf16 CPU tensor whose last dim has stride 1:
    the first index of the largest value, a NaN counting as the largest (as torch)."""
    return _ops().argmax_rows(x)


def screen_columns(x: torch.Tensor, bounds: torch.Tensor, rel: float) -> torch.Tensor:
    """[R, V] fp32 / bf16 approximate scores, each within ``bounds[r] + rel * |score|`` of
    its true value (``bounds``: [R] float64) -> the ascending int64 columns that may hold
    some row's largest true value: every column whose upper limit reaches the lower limit
    of its row's top score. A row holding a NaN keeps every column."""
    return _ops().screen_columns(x, bounds, rel)
