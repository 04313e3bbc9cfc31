"""Structured output on the worker: the step's grammar bitmasks applied to the logits.

The scheduler owns the grammar matchers (``services/scheduler/structured_output.py``) and
sends, with each step, one packed row per sequence that samples under a grammar
(``StepBatch.grammar_seq_ids`` / ``grammar_bitmasks``: ``ceil(V / 32)`` little-endian int32
words; bit j of word w allows token ``32 w + j``). The sampler sets every other logit of
those rows to ``-inf`` before temperature, top-k/top-p/min-p and the argmax, so greedy and
sampled rows alike only pick allowed tokens; rows without a grammar are not touched, and a
step without one costs nothing. Logprobs stay those of the raw logits.

Unpacking: on the CPU, numpy's ``unpackbits`` (bit order little) then one ``masked_fill_``;
on an accelerator, shifts on the device (only the packed words are copied). Batch 64 x
vocab 49,152 on 2 cores (median): 1.0-1.2 ms, against 10 ms for xgrammar's CPU
``apply_token_bitmask_inplace`` and 1.6 ms for unpacking with torch shifts on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class GrammarBitmask:
    """The masked rows of one step's sampler batch."""

    rows: torch.Tensor  # [G] int64 rows of the [B, V] logits
    words: np.ndarray  # [G, ceil(V / 32)] little-endian int32, as the scheduler sent them

    @classmethod
    def from_bytes(cls, rows: list[int], data: bytes, vocab_size: int,
                   device: torch.device) -> GrammarBitmask:
        width = (vocab_size + 31) // 32
        if len(data) != len(rows) * width * 4:
            raise ValueError(f"{len(data)} bitmask bytes for {len(rows)} rows of "
                             f"{width} words (vocab {vocab_size})")
        words = np.frombuffer(data, dtype="<i4").reshape(len(rows), width)
        return cls(torch.tensor(rows, dtype=torch.int64, device=device), words)


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def allowed_tokens(words: np.ndarray, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[G, W] packed words -> [G, V] bool, True where the token is allowed."""
    if device.type == "cpu":
        bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
        return torch.from_numpy(bits.view(np.bool_))
    return unpack_on_device(torch.from_numpy(words.astype(np.int32)).to(device), vocab_size)


def unpack_on_device(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[G, W] int32 words on any device -> [G, V] bool there (shifts; copies only words)."""
    shifts = _SHIFTS.get(packed.device)
    if shifts is None:
        shifts = _SHIFTS[packed.device] = torch.arange(32, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 1).view(len(packed), -1)[:, :vocab_size].bool()


def apply_grammar_bitmask(logits: torch.Tensor, mask: GrammarBitmask) -> torch.Tensor:
    """Set the disallowed tokens of the masked rows to -inf. In place on [B, V] logits."""
    num_rows, vocab_size = logits.shape
    allowed = allowed_tokens(mask.words, vocab_size, logits.device)  # [G, V]
    if len(mask.words) == num_rows and torch.equal(
            mask.rows, torch.arange(num_rows, device=mask.rows.device)):
        return logits.masked_fill_(allowed.logical_not_(), float("-inf"))
    sub = logits.index_select(0, mask.rows).masked_fill_(allowed.logical_not_(), float("-inf"))
    return logits.index_copy_(0, mask.rows, sub)
