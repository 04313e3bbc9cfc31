"""The offline engine (scheduler + runner in one process) on tiny random models.

Each scheduler feature must leave the tokens unchanged: preemption, prefix caching
and chunked prefill are checked against a run without them, greedy, token for token.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pagoda import LLM, SamplingParams
from services.scheduler.scheduler import RequestRejected
from shared.sampling_params import SamplingParamsError
from support.checkpoints import make_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(autouse=True)
def _testing_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the test stacks run: a broken block-accounting invariant raises."""
    monkeypatch.setenv("PAGODA_TESTING", "1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llm-tiny"), "llama", seed=4,
                           max_position_embeddings=4096)


def random_prompts(count: int, lo: int, hi: int, seed: int, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def tokens(outputs) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [o.outputs[0].token_ids for o in outputs]


def assert_pool_back(llm: LLM) -> None:
    llm.engine.scheduler.check_invariants()
    stats = llm.stats()
    assert stats.running == 0 and stats.waiting == 0
    assert stats.kv_usage == 0.0, f"blocks still held: usage {stats.kv_usage}"


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
def test_preemption_gives_the_same_tokens(model_dir: Path, kv_cache_dtype: str) -> None:
    prompts = random_prompts(64, 5, 60, seed=1)
    params = [SamplingParams(temperature=0.0, max_tokens=random.Random(i).randint(8, 40),
                             ignore_eos=True) for i in range(64)]
    big = LLM(str(model_dir), dtype="float32", num_kv_blocks=2048, kv_cache_dtype=kv_cache_dtype)
    assert big.engine.scheduler.config.strict_invariants  # PAGODA_TESTING=1
    expected = tokens(big.generate(prompts, params, use_tqdm=False))
    small = LLM(str(model_dir), dtype="float32", num_kv_blocks=24, max_num_seqs=64,
                kv_cache_dtype=kv_cache_dtype)
    got = tokens(small.generate(prompts, params, use_tqdm=False))
    assert small.stats().num_preemptions >= 10, "the small pool should preempt many times"
    assert got == expected
    assert_pool_back(small)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
def test_prefix_caching_hits_and_same_tokens(model_dir: Path, kv_cache_dtype: str) -> None:
    # a bf16 KV cache under fp32 too: a hit reads the cached keys as a prompt reads its own
    system = random_prompts(1, 256, 256, seed=2)[0]
    prompts = [system + p for p in random_prompts(32, 4, 30, seed=3)]
    off = LLM(str(model_dir), dtype="float32", enable_prefix_caching=False,
              kv_cache_dtype=kv_cache_dtype)
    expected = tokens(off.generate(prompts, GREEDY, use_tqdm=False))
    on = LLM(str(model_dir), dtype="float32", kv_cache_dtype=kv_cache_dtype)
    want = "torch.bfloat16" if kv_cache_dtype == "bfloat16" else "torch.float32"
    assert str(on.engine.runner.kv_caches[0][0].dtype) == want
    first = tokens(on.generate(prompts[:1], GREEDY, use_tqdm=False))
    before = on.stats().prefix_cache_hits
    rest = tokens(on.generate(prompts[1:], GREEDY, use_tqdm=False))
    hits = on.stats().prefix_cache_hits - before
    assert hits >= 0.9 * 31 * 256, f"{hits} hit tokens for 31 requests sharing 256 tokens"
    assert first + rest == expected
    assert off.stats().prefix_cache_hits == 0
    assert_pool_back(on)


def test_chunked_prefill_same_tokens_and_decodes_keep_going(model_dir: Path) -> None:
    long_prompt = random_prompts(1, 2000, 2000, seed=5)[0]
    short = random_prompts(3, 5, 10, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    wide = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=4096)
    expected = tokens(wide.generate([long_prompt], params, use_tqdm=False))

    narrow = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=256)
    narrow.engine.step_log = []
    decoding = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = narrow.generate(short + [long_prompt], [decoding] * 3 + [params], use_tqdm=False)
    assert tokens(outs)[3] == expected[0]
    trace = [batch for batch, _ in narrow.engine.step_log]
    # the worker link names sequences by compact ids: tell them apart by prompt length
    new = [n for b in trace for n in b.new_requests]
    long_ids = {n.request_id for n in new if n.num_prompt_tokens == 2000}
    short_ids = {n.request_id for n in new if n.num_prompt_tokens < 2000}
    assert len(long_ids) == 1 and len(short_ids) == 3
    prefill_steps = [b for b in trace if any(
        rid in long_ids and n > 1 for rid, n in zip(b.scheduled_request_ids, b.num_scheduled_tokens))]
    assert len(prefill_steps) >= 2000 // 256, "the long prompt should be split into chunks"
    for batch in prefill_steps[1:]:  # the short ones prefilled in the first step
        decoded = {rid for rid, n in zip(batch.scheduled_request_ids, batch.num_scheduled_tokens) if n == 1}
        assert short_ids <= decoded, f"a running decode missed a step: {batch}"
        assert batch.total_num_scheduled_tokens <= 256
    assert_pool_back(narrow)


def test_n4_children_share_prompt_blocks_and_are_freed(model_dir: Path) -> None:
    llm = LLM(str(model_dir), dtype="float32")
    prompt = random_prompts(1, 100, 100, seed=7)[0]
    out = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=12,
                                                ignore_eos=True), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 12 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1, "seeded children should differ"
    again = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=12,
                                                  ignore_eos=True), use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]
    assert_pool_back(llm)


def test_prompt_forms_and_validation(model_dir: Path) -> None:
    llm = LLM(str(model_dir), dtype="float32", max_model_len=256)
    one = llm.generate([5, 6, 7], GREEDY, use_tqdm=False)
    assert len(one) == 1 and one[0].prompt_token_ids == [5, 6, 7]
    two = llm.generate([[5, 6, 7], [8, 9]], [GREEDY, GREEDY], use_tqdm=False)
    assert tokens(two)[0] == tokens(one)[0]
    with pytest.raises(ValueError):
        llm.generate([[5, 6]], [GREEDY, GREEDY], use_tqdm=False)
    with pytest.raises(SamplingParamsError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(SamplingParamsError, match="temperature"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(RequestRejected, match="256"):
        llm.generate([[5, 6], list(range(3, 300))], GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.requests == {}, "the good prompt of a rejected call stays queued"
    assert_pool_back(llm)


def test_stop_strings_cut_the_text(smollm2_dir: Path) -> None:
    llm = LLM(str(smollm2_dir), dtype="float32", num_kv_blocks=256)
    msgs = [{"role": "user", "content": "List three fruits, separated by commas."}]
    base = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    text = base.text
    stop = text[len(text) // 3 : len(text) // 3 + 4]
    assert stop.strip(), f"pick a visible stop string from {text!r}"
    cut = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]), use_tqdm=False)
    out = cut[0].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < len(base.token_ids)
    kept = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=40, stop=[stop],
                                         include_stop_str_in_output=True), use_tqdm=False)
    assert kept[0].outputs[0].text == text[: text.index(stop) + len(stop)]
    assert_pool_back(llm)
