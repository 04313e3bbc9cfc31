"""Tests of services/worker/sampler.py against torch oracles and per-element loop references."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from services.worker.sampler import (
    TOP_P_CANDIDATES,
    Sampler,
    SamplingMetadata,
    SamplingRow,
    _top_k_mask,
    _top_p_mask,
    apply_min_tokens,
    apply_penalties,
    mix_seed,
)
from shared.sampling_params import SamplingParams

EOS = 3


def row(
    prompt: Sequence[int] = (1, 2), output: Sequence[int] = (), **params: Any
) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt), list(output))


def metadata(rows: list[SamplingRow], vocab: int) -> SamplingMetadata:
    return SamplingMetadata.from_rows(rows, vocab, [EOS])


def sample(
    logits: torch.Tensor, rows: list[SamplingRow], seed: int = 0
) -> tuple[list[int], list]:
    out = Sampler(logits.shape[1], [EOS], seed=seed)(logits, rows)
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.sampled_token_ids.shape == (len(rows),)
    return out.sampled_token_ids.tolist(), out.logprobs


def frequencies(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


def chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    """Pearson statistic over the tokens with expected count > 0."""
    observed = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
    expected = probs.double() * len(tokens)
    support = expected > 0
    assert observed[~support].sum() == 0, "a token with probability 0 was drawn"
    return float(((observed[support] - expected[support]) ** 2 / expected[support]).sum())


# --- greedy and logprobs ---------------------------------------------------------------


def test_greedy_is_argmax_in_fast_and_general_paths() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 1000)
    expected = logits.argmax(dim=-1).tolist()
    fast, _ = sample(logits, [row(temperature=0.0) for _ in range(16)])
    assert fast == expected
    # greedy rows among sampled rows (general path) still take the argmax
    mixed = [row(temperature=0.0) if i % 2 else row(temperature=1.0) for i in range(16)]
    tokens, _ = sample(logits, mixed)
    assert tokens[1::2] == expected[1::2]


def test_bf16_logits_sample_as_their_fp32_copy_does() -> None:
    """The runner hands the sampler the LM head's bf16 logits (no fp32 copy): the plain
    greedy path takes their argmax as they are, the general path widens them; tokens and
    logprobs are those of the fp32 copy, seeded draws included."""
    torch.manual_seed(3)
    logits = torch.randn(12, 4000).bfloat16()  # bf16 rounding makes ties: the first wins
    greedy = [row(temperature=0.0) for _ in range(12)]
    assert sample(logits, greedy)[0] == sample(logits.float(), greedy)[0]
    assert sample(logits, greedy)[0] == logits.float().argmax(dim=-1).tolist()
    mixed = [row(temperature=0.0, logprobs=2) if i % 3 == 0 else
             row(temperature=0.8, top_p=0.9, seed=i, logprobs=1) if i % 3 == 1 else
             row(temperature=0.0, repetition_penalty=1.5, output=[7, 9]) for i in range(12)]
    tokens, logprobs = sample(logits, mixed, seed=5)
    tokens_fp32, logprobs_fp32 = sample(logits.float(), mixed, seed=5)
    assert tokens == tokens_fp32 and logprobs == logprobs_fp32


def test_sampler_does_not_modify_the_logits() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 50)
    before = logits.clone()
    rows = [
        row(temperature=0.0, repetition_penalty=2.0, output=[4, 5]),
        row(temperature=1.0, min_tokens=2, top_p=0.5),
        row(temperature=0.5, frequency_penalty=1.0, output=[1, 1]),
    ]
    sample(logits, rows)
    assert torch.equal(logits, before)


def test_logits_shape_is_checked() -> None:
    with pytest.raises(ValueError):
        Sampler(10, [EOS])(torch.zeros(2, 11), [row(), row()])


def test_logprobs_are_log_softmax_of_raw_logits() -> None:
    torch.manual_seed(2)
    vocab = 300
    logits = torch.randn(6, vocab) * 3
    rows = [
        row(temperature=0.0, logprobs=5),
        row(temperature=1.0, logprobs=0),
        row(temperature=0.0),  # no logprobs
        row(temperature=0.7, top_k=10, logprobs=20, repetition_penalty=3.0, output=[5, 6]),
        row(temperature=0.0, logprobs=1, frequency_penalty=2.0, output=list(range(0, 300, 2))),
        row(temperature=1.3, logprobs=3, min_tokens=4),
    ]
    tokens, logprobs = sample(logits, rows)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert logprobs[2] is None
    for i, lp in enumerate(logprobs):
        if i == 2:
            continue
        assert lp is not None
        k, tok = rows[i].params.logprobs, tokens[i]
        assert lp.logprob == pytest.approx(float(ref[i, tok]), abs=1e-5)
        assert lp.rank == 1 + int((ref[i] > ref[i, tok]).sum())
        assert len(lp.top_token_ids) == len(lp.top_logprobs) == k
        assert lp.top_token_ids == (ref[i].topk(k).indices.tolist() if k else [])
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
        for tid, value in zip(lp.top_token_ids, lp.top_logprobs, strict=True):
            assert value == pytest.approx(float(ref[i, tid]), abs=1e-5)
    assert logprobs[0].rank == 1  # greedy, unpenalised


def test_logprobs_ignore_the_min_tokens_mask() -> None:
    logits = torch.zeros(1, 10)
    logits[0, EOS], logits[0, 6] = 5.0, 4.0
    tokens, logprobs = sample(logits, [row(temperature=0.0, min_tokens=1, logprobs=2)])
    assert tokens == [6]  # EOS is masked for sampling ...
    ref = torch.log_softmax(logits, dim=-1)[0]
    assert logprobs[0].rank == 2  # ... but not for the reported distribution
    assert logprobs[0].logprob == pytest.approx(float(ref[6]), abs=1e-6)
    assert logprobs[0].top_token_ids == [EOS, 6]


# --- seeds -----------------------------------------------------------------------------


def _seeded_token(
    target: SamplingRow, x: torch.Tensor, neighbours: list[SamplingRow], at: int, seed: int
) -> int:
    """Sample `target` (logits x [V]) at batch position `at` among random neighbours."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(neighbours) + 1, x.numel(), generator=gen) * 2
    rows = list(neighbours)
    rows.insert(at, target)
    logits[at] = x
    sampler = Sampler(x.numel(), [EOS], seed=seed)
    sampler(logits, rows)  # earlier steps must not matter
    return int(sampler(logits, rows).sampled_token_ids[at])


