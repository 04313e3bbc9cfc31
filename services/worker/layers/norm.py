"""RMSNorm with an optional fused residual add (the pre-norm of every decoder layer).

On the CPU in fp32 / bf16 it runs as one C++ kernel (``kernels.cpu_fused``, same
rounding) where that extension builds; ``fused=False`` keeps the torch ops.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import cpu_fused


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, fused: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.fused = fused

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # computed in fp32 whatever the activation dtype, as HF does
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual); residual None means x alone."""
        if (
            self.fused and x.is_cpu and x.dtype in cpu_fused.DTYPES
            and self.weight.dtype == x.dtype and (residual is None or residual.dtype == x.dtype)
            and cpu_fused.available()
        ):
            return cpu_fused.rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        return self._norm(x), x
