"""RMSNorm with an optional fused residual add (the pre-norm of every decoder layer).

On CUDA it runs as one Triton kernel (``kernels.fused_norm``), on the CPU in fp32 /
bf16 as one C++ kernel (``kernels.cpu_fused``) where that extension builds, both with
the torch path's rounding; elsewhere, and with ``fused=False``, the torch ops
(``kernels.reference.rms_norm``). See ``fused_path.py``.
``unit_offset`` is Gemma's variant: the scale is ``1 + weight``, applied in fp32 before
the one rounding to the activation dtype (HF's Gemma2RMSNorm / Gemma3RMSNorm).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import cpu_fused, reference
from services.worker.layers.fused_path import use_triton


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, fused: bool = True,
                 unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.fused = fused
        self.unit_offset = unit_offset
        # unit_offset: 1 + weight in fp32, set by finish_loading (the checkpoint's weight
        # is kept as it is, for the loader and the tests)
        self.register_buffer("offset_weight", None, persistent=False)

    @torch.no_grad()
    def finish_loading(self) -> None:
        if self.unit_offset:
            self.offset_weight = 1.0 + self.weight.float()

    def _offset_weight(self) -> torch.Tensor:
        if self.offset_weight is None:
            raise RuntimeError("RMSNorm(unit_offset=True) used before finish_loading()")
        return self.offset_weight

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual); residual None means x alone."""
        # the C++ kernel scales the norm rounded to x's dtype: (1 + w) * x rounds once,
        # as HF's Gemma norm does, only where that dtype is fp32 (the Triton one has both)
        weight = self.weight if not self.unit_offset else self._offset_weight()
        if (
            use_triton(self.fused, x.device, x.dtype) and weight.is_floating_point()
            and (residual is None or residual.dtype == x.dtype)
        ):
            from kernels import fused_norm  # at first use: see fused_path.py

            return fused_norm.rms_norm(x, residual, weight, self.eps, self.unit_offset)
        if (
            self.fused and x.is_cpu and x.dtype in cpu_fused.DTYPES
            and weight.dtype == x.dtype and (residual is None or residual.dtype == x.dtype)
            and cpu_fused.available()
        ):
            return cpu_fused.rms_norm(x, residual, weight, self.eps)
        # computed in fp32 whatever the activation dtype, as HF does
        return reference.rms_norm(x, residual, weight, self.eps, self.unit_offset)
