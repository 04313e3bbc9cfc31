"""Linear layers of the model: one call that runs a CPU weight packed once at load.

A CPU step is mostly its linears, so each CPU weight is packed once, at load
(``pack_cpu_linears``), for the fastest kernel this machine has for its dtype:

- ``kernels.cpu_gemm`` where the CPU has the vector path for the dtype (AVX-512 for
  fp32, AVX512-BF16 for bf16; not bf16 on a CPU with AMX, below): at a decode step's
  16-64 rows it runs SmolLM2's linears
  1.3-1.6x faster than oneDNN in bf16 and 1.25-1.37x in fp32, at 1-8 rows at least as
  fast as ``kernels.cpu_gemv``, and within noise of oneDNN at prefill sizes
  (``python -m kernels.bench_linear``);
- on an AVX2 machine (no AVX-512: a Zen 3 EPYC) its 256-bit tiles, in both dtypes: fp32
  1.53x oneDNN at 1 row, 1.43x at 16, 1.12-1.28x at 64, 1.06-1.16x at 256 (129-168
  GFLOP/s from 64 rows, two runs); bf16, which oneDNN cannot pack there (it needs AVX-512
  or AVX-NE-CONVERT), 1.84x torch's F.linear at 1 row and 5.8-8.1x from 16 rows
  (102-141 GFLOP/s);
- on AVX-512 without AVX512-BF16 (an Ice Lake class Xeon) its AVX-512 tiles in both
  dtypes, bf16 widened to fp32 in registers: oneDNN's bf16 there is emulated, and the
  widening tiles ran a whole SmolLM2 step's bf16 linears 1.44x its speed at 1 row and
  3.7-4.1x from 8 rows; fp32 1.23x oneDNN at 1 row, 1.28-1.37x at 8-54 rows;
- else oneDNN's linear on the weight reordered into its blocked layout (1.3-2.5x
  ``F.linear`` on plain fp32 weights), and in bf16 at up to ``GEMV_MAX_ROWS`` rows
  ``kernels.cpu_gemv`` on the plain weight, which reads it faster than oneDNN's bf16
  path there.

On a CPU with AMX-BF16 (Sapphire Rapids and later) oneDNN multiplies bf16 on the AMX
tiles, which cpu_gemm's ``vdpbf16ps`` does not use: there bf16 keeps oneDNN (and
cpu_gemv at few rows), the combination that measured level with vLLM's AMX engine;
fp32 (no AMX path in oneDNN) still takes cpu_gemm.

The plain weight stays (the loader, tests and other devices use it); ``linear`` uses
the packed copy when there is one and ``F.linear`` otherwise.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_gemm, cpu_gemv
from services.worker.cpu_memory import HugePageArena

log = logging.getLogger(__name__)
_PACK_BATCH_HINT = 64  # oneDNN picks its blocking for this many rows; any count works
# bf16 rows up to which cpu_gemv beats oneDNN at every SmolLM2 shape (1.35-1.49x a whole
# step at 1-8 rows; 1.06x at 16, 0.89x at 32, and the lm_head loses from 12)
GEMV_MAX_ROWS = 8


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A CPU weight packed for one kernel: ``cpu_gemm`` (``gemm`` true) or oneDNN. A
    ``silu_gated`` one is a SwiGLU gate_up weight packed for ``cpu_gemm.linear_silu``
    (``out_features`` is then the intermediate size): ``linear_silu`` is its call."""

    data: torch.Tensor
    out_features: int
    gemm: bool
    silu_gated: bool = False


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedWeight | None) -> torch.Tensor:
    if packed is None:
        return F.linear(x, weight, bias)
    if packed.silu_gated:
        raise ValueError("a silu-gated packed weight runs through linear_silu")
    if packed.gemm:
        return cpu_gemm.linear(x, packed.data, packed.out_features, bias)
    if (x.shape[0] <= GEMV_MAX_ROWS and x.dtype == torch.bfloat16
            and weight.is_contiguous() and cpu_gemv.available()):
        return cpu_gemv.linear_bf16(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed.data, bias, "none", [], "")