@pytest.mark.parametrize(
    "extra", [{}, {"top_p": 0.9}, {"top_k": 20, "min_p": 0.01}, {"top_k": 50, "top_p": 0.95}]
)
def test_seeded_row_ignores_its_batch(extra: dict) -> None:
    vocab = 500
    x = torch.randn(vocab, generator=torch.Generator().manual_seed(3))
    others = [
        row(temperature=0.0),
        row(temperature=1.0),
        row(temperature=0.8, seed=99, output=[1, 2, 3]),
        row(temperature=1.0, top_k=5),
        row(temperature=1.2, top_p=0.5, repetition_penalty=1.5, output=[7]),
        row(temperature=1.0, min_p=0.2, logprobs=3),
    ]
    for seed in range(12):
        target = row(temperature=1.0, seed=seed, output=[0] * 7, **extra)
        batches = [
            ([], 0, 0),
            (others[:2], 1, 1),
            (others, 6, 2),
            (others[2:], 0, 3),
            (others[::-1], 3, 4),
            ([row(temperature=1.0, seed=seed, output=[0] * 7, **extra)] * 3, 2, 5),
        ]
        tokens = {_seeded_token(target, x, n, at, s) for n, at, s in batches}
        assert len(tokens) == 1, f"seed {seed}: {tokens}"


def test_seeded_draws_differ_across_seeds_and_positions() -> None:
    vocab = 500
    logits = torch.zeros(1, vocab)
    sampler = Sampler(vocab, [EOS], seed=0)
    by_seed = {int(sampler(logits, [row(seed=s)]).sampled_token_ids[0]) for s in range(30)}
    by_position = {
        int(sampler(logits, [row(seed=7, output=[0] * n)]).sampled_token_ids[0])
        for n in range(30)
    }
    assert len(by_seed) > 20 and len(by_position) > 20
    # and a seed is a seed: the same (seed, position) repeats across samplers
    again = Sampler(vocab, [EOS], seed=123)
    assert int(again(logits, [row(seed=7, output=[0] * 4)]).sampled_token_ids[0]) == int(
        sampler(logits, [row(seed=7, output=[0] * 4)]).sampled_token_ids[0]
    )


def test_mix_seed_is_64_bit_and_spreads() -> None:
    values = {mix_seed(s, p) for s in (-(2**63), -1, 0, 1, 2**63 - 1) for p in range(50)}
    assert len(values) == 250
    assert all(0 <= v < 2**64 for v in values)


# --- distributions and exclusions ------------------------------------------------------


