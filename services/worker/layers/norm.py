"""RMSNorm with an optional fused residual add (the pre-norm of every decoder layer).

On the CPU in fp32 / bf16 it runs as one C++ kernel (``kernels.cpu_fused``, same
rounding) where that extension builds; ``fused=False`` keeps the torch ops.
``unit_offset`` is Gemma's variant: the scale is ``1 + weight``, applied in fp32 before
the one rounding to the activation dtype (HF's Gemma2RMSNorm / Gemma3RMSNorm).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import cpu_fused


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

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # computed in fp32 whatever the activation dtype, as HF does
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (xf * self._offset_weight()).to(x.dtype)
        return self.weight * xf.to(x.dtype)

    def _offset_weight(self) -> torch.Tensor:
        if self.offset_weight is None:
            raise RuntimeError("RMSNorm(unit_offset=True) used before finish_loading()")
        return self.offset_weight

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual); residual None means x alone."""
        # the fused kernel scales the norm rounded to x's dtype: (1 + w) * x rounds once,
        # as HF's Gemma norm does, only where that dtype is fp32
        weight = self.weight if not self.unit_offset else self._offset_weight()
        if (
            self.fused and x.is_cpu and x.dtype in cpu_fused.DTYPES
            and weight.dtype == x.dtype and (residual is None or residual.dtype == x.dtype)
            and cpu_fused.available()
        ):
            return cpu_fused.rms_norm(x, residual, weight, self.eps)
        if residual is not None:
            x = x + residual
        return self._norm(x), x
