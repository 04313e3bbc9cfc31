"""Structured output on the worker: the step's packed bitmasks applied to the logits
(against xgrammar's own ``apply_token_bitmask_inplace`` as the oracle), every sampling
mode picking only allowed tokens, logprobs from the raw logits, and the runner mapping
a StepBatch's masks onto its sampler rows."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from services.worker.grammar_bitmask import (
    GrammarBitmask,
    allowed_tokens,
    apply_grammar_bitmask,
    unpack_on_device,
)
from services.worker.model_runner import StepError
from services.worker.runner_builder import RunnerSpec, build_runner
from services.worker.sampler import Sampler, SamplingRow
from shared.config import EngineSettings
from shared.protocol import NewRequest, StepBatch
from shared.sampling_params import SamplingParams, StructuredOutputsParams

VOCAB = 1000  # not a multiple of 32: the last word is partly padding
WIDTH = (VOCAB + 31) // 32


def pack(allowed: list[list[int]], vocab: int = VOCAB) -> bytes:
    """Rows of allowed token ids -> the wire's little-endian int32 words."""
    bits = np.zeros((len(allowed), ((vocab + 31) // 32) * 32), dtype=np.uint8)
    for row, ids in enumerate(allowed):
        bits[row, ids] = 1
    return np.packbits(bits, axis=1, bitorder="little").tobytes()


def test_unpacking_matches_xgrammar_on_random_masks() -> None:
    import xgrammar as xgr
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, VOCAB, generator=gen)
    words = torch.randint(-(2**31), 2**31 - 1, (6, WIDTH), dtype=torch.int32, generator=gen)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, words)
    ours = apply_grammar_bitmask(logits.clone(), GrammarBitmask(
        torch.arange(6), words.numpy().astype("<i4")))
    assert torch.equal(ours, expected)
    # a subset of rows, out of order: only those rows change
    sub = apply_grammar_bitmask(logits.clone(), GrammarBitmask(
        torch.tensor([4, 1]), words.numpy()[[4, 1]].astype("<i4")))
    assert torch.equal(sub[[1, 4]], expected[[1, 4]])
    assert torch.equal(sub[[0, 2, 3, 5]], logits[[0, 2, 3, 5]])


def test_bytes_decode_and_check_their_size() -> None:
    mask = GrammarBitmask.from_bytes([0, 2], pack([[3, 999], [0]]), VOCAB, torch.device("cpu"))
    allowed = allowed_tokens(mask.words, VOCAB, torch.device("cpu"))
    # the accelerator's path (shifts on the device), run here on CPU tensors
    assert torch.equal(unpack_on_device(torch.from_numpy(mask.words.astype(np.int32)), VOCAB),
                       allowed)
    assert allowed.shape == (2, VOCAB)
    assert allowed[0].nonzero().view(-1).tolist() == [3, 999]
    assert allowed[1].nonzero().view(-1).tolist() == [0]
    with pytest.raises(ValueError, match="bitmask bytes"):
        GrammarBitmask.from_bytes([0], pack([[1]]) + b"\0\0\0\0", VOCAB, torch.device("cpu"))


def _rows(params: list[SamplingParams]) -> list[SamplingRow]:
    return [SamplingRow(p, [1, 2, 3], []) for p in params]


CONSTRAINED = StructuredOutputsParams(regex="a")  # the sampler reads only "has one"


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0, seed=7),
    SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5),
    SamplingParams(temperature=0.0, min_tokens=3, logprobs=2),
], ids=["greedy", "seeded", "top_k_p_min_p", "penalties", "greedy_min_tokens_logprobs"])
def test_every_sampling_mode_picks_only_allowed_tokens(params: SamplingParams) -> None:
    sampler = Sampler(VOCAB, eos_token_ids=[2], seed=0)
    allowed = [[5, 77, 2], [400], [2]]  # the last: only EOS, even under min_tokens
    constrained = msgspec.structs.replace(params, structured_outputs=CONSTRAINED)
    rows = _rows([constrained, SamplingParams(temperature=0.0), constrained, constrained])
    mask = GrammarBitmask.from_bytes([0, 2, 3], pack(allowed), VOCAB, torch.device("cpu"))
    for trial in range(5):
        logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(trial))
        raw = logits.clone()
        out = sampler(logits, rows, mask)
        tokens = out.sampled_token_ids.tolist()
        assert tokens[0] in allowed[0] and tokens[2] == 400 and tokens[3] == 2, tokens
        assert tokens[1] == int(raw[1].argmax()), "an unconstrained row changed"
        assert torch.equal(logits, raw), "the model's logits were written"
        if params.logprobs is not None:  # from the raw distribution, not the masked one
            expected = torch.log_softmax(raw[0], -1)[tokens[0]].item()
            assert out.logprobs[0] is not None
            assert out.logprobs[0].logprob == pytest.approx(expected, abs=1e-5)


def test_runner_masks_the_rows_the_batch_names(tiny_llama_dir: Path) -> None:
    built = build_runner(tiny_llama_dir, RunnerSpec.from_settings(
        EngineSettings(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=16, device="cpu")))
    runner, vocab = built.runner, built.model_config.vocab_size
    so = SamplingParams(temperature=1.0, seed=1, structured_outputs=StructuredOutputsParams(regex="a"))
    new = [NewRequest(i, [1, 5, 9], 3, so if i else SamplingParams(temperature=0.0), [i], 0)
           for i in range(2)]
    batch = StepBatch(0, new, [], [0, 1], [3, 3], grammar_seq_ids=[1],
                      grammar_bitmasks=pack([[42]], vocab))
    result, logits = runner.execute_with_logits(batch)
    assert result.sampled_token_ids[1] == 42
    assert result.sampled_token_ids[0] == int(logits[0].argmax())
    bad = StepBatch(1, [], [], [0, 1], [1, 1], grammar_seq_ids=[7],
                    grammar_bitmasks=pack([[42]], vocab))
    with pytest.raises(StepError, match="do not sample"):
        runner.execute(bad)