def test_temperature_sampling_matches_softmax() -> None:
    torch.manual_seed(4)
    vocab, n = 10, 20000
    x = torch.randn(vocab) * 1.5
    probs = torch.softmax(x / 0.7, dim=-1)
    tokens, _ = sample(x.expand(n, vocab).clone(), [row(temperature=0.7)] * n, seed=5)
    # chi-square, 9 degrees of freedom: 27.9 is the 0.1% tail
    assert chi_square(tokens, probs) < 27.9
    assert (frequencies(tokens, vocab) - probs.double()).abs().max() < 0.015


def test_seeded_rows_sample_the_right_distribution() -> None:
    torch.manual_seed(6)
    vocab, n = 8, 4000
    x = torch.randn(vocab)
    probs = torch.softmax(x, dim=-1)
    rows = [row(temperature=1.0, seed=s) for s in range(n)]
    tokens, _ = sample(x.expand(n, vocab).clone(), rows)
    assert chi_square(tokens, probs) < 24.3  # 7 degrees of freedom, 0.1% tail


def _constructed_logits(vocab: int = 64) -> tuple[torch.Tensor, list[int]]:
    """Logits whose softmax is known: the 5 head tokens, then a flat tail of mass 0.05."""
    head = [0.4, 0.25, 0.15, 0.1, 0.05]
    tail = [0.05 / (vocab - len(head))] * (vocab - len(head))
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(7)).tolist()
    probs = torch.zeros(vocab)
    probs[order] = torch.tensor(head + tail)
    return probs.log(), order  # order[i] = id of the i-th most likely token


@pytest.mark.parametrize(
    ("params", "kept"),
    [
        ({"top_k": 3}, 3),
        ({"top_k": 1}, 1),
        ({"top_p": 0.75}, 3),  # cumulative 0.4, 0.65 (< 0.75), 0.80
        ({"top_p": 0.3}, 1),
        ({"min_p": 0.3}, 3),  # threshold 0.12
        ({"top_k": 4, "top_p": 0.75}, 3),
        # top-p on the renormalised top-2 (0.62, 0.38): the top token alone reaches 0.6
        ({"top_k": 2, "top_p": 0.6}, 1),
        ({"top_k": 4, "min_p": 0.3}, 3),
        ({"top_p": 0.93, "min_p": 0.2}, 4),  # top-p keeps 5, min-p (0.08) drops the 5th
    ],
)
def test_filters_never_emit_an_excluded_token(params: dict, kept: int) -> None:
    vocab, n = 64, 4000
    x, order = _constructed_logits(vocab)
    logits = x.expand(n, vocab).clone()
    # half the rows unseeded (one batched draw), half seeded (per-row generators)
    rows = [row(temperature=1.0, **params) if i % 2 else row(seed=i, **params) for i in range(n)]
    tokens, _ = sample(logits, rows)
    assert set(tokens) == set(order[:kept])
    probs = torch.zeros(vocab)
    probs[order[:kept]] = torch.softmax(x, dim=-1)[order[:kept]]
    assert chi_square(tokens, probs / probs.sum()) < 16.3  # <= 3 degrees of freedom


