"""Prompt logprobs and logit_bias through the offline engine, against HF transformers.

Oracle: HF's float32 forward over the prompt, log-softmax at every position. Ours must
give every prompt token (the first None) within 1e-4, with its rank and the top-k,
whether the prompt ran in one step or in chunks (a small token budget), whether its
prefix was already in the prefix cache (computed again: a request asking prompt
logprobs takes no cache hit) and under preemption (a tiny KV pool).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from pagoda import LLM, SamplingParams
from services.scheduler.scheduler import RequestRejected
from shared.protocol import TokenLogprobs
from support.checkpoints import load_hf

TOL = 1e-4
K = 3


@pytest.fixture(autouse=True)
def _testing_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_TESTING", "1")  # a broken block invariant raises


def prompts(vocab: int, lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def hf_logprobs(hf: Any, ids: list[int]) -> torch.Tensor:  # [P - 1, V]: row p scores ids[p + 1]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def assert_matches_hf(got: list[TokenLogprobs | None] | None, ref: torch.Tensor,
                      ids: list[int], k: int = K) -> None:
    assert got is not None and len(got) == len(ids) and got[0] is None
    for p, (lp, row) in enumerate(zip(got[1:], ref), start=1):
        assert lp is not None
        token_lp = float(row[ids[p]])
        assert abs(lp.logprob - token_lp) <= TOL, f"position {p}: {lp.logprob} vs {token_lp}"
        # rank: 1 + the tokens more likely (a token within TOL of it may count either way)
        assert int((row > token_lp + TOL).sum()) < lp.rank <= int((row > token_lp - TOL).sum()) + 1
        top = row.topk(k)
        assert len(lp.top_token_ids) == k
        assert torch.allclose(torch.tensor(lp.top_logprobs), top.values, atol=TOL)


@pytest.mark.parametrize("model_fixture", ["tiny_qwen2_dir", "smollm2_dir"])
def test_prompt_logprobs_match_hf_chunked_and_after_a_prefix_hit(
        model_fixture: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(model_fixture)
    # a 32-token budget: the 5-token prompt runs whole, the others in chunks
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=32,
              max_model_len=512)
    hf = load_hf(model_dir)
    vocab = llm.engine.model_config.vocab_size
    batch = prompts(vocab, (5, 40, 77), seed=1)
    refs = [hf_logprobs(hf, ids) for ids in batch]
    scored = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=K)
    plain = SamplingParams(temperature=0.0, max_tokens=2)

    for out, ids, ref in zip(llm.generate(batch, scored, use_tqdm=False), batch, refs):
        assert_matches_hf(out.prompt_logprobs, ref, ids)
    # the prompts' full blocks are cached now: a plain request hits them ...
    hits = llm.generate(batch, plain, use_tqdm=False)
    assert [o.num_cached_tokens for o in hits] == [0, 32, 64] and hits[0].prompt_logprobs is None
    # ... one asking prompt logprobs computes its whole prompt again, with the same values
    again = llm.generate(batch, scored, use_tqdm=False)
    assert [o.num_cached_tokens for o in again] == [0, 0, 0]
    for out, ids, ref in zip(again, batch, refs):
        assert_matches_hf(out.prompt_logprobs, ref, ids)
    # n > 1: the prompt is scored once; the request output carries it
    n2 = llm.generate(batch[1], SamplingParams(n=2, temperature=1.0, seed=2, max_tokens=3,
                                               prompt_logprobs=0), use_tqdm=False)[0]
    assert len(n2.outputs) == 2
    assert_matches_hf(n2.prompt_logprobs, refs[1], batch[1], k=0)


def test_prompt_logprobs_under_preemption(tiny_llama_dir: Path) -> None:
    hf = load_hf(tiny_llama_dir)
    batch = prompts(512, tuple(range(20, 84, 4)), seed=2)  # 16 prompts
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=1)
    small = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=24, block_size=16,
                max_num_seqs=16, max_num_batched_tokens=64)
    outs = small.generate(batch, params, use_tqdm=False)
    assert small.stats().num_preemptions > 0, "the tiny pool should preempt"
    for out, ids in zip(outs, batch):
        assert_matches_hf(out.prompt_logprobs, hf_logprobs(hf, ids), ids, k=1)
    stats = small.stats()
    assert stats.running == stats.waiting == 0 and stats.kv_usage == 0.0


def test_logit_bias_steers_greedy_decoding(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    prompt = prompts(512, (12,), seed=3)[0]

    def first(**kw: Any) -> int:
        params = SamplingParams(temperature=0.0, max_tokens=1, **kw)
        return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids[0]

    greedy = first()
    forced = (greedy + 17) % 512
    assert first(logit_bias={forced: 100.0}) == forced
    assert first(logit_bias={greedy: -100.0}) != greedy
    assert first(logit_bias={greedy: -100.0, forced: 0.0}) != greedy
    # the bias never reaches the reported logprobs: they stay the raw model's
    lp = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=1,
                                               logit_bias={forced: 100.0}),
                      use_tqdm=False)[0].outputs[0].logprobs
    assert lp is not None and lp[0] is not None and lp[0].top_token_ids == [greedy]
    with pytest.raises(RequestRejected, match="logit_bias"):
        llm.generate([prompt], SamplingParams(logit_bias={512: 1.0}), use_tqdm=False)
