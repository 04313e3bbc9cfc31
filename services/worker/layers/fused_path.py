"""Which implementation runs a decoder layer's small fused ops (RMSNorm with the
residual add, rotary, the MLP's gated activation).

- CUDA tensors, Triton installed: the Triton kernels (``kernels/fused_norm.py``,
  ``fused_rotary.py``, ``fused_activation.py``), one launch per op;
- CPU tensors: the C++ kernels (``kernels.cpu_fused``) where each layer's own
  conditions hold (fp32 / bf16, the extension built, ...);
- anything else, and every module built with ``fused=False``: the torch ops
  (``kernels.reference``), which both kernel families are tested against.

``use_triton`` is the first decision, a function of device, dtype and availability so
that it is tested without a GPU. The layers import a Triton kernel module only when
they first take that path: Triton reads ``TRITON_INTERPRET`` when it decorates a
kernel, and a CPU test session sets it only before its kernel tests import them.
"""

from __future__ import annotations

import torch

from kernels.triton_utils import HAS_TRITON

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def use_triton(fused: bool, device: torch.device, dtype: torch.dtype,
               has_triton: bool = HAS_TRITON) -> bool:
    """True when a fused module's op on a tensor of this device and dtype runs as a
    Triton kernel: CUDA, a float dtype the kernels take, Triton installed."""
    return fused and has_triton and device.type == "cuda" and dtype in TRITON_DTYPES