def _ref_top_p_mask(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Full sort of every row, no candidate tiers."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    positions = torch.arange(probs.shape[1])
    keep = torch.zeros_like(probs, dtype=torch.bool)
    for i, (k, p) in enumerate(zip(top_k, top_p, strict=True)):
        s = sorted_p[i].masked_fill(positions >= k, 0.0)
        cum = s.cumsum(dim=0)
        keep[i, order[i]] = (cum - s) < p * cum[-1]
    return keep


def test_top_p_candidate_tiers_match_a_full_sort() -> None:
    torch.manual_seed(8)
    vocab = 6000
    assert TOP_P_CANDIDATES[-1] < vocab  # every tier and the final sort get rows
    scales = [0.02, 0.5, 1.5, 3.0, 6.0, 12.0]
    cases = [(s, k, p) for s in scales for k in (vocab, 3, 300) for p in (0.1, 0.5, 0.9, 0.99)]
    scale = torch.tensor([[c[0]] for c in cases])
    probs = torch.softmax(torch.randn(len(cases), vocab) * scale, dim=-1)
    top_k = [c[1] for c in cases]
    top_p = [c[2] for c in cases]
    got = _top_p_mask(probs, torch.tensor(top_k), torch.tensor(top_p).view(-1, 1), 300)
    want = _ref_top_p_mask(probs, top_k, top_p)
    sizes = want.sum(dim=-1)
    assert sizes.max() > TOP_P_CANDIDATES[-1] and sizes.min() >= 1  # the cases reach every tier
    assert torch.equal(got, want)


def test_top_k_mask_keeps_exactly_k() -> None:
    torch.manual_seed(9)
    probs = torch.softmax(torch.randn(5, 100), dim=-1)
    k = torch.tensor([1, 2, 7, 50, 99])
    keep = _top_k_mask(probs, k, 99)
    assert keep.sum(dim=-1).tolist() == k.tolist()
    for i in range(5):
        want = probs[i].topk(int(k[i])).indices.tolist()
        assert set(keep[i].nonzero().view(-1).tolist()) == set(want)


# --- penalties -------------------------------------------------------------------------


def _ref_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    out = logits.clone().double()
    for i, r in enumerate(rows):
        p = r.params
        for t in range(logits.shape[1]):
            v = float(out[i, t])
            if t in r.prompt_token_ids or t in r.output_token_ids:
                v = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
            count = list(r.output_token_ids).count(t)
            v -= p.frequency_penalty * count
            v -= p.presence_penalty * (count > 0)
            out[i, t] = v
    return out.float()


def _random_penalty_rows(rng: random.Random, n: int, vocab: int) -> list[SamplingRow]:
    rows = []
    for _ in range(n):
        choice = rng.random
        rows.append(
            row(
                prompt=[rng.randrange(vocab) for _ in range(rng.randrange(0, 25))],
                output=[rng.randrange(vocab // 2) for _ in range(rng.randrange(0, 20))],
                temperature=0.0,
                repetition_penalty=rng.uniform(0.3, 3.0) if choice() < 0.6 else 1.0,
                frequency_penalty=rng.uniform(-2, 2) if choice() < 0.6 else 0.0,
                presence_penalty=rng.uniform(-2, 2) if choice() < 0.6 else 0.0,
            )
        )
    return rows


@pytest.mark.parametrize("case", range(6))
def test_penalties_match_a_loop_reference(case: int) -> None:
    rng = random.Random(case)
    vocab = 40
    rows = _random_penalty_rows(rng, 8, vocab)
    if case == 0:  # no row with a repetition penalty: prompts are skipped
        rows = [
            row(prompt=r.prompt_token_ids, output=r.output_token_ids, temperature=0.0,
                frequency_penalty=0.5)
            for r in rows
        ]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(case)) * 3
    want = _ref_penalties(logits, rows)
    got = apply_penalties(logits.clone(), metadata(rows, vocab))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # and the greedy token is the argmax of the penalised logits, also beside sampled rows
    tokens, _ = sample(logits, rows)
    assert tokens == want.argmax(dim=-1).tolist()
    mixed, _ = sample(torch.cat([torch.randn(1, vocab), logits]), [row()] + rows)
    assert mixed[1:] == tokens


def test_repetition_penalty_counts_a_token_once() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, 1.0]])
    rows = [row(prompt=[0, 0, 1], output=[0, 1, 1], repetition_penalty=2.0)]
    got = apply_penalties(logits.clone(), metadata(rows, 4))
    assert got.tolist() == [[1.0, -4.0, 2.0, 1.0]]


# --- min_tokens ------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    vocab, stop = 20, 7
    logits = torch.zeros(1, vocab)
    logits[0, EOS], logits[0, stop], logits[0, 11] = 3.0, 2.0, 1.0
    for n_out in range(5):
        rows = [
            row(output=[0] * n_out, temperature=0.0, min_tokens=3, stop_token_ids=[stop, 999])
        ]
        masked = apply_min_tokens(logits.clone(), metadata(rows, vocab))
        banned = {EOS, stop} if n_out < 3 else set()
        assert set(torch.isinf(masked[0]).nonzero().view(-1).tolist()) == banned
        assert sample(logits, rows)[0] == ([11] if n_out < 3 else [EOS])
    ignore = [row(temperature=0.0, min_tokens=3, stop_token_ids=[stop], ignore_eos=True)]
    masked = apply_min_tokens(logits.clone(), metadata(ignore, vocab))
    assert torch.isinf(masked[0]).nonzero().view(-1).tolist() == [stop]
    assert sample(logits, ignore)[0] == [EOS]


def test_min_tokens_applies_per_row_when_sampling() -> None:
    vocab, n = 16, 2000
    logits = torch.zeros(n, vocab)
    logits[:, EOS] = 4.0  # EOS ~78% likely when not masked
    rows = [row(temperature=1.0, min_tokens=2, output=[1] * (i % 3)) for i in range(n)]
    tokens, _ = sample(logits, rows)
    short = [t for i, t in enumerate(tokens) if i % 3 < 2]
    done = [t for i, t in enumerate(tokens) if i % 3 == 2]
    assert EOS not in short
    assert 0.7 < done.count(EOS) / len(done) < 0.86
