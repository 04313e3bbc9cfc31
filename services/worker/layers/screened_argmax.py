"""The greedy tokens of an fp32 model's CPU decode steps without the full fp32 LM head:
the LM head in bf16 finds the few columns that can hold each row's largest logit, and
the fp32 LM head runs on those alone. The tokens are the full fp32 head's argmax, bit
for bit (the first index of the largest logit), not an approximation of it.

Why: the LM head is a fifth of an fp32 SmolLM2 decode step's FLOPs (49,152 x 576 of ~268k
weights a token) and its largest read at one row (113 MB of 540). cpu_gemm's bf16 tiles
multiply at twice the fp32 rate on a CPU with AVX512-BF16 and read half the bytes.

How it stays exact. For a row h of hidden states (fp32) and a weight row w (fp32) let L
be the fp32 head's logit (cpu_gemm's fp32 tiles), A the bf16 head's unrounded sum of
bf16(w) . bf16(h) and s its bf16 output. With K the hidden size, u = 2^-24 and
g = K u / (1 - K u) (the bound on any fp32 summation order of K terms), Cauchy-Schwarz
and the triangle inequality give

    |A - L| <= (g |w^|max + |w^ - w|max) |h^| + |w|max |h^ - h| + g |w|max |h| = b

(w^, h^ the bf16 copies, |.|max the largest row norm of the head; b also takes the
denormals that bf16 dot products flush, a few 2^-126), and the bf16 output rounds to
nearest even, |s - A| <= rel |s| with rel = 2^-8 / (1 - 2^-8). Every s then lies within
b + rel |s| of its L; ``kernels.cpu_fused.screen_columns`` keeps each
column whose highest possible L reaches the lowest possible L of its row's top s. A
dropped column's logit is below that row's top one, so the argmax (and every column tied
with it) is kept. The kept columns of all rows, ascending, are packed and multiplied by
the fp32 tiles, which sum each column on its own in the same order whatever the other
columns are, so each of those logits equals the full head's, and their first largest is
the full argmax. Rows with a non-finite hidden state, or a screen that keeps more than
``MAX_KEPT_FRACTION`` of the vocabulary, take the full fp32 head instead; a head whose
screen does that in most of its first ``PROBATION_CALLS`` calls (a bound too wide for its
logits' spread) is turned off.
"""

from __future__ import annotations

import logging

import torch

from kernels import cpu_fused, cpu_gemm
from services.worker.cpu_memory import HugePageArena
from services.worker.layers.linear import PackedWeight

_U = 2.0**-24  # fp32 unit roundoff
_REL = 2.0**-8 / (1 - 2.0**-8)  # a bf16 output against its own magnitude
# bf16 dot products treat denormal inputs and results as zero, and the bf16 output flushes
# denormals: each costs at most this much (times the term's other factor for an input)
_FLUSH = 2.0**-126
_SLACK = 1.001  # over the bound's own float64 rounding
_NORM_ROWS = 4096  # head rows a slice when measuring its row norms
# above this share of the vocabulary kept, the two heads cost more than the full one
MAX_KEPT_FRACTION = 0.125
# a head whose bound keeps too many columns too often pays for both heads on those calls:
# after this many calls, more than half of them falling back turns the screen off
PROBATION_CALLS = 64

log = logging.getLogger(__name__)


