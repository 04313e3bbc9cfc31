"""The Triton import guard: kernel modules import on machines without Triton or a GPU.

Every kernel module imports ``triton`` and ``tl`` from here, never directly. When
Triton is missing, ``triton`` and ``tl`` are placeholders whose ``jit`` returns the
function unchanged and whose ``constexpr`` is a plain annotation, so the decorated
kernels still define (they are never launched: the launchers check ``HAS_TRITON``).
Adapted idea: vLLM ``vllm/triton_utils/importing.py`` (TritonPlaceholder).

Interpreter mode (``TRITON_INTERPRET=1``) is read by Triton when a kernel is
*decorated*, i.e. when its module is imported; set it before importing a kernel module.
Its fp32 -> bf16 cast truncates where the compiled one rounds to nearest even:
``round_to`` (for kernels whose tests check torch's rounding bit for bit) rounds by
hand there: launchers pass ``RNE_BY_HAND=interpret_mode()`` as read when their module
was imported (the fused_*.py kernels).
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised on machines without Triton
    HAS_TRITON = False

    class _Placeholder(types.ModuleType):
        """Stands in for ``triton`` / ``triton.language``: decorators pass through."""

        def __init__(self, name: str) -> None:
            super().__init__(name)
            self.constexpr = Any  # used only in annotations
            self.dtype = Any

        def jit(self, fn: Any = None, **_: Any) -> Any:
            return fn if fn is not None else (lambda f: f)

        def cdiv(self, a: int, b: int) -> int:
            return -(-a // b)

        def next_power_of_2(self, n: int) -> int:
            return 1 << max(0, n - 1).bit_length()

        def __getattr__(self, name: str) -> Any:
            raise RuntimeError(f"Triton is not installed: triton.{name} is unavailable")

    triton = _Placeholder("triton")  # type: ignore[assignment]
    tl = _Placeholder("triton.language")  # type: ignore[assignment]

__all__ = [
    "HAS_TRITON", "check_launchable", "interpret_mode", "next_pow2", "round_to", "tl", "triton",
]


def interpret_mode() -> bool:
    """True when Triton runs kernels in its numpy interpreter (CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_launchable(*tensors: torch.Tensor) -> None:
    """Raises a clear error where a kernel launch would fail further down."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed; use the torch attention backend")
    if interpret_mode():
        return  # the interpreter takes CPU tensors
    for t in tensors:
        if t.device.type != "cuda":
            raise RuntimeError(
                f"Triton kernels need CUDA tensors (got {t.device}); "
                "set TRITON_INTERPRET=1 before importing kernels to run on the CPU"
            )


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@triton.jit
def round_to(x, dtype: tl.constexpr, RNE_BY_HAND: tl.constexpr):
    """fp32 ``x`` rounded to nearest even in ``dtype``, as torch's ``.to(dtype)``.

    Compiled, that is the plain cast. RNE_BY_HAND (the interpreter, whose bf16 cast
    truncates): bf16 by integer ops on the fp32 bits (add 0x7FFF plus the lowest kept
    bit, drop the low 16 bits; inf stays inf, NaN is truncated, so stays NaN)."""
    y = x.to(dtype)
    # nested, not `and`: the compiled kernel never evaluates the inner test
    if RNE_BY_HAND:  # noqa: SIM102 (never compiled: the interpreter reads this branch only)
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            rounded = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            y = tl.where(x != x, y, rounded)  # noqa: PLR0124 (x != x: NaN)
    return y
