"""Prompt logprobs at the scheduler, with the fabricated worker (prompt token p scores -p).

The scheduler must collect every chunk's logprobs, hand them over once with the first
token of child 0, keep such a sequence off prefix-cache hits (the fake worker refuses a
``NewRequest`` asking prompt logprobs that does not start at token 0), start over after
a preemption mid-prefill, and never ask again once they are delivered.
"""

from __future__ import annotations

import pytest

from services.scheduler.request import RequestStatus
from services.scheduler.scheduler import RequestRejected, Scheduler, SchedulerConfig
from shared.protocol import EngineOutput
from shared.sampling_params import SamplingParams
from support.fake_worker import FakeWorker, step

PROMPT = list(range(100, 130))  # 30 tokens: 7 full blocks of 4 and a partial one
EXPECTED = [None] + [-float(p) for p in range(1, len(PROMPT))]


def make(**kw: int) -> tuple[Scheduler, FakeWorker]:
    cfg = SchedulerConfig(num_blocks=64, block_size=4, vocab_size=1000, eos_token_ids=(2,),
                          strict_invariants=True, **kw)
    return Scheduler(cfg), FakeWorker(4, 1000, avoid=frozenset({2}))


def params(**kw: object) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, **kw})  # type: ignore[arg-type]


def scored(out: EngineOutput) -> list[float | None]:
    return [None if lp is None else lp.logprob for lp in out.prompt_logprobs]


def outputs_until_idle(s: Scheduler, w: FakeWorker) -> list[EngineOutput]:
    outs = []
    while s.has_unfinished_requests():
        outs.extend(step(s, w)[1])
    return outs


def test_chunks_are_collected_and_delivered_once_with_the_first_token() -> None:
    s, w = make(max_num_batched_tokens=8)
    s.add_request("a", PROMPT, params(prompt_logprobs=2, max_tokens=4, ignore_eos=True))
    outs = outputs_until_idle(s, w)
    assert len(outs) == 4 and scored(outs[0]) == EXPECTED
    assert all(o.prompt_logprobs == [] for o in outs[1:])


def test_a_request_asking_prompt_logprobs_takes_no_prefix_hit() -> None:
    s, w = make()
    s.add_request("warm", PROMPT, params(max_tokens=1))
    outputs_until_idle(s, w)  # its full blocks stay cached
    s.add_request("scored", PROMPT, params(prompt_logprobs=0, max_tokens=2, ignore_eos=True))
    batch, outs = step(s, w)  # the fake worker asserts it starts at token 0
    assert batch.new_requests[0].num_computed_tokens == 0
    assert scored(outs[0]) == EXPECTED and outs[0].num_cached_tokens == 0
    # delivered: a resume would not ask again, and may use the cache
    req = s.requests["scored"][0]
    assert req.prompt_logprobs is None and req.sampling_params.prompt_logprobs is None
    outputs_until_idle(s, w)
    s.add_request("plain", PROMPT, params(max_tokens=1))
    assert step(s, w)[1][0].num_cached_tokens == 28  # 7 blocks: the cache still works


def test_only_child_0_scores_the_prompt_and_the_others_share_its_blocks() -> None:
    s, w = make()
    s.add_request("n3", PROMPT, params(n=3, prompt_logprobs=1, max_tokens=3, ignore_eos=True,
                                       temperature=1.0, seed=5))
    children = s.requests["n3"]
    assert [c.sampling_params.prompt_logprobs for c in children] == [1, None, None]
    outs = outputs_until_idle(s, w)
    with_prompt = [o for o in outs if o.prompt_logprobs]
    assert len(with_prompt) == 1 and with_prompt[0].index == 0
    assert scored(with_prompt[0]) == EXPECTED


def test_preemption_mid_prefill_scores_the_prompt_again_from_the_start() -> None:
    s, w = make(max_num_batched_tokens=8)
    s.add_request("a", PROMPT, params(prompt_logprobs=1, max_tokens=2, ignore_eos=True))
    step(s, w)
    step(s, w)
    req = s.requests["a"][0]
    assert 0 < req.num_computed_tokens < len(PROMPT) and len(req.prompt_logprobs or []) == 17
    s._preempt(req)  # as a newer sequence would be when an older one needs its blocks
    assert req.prompt_logprobs == [None] and req.status == RequestStatus.PREEMPTED
    outs = outputs_until_idle(s, w)  # the resume is a NewRequest from token 0 again
    assert scored(outs[0]) == EXPECTED


def test_logit_bias_token_ids_are_checked_against_the_vocabulary() -> None:
    s, _ = make()
    with pytest.raises(RequestRejected, match="logit_bias"):
        s.add_request("x", [1, 2, 3], params(logit_bias={5: 1.0, 1000: -1.0}))
    assert not s.requests and not s.waiting
    s.add_request("ok", [1, 2, 3], params(logit_bias={999: 100.0}))