class ScreenedArgmax:
    """The full fp32 head's argmax of [R, K] fp32 hidden states (``__call__``), or None
    where the full head is needed (a non-finite row, too many columns kept)."""

    def __init__(self, weight: torch.Tensor, packed: PackedWeight) -> None:
        """``weight``: the fp32 [V, K] LM head, ``packed``: its cpu_gemm packing (the one
        the full head multiplies with)."""
        if weight.dtype != torch.float32 or not packed.gemm or packed.silu_gated:
            raise ValueError("the screened argmax needs an fp32 LM head packed for cpu_gemm")
        self.weight = weight
        self.vocab, self.hidden = weight.shape
        wb = weight.detach().bfloat16()
        # on huge pages, as the full head (pack_cpu_linears): a step streams it
        self.bf16_packed = HugePageArena().place(cpu_gemm.pack(wb))
        k = self.hidden
        self._g = k * _U / (1 - k * _U)
        # the head's largest row norms, in float64 a slice of rows at a time (the whole
        # head in float64 twice took ~0.65 GB and 0.85 s of a SmolLM2 worker's start)
        self._w_max = self._wb_max = self._w_err_max = wb_entry_max = 0.0
        for start in range(0, self.vocab, _NORM_ROWS):
            w = weight.detach()[start:start + _NORM_ROWS].double()
            wbd = wb[start:start + _NORM_ROWS].double()
            self._w_max = max(self._w_max, float(w.norm(dim=1).max()))
            self._wb_max = max(self._wb_max, float(wbd.norm(dim=1).max()))
            self._w_err_max = max(self._w_err_max, float((wbd - w).norm(dim=1).max()))
            wb_entry_max = max(wb_entry_max, float(wbd.abs().max()))
        # a denormal h^ entry (read as 0) times its weight, a flushed partial sum, per
        # term; and the flushed output
        self._flush = (k * (wb_entry_max + 1.0) + 1.0) * _FLUSH
        self.max_kept = max(1, int(self.vocab * MAX_KEPT_FRACTION))
        self.active = True  # False: every call returns None (see PROBATION_CALLS)
        self._calls = 0
        self._too_wide = 0

    @classmethod
    def build(cls, weight: torch.Tensor, packed: PackedWeight | None) -> ScreenedArgmax | None:
        """One where it pays and applies: a CPU fp32 head packed for cpu_gemm, finite, on a
        build whose bf16 tiles multiply in bf16 (AVX512-BF16); else None."""
        if (packed is None or not packed.gemm or packed.silu_gated or weight.device.type != "cpu"
                or weight.dtype != torch.float32 or weight.dim() != 2
                or not cpu_fused.available() or not cpu_gemm.available()
                or cpu_gemm.tile_paths().get(torch.bfloat16) != "avx512"
                or not bool(torch.isfinite(weight).all())):
            return None
        return cls(weight, packed)

    def bounds(self, hidden: torch.Tensor, hidden_bf16: torch.Tensor) -> torch.Tensor:
        """[R] float64: the most a row's bf16 logit sum can differ from its fp32 logit."""
        h = hidden.double()
        hb = hidden_bf16.double()
        h_norm, hb_norm, diff_norm = h.norm(dim=1), hb.norm(dim=1), (hb - h).norm(dim=1)
        b = ((self._g * self._wb_max + self._w_err_max) * hb_norm + self._w_max * diff_norm
             + self._g * self._w_max * h_norm + self._flush)
        return b * _SLACK

    @torch.inference_mode()
    def __call__(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if hidden.dtype != torch.float32 or hidden.dim() != 2 or hidden.shape[1] != self.hidden:
            raise ValueError(f"hidden must be [R, {self.hidden}] float32, got "
                             f"{tuple(hidden.shape)} {hidden.dtype}")
        if hidden.shape[0] == 0 or not self.active:
            return None
        hidden_bf16 = hidden.bfloat16()
        bounds = self.bounds(hidden, hidden_bf16)
        if not bool(torch.isfinite(bounds).all()):  # a NaN or inf in h (or inf in bf16)
            return None
        screen = cpu_gemm.linear(hidden_bf16, self.bf16_packed, self.vocab, None)
        kept = cpu_fused.screen_columns(screen, bounds, _REL)
        self._calls += 1
        if kept.numel() > self.max_kept:
            self._too_wide += 1
            if self._calls >= PROBATION_CALLS and 2 * self._too_wide > self._calls:
                self.active = False
                log.warning("the screened greedy head kept more than %d of %d columns in %d of "
                            "%d calls; greedy steps take the full LM head from now on",
                            self.max_kept, self.vocab, self._too_wide, self._calls)
            return None
        rows = self.weight.index_select(0, kept)  # the full head's kernel, on these alone
        exact = cpu_gemm.linear(hidden, cpu_gemm.pack(rows), kept.numel(), None)
        return kept.index_select(0, cpu_fused.argmax_rows(exact))
