"""Batched sampler: the worker's last stage, from the model's logits to one token per row.

The model runner calls ``Sampler(logits, rows)`` once per step with the last-position
logits of every request that samples this step; the tokens (and logprobs) go back to
the scheduler in a ``StepResult``. Per row, in order (OpenAI / vLLM definitions):

1. min_tokens: until ``min_tokens`` outputs exist, stop ids and (unless ``ignore_eos``)
   EOS ids get logit ``-inf``; ``logit_bias`` is added (OpenAI: before sampling);
2. penalties: repetition (prompt + output), frequency and presence (output only);
   then structured output: a row with a grammar mask keeps only the tokens it allows
   (``grammar_bitmask.py``; ``-inf`` elsewhere; min_tokens does not apply to such a row);
3. greedy rows (temperature below ``GREEDY_EPS``) take the argmax;
4. other rows: logits / temperature -> softmax -> top-k -> top-p (on the top-k
   renormalised distribution) -> min-p, then the exponential race
   ``argmax(probs / E)``, ``E ~ Exp(1)``; an excluded token has probability exactly 0.

A row with a seed draws its ``E`` from a generator seeded by (seed, output position)
only, so its token never depends on its batch neighbours or on the steps before
(a preempted and recomputed request samples the same tokens). Logprobs come from the
raw logits. Everything is vectorised over rows; the per-row Python left is building
the index tensors and the seeded rows' draws.
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels import cpu_fused
from services.worker.grammar_bitmask import GrammarBitmask, apply_grammar_bitmask
from shared.protocol import TokenLogprobs
from shared.sampling_params import SamplingParams

# temperatures below this are greedy (as vLLM's _SAMPLING_EPS): logits / 1e-7 would
# overflow float32 and turn the softmax into NaN
GREEDY_EPS = 1e-5
_MASK64 = (1 << 64) - 1


@dataclass
class SamplingRow:
    """One request's row in this step's batch."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far, before this step's sample


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: list[TokenLogprobs | None]  # per row; None where params.logprobs is None


@dataclass
class PenaltyMetadata:
    """One entry per distinct (row, token) in a penalised row's prompt (only when some row
    has a repetition penalty) or output: penalties touch O(tokens) logits, not [P, V]."""

    token_rows: torch.Tensor  # [N] int64 batch rows
    token_ids: torch.Tensor  # [N] int64
    repetition: torch.Tensor  # [N] float32 the row's repetition penalty
    subtract: torch.Tensor  # [N] float32 frequency * output count + presence * (count > 0)


@dataclass
class LogitBiasMetadata:
    """One entry per (row, token) of the rows with a ``logit_bias``."""

    rows: torch.Tensor  # [N] int64 batch rows
    token_ids: torch.Tensor  # [N] int64 (unique per row: the bias is a dict)
    values: torch.Tensor  # [N] float32 added to those logits


@dataclass
class RandomMetadata:
    """The rows that sample. ``*_pos`` index into these rows, not the batch."""

    rows: torch.Tensor  # [R] int64 batch rows
    temperature: torch.Tensor  # [R, 1] float32
    top_k_pos: torch.Tensor  # [A] rows with top-k and no top-p: one topk call
    top_k: torch.Tensor  # [A] int64 in [1, V)
    top_k_max: int  # max of top_k (0 when A == 0)
    top_p_pos: torch.Tensor  # [S] rows with top-p (and maybe top-k)
    top_p_top_k: torch.Tensor  # [S] int64 in [1, V]; V where top-k is off
    top_p_top_k_max: int  # max of top_p_top_k below V (0 if none)
    top_p: torch.Tensor  # [S, 1] float32
    min_p_pos: torch.Tensor  # [M] rows with min_p > 0
    min_p: torch.Tensor  # [M, 1] float32
    seeded: list[tuple[int, int]]  # (position, generator seed) of seeded rows
    unseeded_pos: torch.Tensor  # [U] the rest, drawn together


