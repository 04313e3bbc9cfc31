"""A CPU step through every decoder layer in one C++ call, for the worker's CPU path.

``decode_layers`` runs, per layer, the kernels the model's Python loop runs on the CPU
(the ``cpu_fused`` norms, rotary and KV-cache write, called as their row kernels in
``csrc/cpu_rows.h``; the ``cpu_gemm`` linears, or oneDNN's with ``cpu_gemv`` and
``cpu_fused.silu_mul`` where the weights were packed for oneDNN, and the ``cpu_decode``
and ``cpu_prefill`` attention, called as ops; ``csrc/cpu_decoder.cpp``) in the same
order, so its result is
bit-identical; it leaves out the Python between them, and the norms' and rotary's op
dispatch and allocations. It covers the plain layer (pre-norms, optional per-head q/k norms, full
rotary, SwiGLU, no window or soft cap); the caller
(``services/worker/models/cpu_decoder_path.py``) decides which models and steps take it.
Compiled on first use; ``available()`` reports whether it and the four extensions it
calls built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kernels import cpu_decode, cpu_fused, cpu_gemm, cpu_gemv, cpu_prefill
from kernels.cpu_extension import CSRC, SCALAR_HEADER, LazyExtension, build_extension

_SOURCE = CSRC / "cpu_decoder.cpp"
OP_NAMESPACE = "pagoda_cpu_decoder"  # the source's default PAGODA_OP_NS

_HEADERS = [CSRC / "cpu_rows.h", SCALAR_HEADER]


def build_library(namespace: str = OP_NAMESPACE) -> None:
    """Compile (or load from the cache) the op as ``torch.ops.<namespace>``; no FMA
    contraction, as ``cpu_fused`` (the row kernels must round as its ops do)."""
    build_extension(namespace, _SOURCE, _HEADERS, extra_cflags=("-ffp-contract=off",))


# a lambda: the source paths are read at build time
_extension = LazyExtension("cpu_decoder", lambda: build_library())


def available() -> bool:
    """Build (once per process) this and the extensions it calls; never raises."""
    return (cpu_gemm.available() and cpu_decode.available() and cpu_prefill.available()
            and _extension.available())


@dataclass(frozen=True)
class LayerWeights:
    """Every layer's tensors, one list entry a layer (the packed weights' data)."""

    input_norm: list[torch.Tensor]
    post_norm: list[torch.Tensor]
    qkv: list[torch.Tensor]
    qkv_bias: list[torch.Tensor | None]
    q_norm: list[torch.Tensor | None]  # per-head RMSNorm weights of q and k (Qwen3), or None
    k_norm: list[torch.Tensor | None]
    o: list[torch.Tensor]
    o_bias: list[torch.Tensor | None]
    gate_up: list[torch.Tensor]  # packed for linear_silu (``cpu_gemm.pack_gated``)
    gate_up_bias: list[torch.Tensor | None]
    down: list[torch.Tensor]
    down_bias: list[torch.Tensor | None]
    # weights packed by oneDNN (``torch.ops.mkldnn._reorder_linear_weight``; gate_up plain,
    # not gated) instead: every layer's plain qkv, o, gate_up and down, 4 a layer, for
    # ``kernels.cpu_gemv`` at up to ``gemv_max_rows`` rows (0: never); empty for cpu_gemm
    onednn_plain: list[torch.Tensor] = field(default_factory=list)
    gemv_max_rows: int = 0


@dataclass(frozen=True)
class LayerDims:
    """Attention heads, and the output width of each packed weight as the layers pass it."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_n: int
    o_n: int
    act_n: int  # linear_silu's n: the intermediate size
    down_n: int

    def as_list(self) -> list[int]:
        return [self.num_heads, self.num_kv_heads, self.head_dim, self.qkv_n, self.o_n,
                self.act_n, self.down_n]


def decode_layers(
    hidden: torch.Tensor,  # [T, hidden]: the embedded tokens of the step
    positions: torch.Tensor,  # [T] int64
    weights: LayerWeights,
    dims: LayerDims,
    k_caches: Sequence[torch.Tensor],  # per layer [blocks, block_size, kv_heads, D]
    v_caches: Sequence[torch.Tensor],
    cos_cache: torch.Tensor,  # [P, D / 2] float32
    sin_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
    block_tables: torch.Tensor,  # [S, max_blocks] int32 or int64
    seq_lens: torch.Tensor,  # [S] int32 or int64, the step's tokens included
    eps: float,
    scale: float,
    num_decodes: int | None = None,  # the first sequences, one token each; None: all S
    prefill_first: int = 0,  # the first token of the prefill chunks (those after them)
    prefill_starts: torch.Tensor | None = None,  # their query_start_loc, less prefill_first
    output_rows: torch.Tensor | None = None,  # [R] int64: the rows kept of the output
) -> tuple[torch.Tensor, torch.Tensor]:  # the last MLP's output, the residual before it
    """Every layer of one step; what the model's loop hands its final norm. The decodes'
    attention runs ``cpu_decode``, the prefill chunks' ``cpu_prefill`` (as the ``cpu``
    attention backend splits them). ``output_rows``: only those rows of both outputs, the
    last layer's o projection and MLP run for them alone (every token's K/V is still
    written). Raises RuntimeError when an extension did not build (check ``available()``
    first), and what the ops raise on bad input (ValueError)."""
    if not available():
        raise RuntimeError("the cpu_decoder extension (or one it calls) did not build")
    op = getattr(torch.ops, OP_NAMESPACE).decode_layers
    w = weights
    out: tuple[torch.Tensor, torch.Tensor] = op(
        hidden, positions, w.input_norm, w.post_norm, w.qkv, w.qkv_bias, w.q_norm, w.k_norm,
        w.o, w.o_bias, w.gate_up, w.gate_up_bias, w.down, w.down_bias, list(k_caches),
        list(v_caches),
        cos_cache, sin_cache, slot_mapping, block_tables, seq_lens,
        seq_lens.shape[0] if num_decodes is None else num_decodes, prefill_first,
        prefill_starts, dims.as_list(), eps, scale, cpu_gemm.OP_NAMESPACE,
        cpu_decode.OP_NAMESPACE, cpu_prefill.OP_NAMESPACE, output_rows, w.onednn_plain,
        w.gemv_max_rows, cpu_gemv.OP_NAMESPACE, cpu_fused.OP_NAMESPACE)
    return out
