"""The token embedding, split over the vocabulary across tensor-parallel ranks.

Each rank holds rows ``[start, start + rows)`` of the (padded) embedding table; a rank
looks up the ids in its range, writes zeros for the others, and the all-reduce sums
the ranks' rows into the full embeddings. With one rank it is a plain lookup. The
same rows serve as the rank's slice of a tied lm_head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.parallel import SINGLE, TensorParallel


class VocabEmbedding(nn.Module):
    def __init__(self, rows: int, hidden_size: int, start: int = 0,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)
        self.start = start
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)