def linear_silu(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``silu(gate) * up`` of a SwiGLU gate_up projection in one call (a ``silu_gated``
    packed weight; bias [2 I] or None), rounded as the linear then ``cpu_fused.silu_mul``."""
    return cpu_gemm.linear_silu(x, packed.data, packed.out_features, bias)


def _silu_gated_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x.float(), weight.float()).chunk(2, dim=-1)
    return F.silu(gate) * up


def cpu_has(*features: str) -> bool:
    """Whether torch reports any of these CPU features (``torch.cpu.get_capabilities``
    names, e.g. ``avx512_bf16``, ``amx_bf16``); False where it cannot tell."""
    try:
        caps = torch.cpu.get_capabilities()
    except (AttributeError, RuntimeError):
        return False
    return any(caps.get(f) for f in features)


def auto_kernel(dtype: torch.dtype) -> str:
    """The packing ``kernel="auto"`` picks for a CPU weight of ``dtype``: ``cpu_gemm``
    where it has a vector path, except bf16 on an AMX CPU; else ``onednn``."""
    if dtype not in cpu_gemm.simd_dtypes():
        return "onednn"
    if dtype == torch.bfloat16 and cpu_has("amx_bf16"):
        return "onednn"
    return "cpu_gemm"


def _onednn_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack_weight(weight: torch.Tensor, kernel: str = "auto",
                silu_gated: bool = False) -> PackedWeight | None:
    """The packed copy of a [out, in] CPU weight, or None where packing does not apply or
    does not reproduce F.linear on a probe (then the plain path is used). ``kernel``:
    ``auto`` (``auto_kernel``: cpu_gemm where it has the vector path, but for bf16 on AMX),
    ``cpu_gemm`` or ``onednn`` (benchmarks compare them). ``silu_gated``: a SwiGLU
    gate_up weight, packed for ``linear_silu`` where the kernel is cpu_gemm (else as a
    plain linear: check ``PackedWeight.silu_gated``)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    gemm = (auto_kernel(weight.dtype) if kernel == "auto" else kernel) == "cpu_gemm"
    if gemm and not cpu_gemm.available():
        return None
    if not gemm and not _onednn_available():
        return None
    gated = gemm and silu_gated
    probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0))
    probe = probe.to(weight.dtype)
    try:
        if gated:
            packed = PackedWeight(cpu_gemm.pack_gated(weight), weight.shape[0] // 2, True, True)
            got = linear_silu(probe, packed, None).float()
            want = _silu_gated_reference(probe, weight)
        else:
            data = (cpu_gemm.pack(weight) if gemm else
                    torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT))
            packed = PackedWeight(data, weight.shape[0], gemm)
            got = linear(probe, weight, None, packed).float()
            want = F.linear(probe.float(), weight.float())
    except RuntimeError as e:
        log.warning("%s weight packing unavailable (%s); using F.linear",
                    "cpu_gemm" if gemm else "oneDNN", e)
        return None
    scale = float(want.abs().max()) or 1.0
    tol = 1e-4 if weight.dtype == torch.float32 else 2e-2  # bf16 output: 8 mantissa bits
    if not torch.allclose(got, want, rtol=tol, atol=tol * scale):
        log.warning("packed linear disagrees with F.linear; using F.linear")
        return None
    return packed


def pack_cpu_linears(model: nn.Module, kernel: str = "auto",
                     arena: HugePageArena | None = None) -> int:
    """Pack every weight named in a module's ``PACKED_WEIGHTS`` (those also in its
    ``silu_gated_weights`` for ``linear_silu`` where the kernel allows); returns how many.
    The cpu_gemm ones are moved into ``arena`` (a fresh ``HugePageArena`` by default) as
    they are packed, so a step streams them from huge pages (see ``cpu_memory``)."""
    arena = HugePageArena() if arena is None else arena
    count = 0
    for module in model.modules():
        gated = getattr(module, "silu_gated_weights", ())
        for name in getattr(module, "PACKED_WEIGHTS", ()):
            packed = pack_weight(getattr(module, name), kernel, name in gated)
            if packed is not None and packed.gemm:  # oneDNN's packed tensors stay its own
                packed = dataclasses.replace(packed, data=arena.place(packed.data))
            setattr(module, f"{name}_packed", packed)
            count += packed is not None
    return count