@dataclass
class SamplingMetadata:
    """Everything the sampler needs from the rows, built once per step."""

    num_rows: int
    vocab_size: int
    greedy_rows: torch.Tensor  # [G] int64
    random: RandomMetadata | None
    # (row, token id) pairs set to -inf while min_tokens is not reached
    min_tokens_rows: torch.Tensor  # [K] int64
    min_tokens_ids: torch.Tensor  # [K] int64
    penalties: PenaltyMetadata | None
    logprob_rows: torch.Tensor  # [L] int64
    num_logprobs: list[int]  # [L]
    logit_bias: LogitBiasMetadata | None = None  # None: no row has a bias

    @property
    def is_plain_greedy(self) -> bool:
        """All greedy with nothing to mask, penalise or report: one argmax."""
        return (
            self.random is None
            and self.penalties is None
            and self.min_tokens_ids.numel() == 0
            and not self.num_logprobs
            and self.logit_bias is None
        )

    @classmethod
    def from_rows(
        cls,
        rows: Sequence[SamplingRow],
        vocab_size: int,
        eos_token_ids: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        greedy = [i for i, r in enumerate(rows) if r.params.temperature < GREEDY_EPS]
        random = [i for i, r in enumerate(rows) if r.params.temperature >= GREEDY_EPS]
        mt_rows, mt_ids = _min_tokens_pairs(rows, vocab_size, eos_token_ids)
        lp = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        return cls(
            num_rows=len(rows),
            vocab_size=vocab_size,
            greedy_rows=_long(greedy, device),
            random=_random_metadata(rows, random, vocab_size, device) if random else None,
            min_tokens_rows=_long(mt_rows, device),
            min_tokens_ids=_long(mt_ids, device),
            penalties=_penalty_metadata(rows, vocab_size, device),
            logprob_rows=_long(lp, device),
            num_logprobs=[rows[i].params.logprobs or 0 for i in lp],
            logit_bias=_logit_bias_metadata(rows, vocab_size, device),
        )


def _long(values: Sequence[int], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _flat_ids(seqs: Sequence[Sequence[int]], device: torch.device | str) -> torch.Tensor:
    """Concatenate id lists into one [N] int64 tensor (array.array is ~3x torch.tensor)."""
    buf = array.array("q", itertools.chain.from_iterable(seqs))
    if not buf:
        return torch.empty(0, dtype=torch.int64, device=device)
    return torch.frombuffer(buf, dtype=torch.int64).to(device, copy=True)


def _min_tokens_pairs(
    rows: Sequence[SamplingRow], vocab_size: int, eos_token_ids: Sequence[int]
) -> tuple[list[int], list[int]]:
    pair_rows: list[int] = []
    pair_ids: list[int] = []
    for i, r in enumerate(rows):
        # under structured output the grammar decides where the output may end
        if len(r.output_token_ids) >= r.params.min_tokens or r.params.structured_outputs:
            continue
        ids = set(r.params.stop_token_ids)
        if not r.params.ignore_eos:
            ids.update(eos_token_ids)
        ids = {t for t in ids if 0 <= t < vocab_size}  # a user's stop id may be out of vocab
        pair_rows.extend([i] * len(ids))
        pair_ids.extend(sorted(ids))
    return pair_rows, pair_ids


def _logit_bias_metadata(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device | str
) -> LogitBiasMetadata | None:
    biased = [(i, r.params.logit_bias) for i, r in enumerate(rows) if r.params.logit_bias]
    if not biased:
        return None
    pair_rows: list[int] = []
    pair_ids: list[int] = []
    values: list[float] = []
    for i, bias in biased:
        ids = [t for t in bias if 0 <= t < vocab_size]  # the scheduler checked; stay safe
        pair_rows.extend([i] * len(ids))
        pair_ids.extend(ids)
        values.extend(bias[t] for t in ids)
    return LogitBiasMetadata(_long(pair_rows, device), _long(pair_ids, device),
                             torch.tensor(values, dtype=torch.float32, device=device))


def _penalty_metadata(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device | str
) -> PenaltyMetadata | None:
    pen = [i for i, r in enumerate(rows) if r.params.uses_penalties]
    if not pen:
        return None
    params = [rows[i].params for i in pen]
    any_rep = any(p.repetition_penalty != 1.0 for p in params)
    outputs = [rows[i].output_token_ids for i in pen]
    prompts = [rows[i].prompt_token_ids if any_rep else () for i in pen]
    local = torch.arange(len(pen), device=device)  # [P]

    def keys(seqs: list[Sequence[int]]) -> torch.Tensor:  # [n] local_row * V + id
        ids = _flat_ids(seqs, device)
        key = local.repeat_interleave(_long([len(q) for q in seqs], device)) * vocab_size + ids
        return key[(ids >= 0) & (ids < vocab_size)]

    out_keys = keys(outputs)  # [No]
    uniq, inverse = torch.unique(torch.cat([out_keys, keys(prompts)]), return_inverse=True)
    counts = torch.bincount(inverse[: out_keys.numel()], minlength=uniq.numel()).float()  # [N]
    token_local = uniq // vocab_size  # [N] in [0, P)

    def per_token(values: list[float]) -> torch.Tensor:  # [P] -> [N]
        return torch.tensor(values, dtype=torch.float32, device=device)[token_local]

    return PenaltyMetadata(
        token_rows=_long(pen, device)[token_local],
        token_ids=uniq - token_local * vocab_size,
        repetition=per_token([p.repetition_penalty for p in params]),
        subtract=per_token([p.frequency_penalty for p in params]) * counts
        + per_token([p.presence_penalty for p in params]) * (counts > 0),
    )


def _random_metadata(
    rows: Sequence[SamplingRow], random: list[int], vocab_size: int, device: torch.device | str
) -> RandomMetadata:
    params = [rows[i].params for i in random]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    top_p_pos = [j for j, p in enumerate(params) if p.top_p < 1.0]
    top_k_pos = [j for j, p in enumerate(params) if p.top_p >= 1.0 and top_k[j] < vocab_size]
    min_p_pos = [j for j, p in enumerate(params) if p.min_p > 0.0]
    seeded = [
        (j, mix_seed(p.seed, len(rows[i].output_token_ids)))
        for j, (i, p) in enumerate(zip(random, params, strict=True))
        if p.seed is not None
    ]
    seeded_pos = {j for j, _ in seeded}

    def floats(values: list[float]) -> torch.Tensor:  # [n, 1]
        return torch.tensor(values, dtype=torch.float32, device=device).view(-1, 1)

    return RandomMetadata(
        rows=_long(random, device),
        temperature=floats([p.temperature for p in params]),
        top_k_pos=_long(top_k_pos, device),
        top_k=_long([top_k[j] for j in top_k_pos], device),
        top_k_max=max((top_k[j] for j in top_k_pos), default=0),
        top_p_pos=_long(top_p_pos, device),
        top_p_top_k=_long([top_k[j] for j in top_p_pos], device),
        top_p_top_k_max=max((top_k[j] for j in top_p_pos if top_k[j] < vocab_size), default=0),
        top_p=floats([params[j].top_p for j in top_p_pos]),
        min_p_pos=_long(min_p_pos, device),
        min_p=floats([params[j].min_p for j in min_p_pos]),
        seeded=seeded,
        unseeded_pos=_long([j for j in range(len(random)) if j not in seeded_pos], device),
    )


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded row at output ``position``: a 64-bit hash of both."""
    return _splitmix64((_splitmix64(seed & _MASK64) + position) & _MASK64)


def apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Ban stop / EOS ids of rows short of min_tokens. In place on [B, V] logits; returns them."""
    if metadata.min_tokens_ids.numel():
        logits[metadata.min_tokens_rows, metadata.min_tokens_ids] = float("-inf")
    return logits


def apply_logit_bias(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Add each biased row's ``logit_bias``. In place on [B, V] logits; returns them."""
    lb = metadata.logit_bias
    if lb is not None:
        logits.index_put_((lb.rows, lb.token_ids), lb.values, accumulate=True)
    return logits


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition, frequency and presence penalties. In place on [B, V] logits; returns them."""
    pm = metadata.penalties
    if pm is None:
        return logits
    values = logits[pm.token_rows, pm.token_ids]  # [N]
    r = pm.repetition
    values = torch.where(values > 0, values / r, values * r) - pm.subtract
    logits[pm.token_rows, pm.token_ids] = values
    return logits


# top-p looks among this many most likely tokens first, then among more for the rows
# whose top-p set did not fit (flat distributions), and sorts the whole vocabulary last
TOP_P_CANDIDATES = (256, 4096)


def _top_k_mask(probs: torch.Tensor, top_k: torch.Tensor, top_k_max: int) -> torch.Tensor:
    """[A, V] probs, [A] k -> [A, V] bool: exactly the k most likely (ties broken by topk)."""
    top_ids = probs.topk(top_k_max, dim=-1).indices  # [A, kmax]
    within = torch.arange(top_k_max, device=probs.device) < top_k.view(-1, 1)  # [A, kmax]
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(1, top_ids, within)


def _top_p_mask(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, top_k_max: int
) -> torch.Tensor:
    """[S, V] probs, [S] k (V: off), [S, 1] p -> [S, V] bool keep mask.

    Keeps, within the top k, the smallest most-likely prefix whose mass reaches p times
    the top-k mass (top-p on the renormalised top-k distribution, as HF and vLLM)."""
    vocab = probs.shape[1]
    keep = torch.zeros_like(probs, dtype=torch.bool)  # [S, V]
    pending = torch.arange(probs.shape[0], device=probs.device)  # [F] rows not yet decided
    first = max(TOP_P_CANDIDATES[0], top_k_max)  # every row with top-k decides here
    sizes = sorted({min(vocab, c) for c in (first, *TOP_P_CANDIDATES[1:], vocab)})
    for size in sizes:
        sub = probs.index_select(0, pending)  # [F, V]
        if size < vocab:
            cand, cand_ids = sub.topk(size, dim=-1)  # [F, C] descending
        else:
            cand, cand_ids = sub.sort(dim=-1, descending=True)
        k = top_k.index_select(0, pending).view(-1, 1)  # [F, 1]
        cand = cand.masked_fill(torch.arange(size, device=probs.device) >= k, 0.0)  # top-k
        cum = cand.cumsum(dim=-1)  # [F, C]
        k_in_cand = k <= size  # [F, 1]; top-k mass inside the candidates, else the row's
        total = torch.where(k_in_cand, cum[:, -1:], sub.sum(dim=-1, keepdim=True))  # [F, 1]
        target = top_p.index_select(0, pending) * total  # [F, 1]
        # keep a token while the mass before it is under target: the first always stays
        keep_cand = cum - cand < target  # [F, C]
        keep_sub = torch.zeros_like(sub, dtype=torch.bool).scatter_(1, cand_ids, keep_cand)
        # decided unless the prefix may run past the candidates
        done = (k_in_cand | (cum[:, -1:] >= target)).view(-1)  # [F]
        keep.index_copy_(0, pending[done], keep_sub[done])
        pending = pending[~done]
        if not pending.numel():
            break
    return keep


def apply_top_k_top_p_min_p(probs: torch.Tensor, rm: RandomMetadata) -> torch.Tensor:
    """Zero the excluded tokens of [R, V] probs in place (no renormalising); returns them."""
    if rm.top_k_pos.numel():
        sub = probs.index_select(0, rm.top_k_pos)  # [A, V]
        keep = _top_k_mask(sub, rm.top_k, rm.top_k_max)
        probs.index_copy_(0, rm.top_k_pos, sub.masked_fill_(~keep, 0.0))
    if rm.top_p_pos.numel():
        sub = probs.index_select(0, rm.top_p_pos)  # [S, V]
        keep = _top_p_mask(sub, rm.top_p_top_k, rm.top_p, rm.top_p_top_k_max)
        probs.index_copy_(0, rm.top_p_pos, sub.masked_fill_(~keep, 0.0))
    if rm.min_p_pos.numel():  # max prob unchanged by the masks above: the top token stays
        sub = probs.index_select(0, rm.min_p_pos)  # [M, V]
        threshold = rm.min_p * sub.amax(dim=-1, keepdim=True)  # [M, 1]
        probs.index_copy_(0, rm.min_p_pos, sub.masked_fill_(sub < threshold, 0.0))
    return probs


def argmax_rows(x: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R] int64
    """``x.argmax(dim=-1)``; fp32 and bf16 on the CPU through the C++ kernel where it built
    (torch's ran at ~2 G elements/s: 1.4 ms of a batch-36 SmolLM2 decode step; this ~5x
    faster). Any float dtype widens exactly to fp32, so this is its fp32 copy's argmax."""
    if (x.is_cpu and x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2
            and x.shape[1] > 0 and x.stride(1) == 1 and cpu_fused.available()):
        return cpu_fused.argmax_rows(x)
    return x.argmax(dim=-1)


def exponential_race(
    probs: torch.Tensor, rm: RandomMetadata, generator: torch.Generator
) -> torch.Tensor:
    """argmax(probs / E), E ~ Exp(1) per entry: [R, V] probs (unnormalised) -> [R] int64."""
    # E = -log(U): uniform_ + log is ~5x faster than exponential_ on the CPU. U is
    # clamped away from 0 so E is finite and > 0: a zero prob never wins (0/0 = NaN would)
    noise = torch.empty_like(probs)  # [R, V]
    if not rm.seeded:
        noise.uniform_(generator=generator)
    else:
        if rm.unseeded_pos.numel():
            batch = torch.empty(rm.unseeded_pos.numel(), probs.shape[1], device=probs.device)
            noise.index_copy_(0, rm.unseeded_pos, batch.uniform_(generator=generator))
        row_gen = torch.Generator(device=probs.device)
        for pos, seed in rm.seeded:
            noise[pos].uniform_(generator=row_gen.manual_seed(seed))
    noise.clamp_min_(torch.finfo(noise.dtype).tiny).log_().neg_()
    return argmax_rows(probs.div_(noise))


def compute_logprobs(
    raw_logits: torch.Tensor, sampled: torch.Tensor, metadata: SamplingMetadata
) -> list[TokenLogprobs | None]:
    """Logprob, rank and top-k of each sampled token under log_softmax of the raw logits."""
    result: list[TokenLogprobs | None] = [None] * metadata.num_rows
    if not metadata.num_logprobs:
        return result
    lp = torch.log_softmax(raw_logits.index_select(0, metadata.logprob_rows), dim=-1)  # [L, V]
    token_ids = sampled.index_select(0, metadata.logprob_rows).view(-1, 1)  # [L, 1]
    token_lp = lp.gather(1, token_ids)  # [L, 1]
    ranks = (lp > token_lp).sum(dim=-1) + 1  # [L]; ties share the better rank
    max_k = max(metadata.num_logprobs)
    top_lp, top_ids = lp.topk(max_k, dim=-1) if max_k else (lp[:, :0], token_ids[:, :0])
    rows, k_list = metadata.logprob_rows.tolist(), metadata.num_logprobs
    token_lp_list, rank_list = token_lp.view(-1).tolist(), ranks.tolist()
    top_lp_list, top_ids_list = top_lp.tolist(), top_ids.tolist()
    for j, (row, k) in enumerate(zip(rows, k_list, strict=True)):
        result[row] = TokenLogprobs(
            logprob=token_lp_list[j],
            rank=rank_list[j],
            top_token_ids=top_ids_list[j][:k],
            top_logprobs=top_lp_list[j][:k],
        )
    return result


class Sampler:
    """Samples one token per row of [B, V] logits. Holds only the unseeded rows' generator."""

    def __init__(
        self,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        device: torch.device | str = "cpu",
        seed: int | None = None,  # of the unseeded rows' generator; None: nondeterministic
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed & _MASK64)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                 grammar: GrammarBitmask | None = None,
                 argmax: torch.Tensor | None = None) -> SamplerOutput:
        """``argmax``: the rows' ``argmax_rows(logits)`` where the caller has it already (a
        decode graph computes it), taken as the tokens of a plain greedy step."""
        if logits.shape != (len(rows), self.vocab_size):
            raise ValueError(
                f"logits {tuple(logits.shape)} != ({len(rows)} rows, {self.vocab_size} vocab)"
            )
        if argmax is not None and argmax.shape != (len(rows),):
            raise ValueError(f"argmax {tuple(argmax.shape)} != ({len(rows)} rows,)")
        return self.sample(logits, self.metadata(rows), grammar, argmax)

    def metadata(self, rows: Sequence[SamplingRow]) -> SamplingMetadata:
        """What ``sample`` needs from the rows (``is_plain_greedy``: one argmax will do)."""
        return SamplingMetadata.from_rows(rows, self.vocab_size, self.eos_token_ids, self.device)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata,
               grammar: GrammarBitmask | None = None,
               argmax: torch.Tensor | None = None) -> SamplerOutput:
        if metadata.is_plain_greedy and grammar is None:  # in the logits' own dtype
            tokens = argmax if argmax is not None else argmax_rows(logits)
            return SamplerOutput(tokens, [None] * metadata.num_rows)
        raw = logits.float()  # [B, V]
        logits = raw
        if (metadata.penalties is not None or metadata.min_tokens_ids.numel()
                or metadata.logit_bias is not None):
            logits = apply_min_tokens(raw.clone(), metadata)
            logits = apply_penalties(apply_logit_bias(logits, metadata), metadata)
        if grammar is not None:  # -inf stays -inf through the steps above and below
            logits = apply_grammar_bitmask(logits if logits is not raw else raw.clone(), grammar)
        rm = metadata.random
        if rm is None:
            sampled = argmax_rows(logits)  # [B]
        else:
            sampled = torch.empty(metadata.num_rows, dtype=torch.int64, device=logits.device)
            if metadata.greedy_rows.numel():
                greedy = argmax_rows(logits.index_select(0, metadata.greedy_rows))
                sampled.index_copy_(0, metadata.greedy_rows, greedy)
            scaled = logits.index_select(0, rm.rows).div_(rm.temperature)  # [R, V]
            probs = apply_top_k_top_p_min_p(torch.softmax(scaled, dim=-1), rm)
            sampled.index_copy_(0, rm.rows, exponential_race(probs, rm, self.generator))
        return SamplerOutput(sampled, compute_logprobs(raw, sampled, metadata))
