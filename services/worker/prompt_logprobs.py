"""Prompt logprobs, computed in the same forward pass as the prefill that needs them.

A sequence whose params ask ``prompt_logprobs = k`` gets, for every prompt token but
the first, that token's logprob under the model's distribution after the tokens before
it, its rank and the top-k alternatives (vLLM's ``prompt_logprobs``; what
``echo`` + ``logprobs`` returns on /v1/completions). The model computes hidden states
for every token of a step anyway; the runner normally runs the LM head only on each
sequence's last row. For a chunk of such a sequence covering prompt positions
``[s, e)``, this module also runs the LM head on the rows at positions
``p in [s, min(e, P - 1))`` (``P`` prompt tokens): row ``p`` scores prompt token
``p + 1``. The row at ``P - 1`` is the sampling row; its successor is the first output
token, not a prompt token.

Log-softmax in float32 over the raw logits (no penalty, bias or temperature: the same
distribution as the sampled tokens' logprobs). Rows go through the LM head in slices
of at most ``MAX_LOGIT_ELEMENTS`` logits, so a 2,048-token chunk with a 152k vocabulary
never holds its [T, V] logits at once. The scheduler keeps such sequences off prefix-cache
hits, so their whole prompt is computed here, chunk by chunk (``docs/architecture.md``).
Sequences that do not ask cost nothing: the runner builds no plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from shared.protocol import PromptLogprobs, TokenLogprobs

# logits held at once per slice of rows (float32: 4 bytes each): 64 MiB
MAX_LOGIT_ELEMENTS = 16 * 1024 * 1024


class LogitsModel(Protocol):
    config: Any  # has vocab_size

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # [N, h] -> [N, V]


class PromptSequence(Protocol):
    """What the plan reads of the runner's per-request state."""

    request_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int  # before this step


@dataclass
class PromptLogprobsPlan:
    """The rows of one step that score prompt tokens, grouped by sequence."""

    request_ids: list[int]
    starts: list[int]  # [S] first prompt token scored (>= 1)
    counts: list[int]  # [S] tokens scored
    top_k: list[int]  # [S]
    row_indices: torch.Tensor  # [N] int64 flat token index (into the step's hidden states)
    target_ids: torch.Tensor  # [N] int64 the prompt token each row scores


def plan_prompt_logprobs(
    seqs: Sequence[tuple[PromptSequence, int]],  # (sequence, its top-k)
    chunk_starts: Sequence[int],  # [S] each sequence's first flat token index this step
    chunk_lens: Sequence[int],  # [S] tokens each computes this step
    device: torch.device,
) -> PromptLogprobsPlan | None:
    request_ids, starts, counts, top_k = [], [], [], []
    rows: list[np.ndarray] = []
    targets: list[int] = []
    for (seq, k), flat, n in zip(seqs, chunk_starts, chunk_lens, strict=True):
        s = seq.num_computed_tokens
        e = min(s + n, seq.num_prompt_tokens - 1)
        if e <= s:
            continue
        request_ids.append(seq.request_id)
        starts.append(s + 1)
        counts.append(e - s)
        top_k.append(k)
        rows.append(np.arange(flat, flat + e - s, dtype=np.int64))
        targets.extend(seq.token_ids[s + 1 : e + 1])
    if not request_ids:
        return None
    return PromptLogprobsPlan(
        request_ids=request_ids, starts=starts, counts=counts, top_k=top_k,
        row_indices=torch.from_numpy(np.concatenate(rows)).to(device),
        target_ids=torch.tensor(targets, dtype=torch.int64, device=device),
    )


def compute_prompt_logprobs(
    model: LogitsModel, hidden: torch.Tensor, plan: PromptLogprobsPlan
) -> list[PromptLogprobs]:
    """``hidden``: [T, hidden] final hidden states of the step. One ``PromptLogprobs`` per
    sequence of the plan, in the plan's order."""
    num_rows = plan.row_indices.numel()
    rows_per_slice = max(1, MAX_LOGIT_ELEMENTS // model.config.vocab_size)
    max_k = max(plan.top_k)
    parts = []
    for a in range(0, num_rows, rows_per_slice):
        rows = plan.row_indices[a : a + rows_per_slice]
        logits = model.compute_logits(hidden.index_select(0, rows)).float()  # [n, V]
        parts.append(_score(logits, plan.target_ids[a : a + rows_per_slice], max_k))
    logprobs, ranks, top_lps, top_ids = (torch.cat(p).tolist() for p in zip(*parts))
    return _entries(plan, logprobs, ranks, top_lps, top_ids)


def _score(
    logits: torch.Tensor, target_ids: torch.Tensor, max_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """[n, V] float32 logits, [n] targets -> logprob [n], rank [n], top-k [n, k] x 2."""
    lp = torch.log_softmax(logits, dim=-1)  # [n, V]
    target_lp = lp.gather(1, target_ids.view(-1, 1))  # [n, 1]
    # 1 + the tokens more likely (ties share the better rank); an int32 sum of the mask is
    # ~2x torch's default int64 one on the CPU
    ranks = (lp > target_lp).sum(dim=-1, dtype=torch.int32) + 1  # [n]
    if max_k:
        top_lp, top_ids = lp.topk(max_k, dim=-1)  # [n, k]
    else:
        top_lp, top_ids = lp[:, :0], target_ids.view(-1, 1)[:, :0]
    return target_lp.view(-1), ranks, top_lp, top_ids


def _entries(plan: PromptLogprobsPlan, logprobs: list[float], ranks: list[int],
             top_lps: list[list[float]], top_ids: list[list[int]]) -> list[PromptLogprobs]:
    out = []
    row = 0
    for rid, start, count, k in zip(plan.request_ids, plan.starts, plan.counts, plan.top_k,
                                    strict=True):
        out.append(PromptLogprobs(rid, start, [
            TokenLogprobs(logprob=logprobs[j], rank=ranks[j], top_token_ids=top_ids[j][:k],
                          top_logprobs=top_lps[j][:k])
            for j in range(row, row + count)
        ]))
        row += count
    return out
