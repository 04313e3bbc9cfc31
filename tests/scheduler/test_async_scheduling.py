"""Async scheduling in the scheduler core: step N+1 is scheduled (and run by the
fabricated worker) before step N's update, and every sequence gets exactly the
tokens, finish and stop reasons and prompt logprobs it gets with one step at a time,
through chunked prefill, preemption, n > 1, stop tokens, max_tokens and aborts; the
block accounting is checked after every step."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.scheduler.request import RequestStatus
from services.scheduler.scheduler import RequestRejected, Scheduler, SchedulerConfig
from shared.protocol import EngineOutput
from shared.sampling_params import SamplingParams
from support.fake_worker import AheadDriver, FakeWorker, step

EOS = 2
VOCAB = 40  # small, so EOS and stop ids come up by themselves

Outcome = dict[tuple[str, int], tuple]


def make(num_blocks: int, block_size: int = 4, **kw: object) -> tuple[Scheduler, FakeWorker]:
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=block_size, vocab_size=VOCAB,
                          eos_token_ids=(EOS,), strict_invariants=True, **kw)  # type: ignore[arg-type]
    return Scheduler(cfg), FakeWorker(block_size, VOCAB)


def collect(outcome: dict[tuple[str, int], dict], outs: list[EngineOutput]) -> None:
    for out in outs:
        seen = outcome.setdefault((out.request_id, out.index), {
            "tokens": [], "finish": None, "stop": None, "prompt_logprobs": None})
        assert seen["finish"] is None, f"output after the end of {out.request_id}/{out.index}"
        seen["tokens"] += out.new_token_ids
        if out.prompt_logprobs:  # empty: none handed over by this output
            assert seen["prompt_logprobs"] is None, "prompt logprobs handed over twice"
            seen["prompt_logprobs"] = [None if lp is None else lp.logprob
                                       for lp in out.prompt_logprobs]
        if out.finished:
            seen["finish"], seen["stop"] = out.finish_reason, out.stop_reason


def add_all(s: Scheduler, requests: list[tuple[str, list[int], SamplingParams]]) -> set[str]:
    taken = set()
    for rid, prompt, p in requests:
        try:
            s.add_request(rid, prompt, p)
            taken.add(rid)
        except RequestRejected:
            pass
    return taken


def run_sync(cfg: dict, requests: list) -> dict:
    s, w = make(**cfg)
    add_all(s, requests)
    outcome: dict = {}
    for _ in range(10_000):
        if not s.has_unfinished_requests():
            break
        collect(outcome, step(s, w)[1])
    assert not s.has_unfinished_requests()
    return outcome


def run_ahead(cfg: dict, requests: list, aborts: dict[int, str] | None = None) -> tuple[dict, Scheduler]:
    s, w = make(**cfg)
    add_all(s, requests)
    driver = AheadDriver(s, w)
    outcome: dict = {}
    aborts = dict(aborts or {})
    for n in range(10_000):
        if not driver.busy():
            break
        if n in aborts:  # lands between step N+1's schedule and step N's update
            driver_gap_abort(driver, aborts.pop(n), outcome)
        collect(outcome, driver.step())
    assert not driver.busy()
    s.check_invariants()
    assert (s.stats().running, s.stats().waiting, s.block_manager.usage) == (0, 0, 0.0)
    assert s.requests == {}
    return outcome, s


def driver_gap_abort(driver: AheadDriver, request_id: str, outcome: dict) -> None:
    """An abort while a step is published ahead of the last one's update."""
    collect(outcome, driver.scheduler.abort_request([request_id]))


prompts = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=30)
request_params = st.builds(
    dict,
    max_tokens=st.integers(1, 16),
    min_tokens=st.integers(0, 2),
    n=st.integers(1, 3),
    ignore_eos=st.booleans(),
    stop_token_ids=st.lists(st.integers(3, VOCAB - 1), max_size=2),
    prompt_logprobs=st.sampled_from([None, None, 0]),
)
configs = st.builds(
    dict,
    num_blocks=st.integers(6, 48),
    max_num_batched_tokens=st.integers(4, 48),
    max_num_seqs=st.integers(1, 8),
    max_model_len=st.sampled_from([24, 64]),
)
SHARED = [5, 6, 7, 8, 9, 10, 11, 12]  # a common prefix, so the prefix cache hits


def build_requests(raw: list[tuple[list[int], dict, bool]]) -> list:
    out = []
    for i, (tokens, kw, shared) in enumerate(raw):
        kw = dict(kw)
        kw["min_tokens"] = min(kw["min_tokens"], kw["max_tokens"])
        out.append((f"r{i}", (SHARED + tokens) if shared else tokens,
                    SamplingParams(temperature=0.0, **kw)))
    return out


