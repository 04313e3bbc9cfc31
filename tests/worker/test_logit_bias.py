"""``logit_bias`` in the sampler: added to the logits of the rows that have one, for the
whole batch at once, before penalties and sampling; logprobs stay those of the raw model
distribution; rows without a bias (and batches without any) are untouched."""

from __future__ import annotations

import torch

from services.worker.sampler import Sampler, SamplingMetadata, SamplingRow, apply_logit_bias
from shared.sampling_params import SamplingParams

VOCAB = 64


def row(**params: object) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), [1, 2], [])  # type: ignore[arg-type]


def test_bias_moves_greedy_and_sampled_rows_and_leaves_the_rest() -> None:
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0))
    top = logits.argmax(dim=-1).tolist()
    second = logits.topk(2, dim=-1).indices[:, 1].tolist()
    rows = [
        row(temperature=0.0),  # no bias: its argmax
        row(temperature=0.0, logit_bias={7: 100.0}),  # a huge bias wins
        row(temperature=0.0, logit_bias={top[2]: -100.0}, logprobs=1),  # the argmax banned
        row(temperature=1.0, seed=3, logit_bias={9: 100.0}),  # sampled: ~certain
        row(temperature=0.8, seed=4, repetition_penalty=1.5, logit_bias={11: 100.0, 12: -5.0}),
    ]
    out = Sampler(VOCAB, [0])(logits.clone(), rows)
    assert out.sampled_token_ids.tolist() == [top[0], 7, second[2], 9, 11]
    # logprobs from the raw logits: the banned argmax is still rank 1 there
    lp = out.logprobs[2]
    assert lp is not None and lp.top_token_ids == [top[2]] and lp.rank == 2


def test_metadata_is_none_without_a_bias_and_adds_exactly_the_bias() -> None:
    assert SamplingMetadata.from_rows([row(temperature=0.0)] * 3, VOCAB, [0]).logit_bias is None
    rows = [row(logit_bias={3: 1.5, 60: -2.0}), row(), row(logit_bias={3: -0.5})]
    meta = SamplingMetadata.from_rows(rows, VOCAB, [0])
    assert not meta.is_plain_greedy
    logits = torch.zeros(3, VOCAB)
    apply_logit_bias(logits, meta)
    expected = torch.zeros(3, VOCAB)
    expected[0, 3], expected[0, 60], expected[2, 3] = 1.5, -2.0, -0.5
    assert torch.equal(logits, expected)
