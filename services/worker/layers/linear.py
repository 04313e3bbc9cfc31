"""Linear layers of the model: one call that uses oneDNN-packed weights on the CPU.

On an x86 CPU in float32, oneDNN's linear with weights reordered once into its
blocked layout runs 1.3-2.5x faster than ``F.linear`` on the same plain weights at
every batch size a step sees (1 to 2,048 rows; measured on the 2-core build machines),
and the linears are most of a CPU step. ``pack_cpu_linears`` packs each weight of a
loaded model once (the plain weight stays, for the loader, tests and other devices);
``linear`` uses the packed copy when there is one and ``F.linear`` otherwise.

In bf16 at up to ``GEMV_MAX_ROWS`` rows (decode steps of a few sequences) a linear is
bound by reading its weight, and oneDNN's bf16 path reads well below the machine's
bandwidth; there ``kernels.cpu_gemv`` streams the plain weight instead (a whole SmolLM2
step's linears at batch 1: 1.35x faster; ``python -m kernels.bench_gemv``).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_gemv

log = logging.getLogger(__name__)
_PACK_BATCH_HINT = 64  # oneDNN picks its blocking for this many rows; any count works
# bf16 rows up to which cpu_gemv beats oneDNN at every SmolLM2 shape (1.35-1.49x a whole
# step at 1-8 rows; 1.06x at 16, 0.89x at 32, and the lm_head loses from 12)
GEMV_MAX_ROWS = 8


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    if packed is not None:  # a CPU weight (only those are packed)
        if (x.shape[0] <= GEMV_MAX_ROWS and x.dtype == torch.bfloat16
                and weight.is_contiguous() and cpu_gemv.available()):
            return cpu_gemv.linear_bf16(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-packed copy of a [out, in] weight, or None where packing does not apply
    or does not reproduce F.linear on a probe (then the plain path is used)."""
    if not can_pack(weight):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)
        probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0))
        probe = probe.to(weight.dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "").float()
        want = F.linear(probe.float(), weight.float())
    except RuntimeError as e:
        log.warning("oneDNN weight packing unavailable (%s); using F.linear", e)
        return None
    scale = float(want.abs().max()) or 1.0
    tol = 1e-4 if weight.dtype == torch.float32 else 2e-2  # bf16 output: 8 mantissa bits
    if not torch.allclose(got, want, rtol=tol, atol=tol * scale):
        log.warning("oneDNN packed linear disagrees with F.linear; using F.linear")
        return None
    return packed


def pack_cpu_linears(model: nn.Module) -> int:
    """Pack every weight named in a module's ``PACKED_WEIGHTS``; returns how many."""
    count = 0
    for module in model.modules():
        for name in getattr(module, "PACKED_WEIGHTS", ()):
            packed = pack_weight(getattr(module, name))
            setattr(module, f"{name}_packed", packed)
            count += packed is not None
    return count