workloads = st.lists(st.tuples(prompts, request_params, st.booleans()), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs, raw=workloads)
def test_ahead_gives_every_sequence_the_same_outputs(cfg: dict, raw: list) -> None:
    requests = build_requests(raw)
    want = run_sync(cfg, requests)
    got, _ = run_ahead(cfg, requests)
    assert got == want


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs, raw=workloads, when=st.integers(0, 12), which=st.integers(0, 7))
def test_an_abort_mid_overlap_ends_only_its_request(cfg: dict, raw: list, when: int,
                                                    which: int) -> None:
    requests = build_requests(raw)
    victim = requests[which % len(requests)][0]
    want = run_sync(cfg, requests)
    got, _ = run_ahead(cfg, requests, aborts={when: victim})
    assert got.keys() == want.keys()
    for key, seen in got.items():
        if key[0] != victim:
            assert seen == want[key], key
            continue
        # the abort lands wherever the victim is: its tokens so far, then abort (or it
        # had finished already, with everything)
        assert seen["tokens"] == want[key]["tokens"][: len(seen["tokens"])]
        assert seen["finish"] in ("abort", want[key]["finish"])
        if seen["finish"] != "abort":
            assert seen == want[key]


def test_a_decode_runs_every_step_without_waiting_for_the_last_result() -> None:
    cfg = {"num_blocks": 32}
    s, w = make(**cfg)
    s.add_request("r", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    driver = AheadDriver(s, w)
    driver.step()  # prefill (sampling token 1) and, ahead of its update, decode of token 1
    req = s.requests["r"][0]
    assert (req.num_tokens_ahead, req.num_samples_ahead) == (1, 1)
    outs: list[EngineOutput] = []
    while driver.busy():
        outs += driver.step()
    # 6 tokens in 6 steps: no step of the overlap was empty or wasted
    assert driver.num_steps == 6
    assert outs[-1].finish_reason == "length"


def test_a_stop_token_in_flight_costs_one_discarded_token() -> None:
    s, w = make(num_blocks=32)
    s.add_request("r", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=10))
    w.forced[s.requests["r"][0].seq_id] = [20, EOS]
    driver = AheadDriver(s, w)
    outs = []
    while driver.busy():
        outs += driver.step()
    assert [t for o in outs for t in o.new_token_ids] == [20, EOS]
    assert outs[-1].finish_reason == "stop"
    # the worker computed one token past EOS (scheduled before EOS was known), dropped
    assert s.requests == {} and s.block_manager.usage == 0.0


def test_max_tokens_is_not_scheduled_past() -> None:
    s, w = make(num_blocks=32)
    s.add_request("r", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    first = s.schedule()
    w.execute(first)
    # its one token is in flight: nothing more to run for it
    ahead = s.schedule()
    assert ahead.scheduled_request_ids == []


def test_preempted_mid_overlap_keeps_its_token_and_resumes_after_it() -> None:
    # two sequences, a pool that holds one: the newer is preempted while its step runs
    s, w = make(num_blocks=5, block_size=4, max_num_batched_tokens=64)
    p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    s.add_request("old", [5, 6, 7, 8, 9, 10, 11], p)
    s.add_request("new", [12, 13, 14, 15, 16, 17, 18], p)
    seen_out: list[int] = []

    def in_gap() -> None:
        new = s.requests.get("new")
        if new and new[0].status is RequestStatus.PREEMPTED and new[0].num_samples_ahead:
            seen_out.append(len(new[0].token_ids))

    driver = AheadDriver(s, w, in_gap)
    outcome: dict = {}
    while driver.busy():
        collect(outcome, driver.step())
    assert seen_out, "no preemption landed while the victim's token was out"
    assert s.stats().num_preemptions > 0
    assert outcome == run_sync({"num_blocks": 5, "max_num_batched_tokens": 64},
                               [("old", [5, 6, 7, 8, 9, 10, 11], p),
                                ("new", [12, 13, 14, 15, 16, 17, 18], p)])


def test_the_pool_ceiling_waits_for_the_token_in_flight() -> None:
    # 7 blocks of 4 hold 28 tokens: a 24-token prompt gets 5 tokens (the 5th needs no
    # slot) in order; ahead, the 5th is in flight when the 6th finds the pool full
    cfg = {"num_blocks": 7, "max_num_batched_tokens": 31}
    request = [("r", list(range(3, 27)), SamplingParams(temperature=0.0, max_tokens=14,
                                                        ignore_eos=True))]
    want = run_sync(cfg, request)
    assert len(want[("r", 0)]["tokens"]) == 5 and want[("r", 0)]["finish"] == "length"
    assert run_ahead(cfg, request)[0] == want


def test_a_prompt_admitted_ahead_hits_the_blocks_the_step_out_computes() -> None:
    s, w = make(num_blocks=32)
    p = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    s.add_request("a", list(range(5, 21)), p)  # 16 tokens: 4 full blocks of 4
    first = s.schedule()
    w.execute(first)
    s.add_request("b", list(range(5, 21)), p)  # arrives while step 1 is out
    ahead = s.schedule()  # before step 1's update
    (new_b,) = ahead.new_requests
    assert new_b.num_computed_tokens == 12  # 3 blocks hit; the last token is recomputed
    assert s.stats().prefix_cache_hits == 12
