"""``pagoda bench``: throughput and latency of pagoda, beside HF transformers and the
machine's limit, in one run.

    pagoda bench                                    # offline, the default workload
    pagoda bench --launch --max-concurrency 64      # a local stack, over HTTP
    pagoda bench --launch --transport zmq           # ... over the native ZMQ API
    pagoda bench --url http://host:8000/v1 --request-rate 4
    pagoda bench --baseline hf --roofline --output-json r.json --output-png r.png

Default workload: SmolLM2, 64 requests, prompts uniform in [32, 512] tokens cut from
real text, outputs uniform in [16, 256] tokens (exact, through ``ignore_eos``), greedy,
all sent at once. ``--dataset FILE`` takes prompts from a JSONL file instead.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagoda.bench.workload import LengthDist, Workload, load_jsonl, make_workload
from shared.config import (
    DTYPES,
    SETTINGS,
    ConfigError,
    EngineSettings,
    add_arguments,
    engine_settings,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagoda bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=64)
    w.add_argument("--prompt-len", type=LengthDist.parse, default=LengthDist(32, 512),
                   help="uniform:a,b or fixed:n (tokens)")
    w.add_argument("--output-len", type=LengthDist.parse, default=LengthDist(16, 256),
                   help="uniform:a,b or fixed:n (tokens; exact)")
    w.add_argument("--dataset", default=None, help="JSONL of {'prompt': ...} or ShareGPT conversations")
    w.add_argument("--seed", type=int, default=0)
    m = p.add_argument_group("mode (default: offline, in this process)")
    m.add_argument("--launch", action="store_true", help="start a local stack for the run")
    m.add_argument("--url", default=None, help="a running server's OpenAI API base, e.g. http://127.0.0.1:8000/v1")
    m.add_argument("--native", action="append", default=None, metavar="ADDR",
                   help="a running frontend's native ZMQ address (repeatable); implies --transport zmq")
    m.add_argument("--transport", choices=("http", "zmq"), default=None,
                   help="online transport (default http; zmq with --native)")
    m.add_argument("--metrics-url", default=None, help="default: <url without /v1>/metrics")
    m.add_argument("--frontends", type=int, default=1, help="frontends of a --launch stack")
    m.add_argument("--online", action="store_true",
                   help="offline mode: then serve the same requests through a launched stack "
                        "over HTTP (--frontends, --max-concurrency) and print online / offline "
                        "with the CPU seconds each process took")
    m.add_argument("--online-rounds", type=int, default=1, metavar="N",
                   help="with --online: N rounds of an offline and an online pass, in "
                        "alternating order (both engines stay up; each round's prompts "
                        "salted so no pass hits another's prefix cache); prints each "
                        "round's online / offline and their geometric mean (CPU only)")
    m.add_argument("--online-launches", type=int, default=1, metavar="L",
                   help="with --online-rounds: the rounds L times, each time on a freshly "
                        "launched stack (a process's speed can differ from the next's for "
                        "its lifetime); the headline is the geometric mean of every round")
    a = p.add_argument_group("arrival")
    a.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second (seeded); inf = all at once")
    a.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    # the engine settings, as every role declares them (offline and --launch; only the
    # flags count here, not PAGODA_* variables: a run is defined by its command line)
    add_arguments(p, groups=("engine",))
    c = p.add_argument_group("comparisons and output")
    c.add_argument("--baseline", choices=("hf", "vllm"), action="append", default=None,
                   help="hf: HF transformers generate; vllm: vLLM's CPU engine (its own "
                        "environment, scripts/setup_vllm.sh); same requests, same run; repeatable")
    c.add_argument("--vllm-rounds", type=int, default=1, metavar="N",
                   help="with --baseline vllm (offline): N rounds of a pagoda and a vLLM "
                        "pass in alternating order (both engines stay up; each round's "
                        "prompts salted so no pass hits another's prefix cache); prints "
                        "each round's pagoda / vLLM and the geometric mean of rounds 1 on")
    c.add_argument("--hf-batch-sizes", default="1,8,16,32,64", help="1 = one request at a time")
    c.add_argument("--hf-dtypes", default="auto",
                   help="comma-separated; auto: float32 and the dtype pagoda computes in")
    c.add_argument("--exact-match", type=int, default=None, metavar="N",
                   help="offline mode: the first N requests' greedy tokens against HF "
                        "transformers in the engine's dtype, one at a time; prints the "
                        "exact-match rate (default 16 where --kv-cache-dtype changes the "
                        "cache's dtype, else 0)")
    c.add_argument("--roofline", action="store_true",
                   help="measure FLOP/s and bandwidth on the engine's --device; print the fraction")
    c.add_argument("--output-json", default=None)
    c.add_argument("--output-png", default=None)
    c.add_argument("--no-progress", action="store_true")
    return p


def _mode(args: argparse.Namespace) -> str:
    if args.native:
        return "zmq"
    if args.online and (args.launch or args.url or args.transport):
        raise SystemExit("pagoda bench: --online adds a launched HTTP run to an offline one; "
                         "drop --launch/--url/--transport")
    if args.online_rounds != 1 and (not args.online or args.online_rounds < 1):
        raise SystemExit("pagoda bench: --online-rounds takes a count >= 1 and needs --online")
    if args.online_launches != 1 and (args.online_rounds < 2 or args.online_launches < 1):
        raise SystemExit("pagoda bench: --online-launches takes a count >= 1 and needs "
                         "--online-rounds 2 or more")
    if args.vllm_rounds != 1 and (args.vllm_rounds < 1 or "vllm" not in (args.baseline or ())):
        raise SystemExit("pagoda bench: --vllm-rounds takes a count >= 1 and needs --baseline vllm")
    if args.launch or args.url:
        return args.transport or "http"
    if args.transport:
        raise SystemExit("pagoda bench: --transport needs --launch, --url or --native")
    return "offline"


def _engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings given as flags (the model apart), as ``LLM`` and ``pagoda
    serve`` name them."""
    return {s.key: getattr(args, s.key) for s in SETTINGS
            if s.group == "engine" and s.key != "model" and getattr(args, s.key) is not None}


def _settings(args: argparse.Namespace) -> EngineSettings:
    """The whole engine configuration of the run (validated: a bad value fails first)."""
    model = {"model": args.model} if args.model is not None else {}
    return engine_settings({**model, **_engine_settings(args)}, caller="pagoda bench")


def engine_device(args: argparse.Namespace) -> str:
    """The engine's device (``auto`` resolved as the worker resolves it)."""
    from services.worker.runner_builder import resolve_device

    return str(resolve_device(_settings(args).device))


def engine_dtype(args: argparse.Namespace) -> str:
    """The dtype the engine computes in (``auto`` resolved as the worker resolves it)."""
    import torch

    from services.worker.runner_builder import resolve_dtype_name

    return resolve_dtype_name(_settings(args).dtype, torch.device(engine_device(args)))


def engine_kv_cache_dtype(args: argparse.Namespace) -> str:
    """The KV cache's dtype as the worker resolves it."""
    import torch

    from services.worker.runner_builder import resolve_dtype, resolve_kv_cache_dtype

    settings, device = _settings(args), torch.device(engine_device(args))
    kv = resolve_kv_cache_dtype(settings.kv_cache_dtype, resolve_dtype(settings.dtype, device),
                                device)
    return str(kv).removeprefix("torch.")


def exact_match_requests(args: argparse.Namespace, dtype: str, kv_cache_dtype: str) -> int:
    """How many requests ``--exact-match`` compares (0: none): by default 16 where the KV
    cache's dtype is not the model's (it changes tokens, so its rate is reported)."""
    if args.exact_match is not None:
        if args.exact_match < 0:
            raise SystemExit("pagoda bench: --exact-match takes a count >= 0")
        return args.exact_match
    return 16 if kv_cache_dtype != dtype else 0


def _hf_dtypes(args: argparse.Namespace, engine: str) -> tuple[str, ...]:
    if args.hf_dtypes == "auto":
        return tuple(dict.fromkeys(("float32", engine)))
    dtypes = tuple(d.strip() for d in args.hf_dtypes.split(",") if d.strip())
    bad = [d for d in dtypes if d not in DTYPES or d == "auto"]
    if bad or not dtypes:
        raise SystemExit(f"pagoda bench: --hf-dtypes takes float32, float16, bfloat16; got {args.hf_dtypes!r}")
    return dtypes


def load_workload(args: argparse.Namespace, model_dir: Path, tokenizer: Any) -> Workload:
    if args.dataset:
        return load_jsonl(args.dataset, tokenizer, args.num_requests, args.output_len, args.seed)
    vocab = json.loads((model_dir / "config.json").read_text()).get("vocab_size")
    return make_workload(tokenizer, args.num_requests, args.prompt_len, args.output_len,
                         args.seed, vocab_size=vocab)


def _tokenizer(model_dir: Path) -> Any:
    """The model's tokenizer, or None for a model without one (then token-id prompts)."""
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pagoda.bench.report import add_online, add_vllm_rounds, build_report
    from pagoda.bench.stats import summarize
    from pagoda.model_fetch import resolve_model

    mode, progress = _mode(args), not args.no_progress
    baselines = set(args.baseline or ())
    bs1: dict[str, float] | None = None
    bs1_bandwidth: list[float] = []  # read bandwidth just before and just after the bs1 probe
    start_s: float | None = None  # the offline engine's construction (model load, KV pool)
    cpu: dict[str, float | None] | None = None  # a launched run's CPU seconds by role
    online: OnlineComparison | None = None
    vllm_rounds: VllmRounds | None = None
    max_model_len = 0  # the offline engine's, which the vLLM baseline is given too
    step_log: list[Any] | None = None  # --roofline on a CPU: the offline pass's steps
    kv_token_bytes = 0
    model_dir = resolve_model(_settings(args).model)
    dtype, kv_cache_dtype = engine_dtype(args), engine_kv_cache_dtype(args)
    exact_n = exact_match_requests(args, dtype, kv_cache_dtype)
    if args.online_rounds > 1 and engine_device(args) != "cpu":
        raise SystemExit("pagoda bench: --online-rounds > 1 keeps the offline engine and the "
                         "launched stack up together, two KV pools; on a GPU each takes the "
                         "device's memory: use --online-rounds 1")
    if exact_n and mode != "offline":
        raise SystemExit("pagoda bench: --exact-match runs in offline mode; drop "
                         "--launch/--url/--native")
    exact_ours: list[list[int]] | None = None
    roofline_machine = None
    if args.roofline:  # measured first, on an idle machine
        from pagoda.bench.roofline import measure_machine

        roofline_machine = measure_machine(engine_device(args), dtype)
    if mode == "offline":
        from pagoda.bench.runner_offline import (
            BS1_OUTPUT,
            bs1_probe,
            measure_bs1,
            warm_up,
        )
        from pagoda.llm import LLM
        from shared.heap import freeze_startup_heap

        started = time.perf_counter()  # as the vLLM baseline times its LLM()
        llm = LLM(str(model_dir), **_engine_settings(args))
        start_s = time.perf_counter() - started
        work = load_workload(args, model_dir, llm.tokenizer)
        warm_up(llm, work)
        # as the worker process does once it is built (shared/heap.py); undone before the
        # engine is dropped, so its memory is freed for the baselines
        freeze_startup_heap()
        if args.roofline and engine_device(args) == "cpu":  # each step beside its roofline
            llm.engine.step_log = []  # (a CUDA step's execute returns before it ends)
        records, scheduler = _offline_pass(args, llm, work, progress)
        step_log, llm.engine.step_log = llm.engine.step_log, None
        if step_log:  # the K/V bytes a token holds in the pool, over every rank
            from services.worker.model_runner import kv_cache_bytes_per_block

            runner = llm.engine.runner
            kv_token_bytes = (kv_cache_bytes_per_block(runner.model, 1, runner.kv_caches[0][0].dtype)
                              * llm.engine.settings.tensor_parallel_size)
        if "vllm" in baselines or args.roofline:  # batch-1 latencies, as vLLM's are measured
            if args.roofline:  # the probe's floor: the bandwidth of the moment around it
                from pagoda.bench.roofline import measure_read_bandwidth

                bs1_bandwidth = [measure_read_bandwidth(engine_device(args))]
            bs1 = measure_bs1(llm, bs1_probe(work), BS1_OUTPUT)
            if args.roofline:
                bs1_bandwidth.append(measure_read_bandwidth(engine_device(args)))
        if exact_n:
            from pagoda.bench.exact_match import pagoda_tokens

            exact_ours = pagoda_tokens(llm, work, exact_n)
        if args.online and args.online_rounds > 1:
            online = _alternating_rounds(args, llm, work, str(model_dir), (records, scheduler),
                                         progress)
        max_model_len = llm.engine.max_model_len
        if "vllm" in baselines and args.vllm_rounds > 1:
            vllm_rounds = _vllm_rounds(args, llm, work, str(model_dir), dtype,
                                       summarize(records)["output_tok_s"],
                                       scheduler["prefix_cache_hits"], progress)
        llm.close()
        gc.unfreeze()
        del llm  # free its KV cache before the baseline loads another copy of the model
        _release_memory()
        if args.online and online is None:  # the same requests through pagoda serve
            online_records, _, online_cpu = _run_online(args, "http", str(model_dir), work,
                                                        progress, launch=True)
            online = OnlineComparison(online_records, online_cpu)
    else:
        work = load_workload(args, model_dir, _tokenizer(model_dir))
        records, scheduler, cpu = _run_online(args, mode, str(model_dir), work, progress,
                                              launch=args.launch)
    hf = vllm = None
    if vllm_rounds is not None:
        vllm = vllm_rounds.figures
    elif "vllm" in baselines:
        from pagoda.bench.baseline_vllm import run_vllm_baseline
        from pagoda.bench.runner_offline import BS1_OUTPUT, bs1_probe

        if mode != "offline":
            raise SystemExit("pagoda bench: --baseline vllm compares offline runs; drop --launch/--url")
        vllm = run_vllm_baseline(str(model_dir), work, dtype, max_model_len, bs1_probe(work),
                                 BS1_OUTPUT)
    if "hf" in baselines:
        from pagoda.bench.baseline_hf import run_hf_baseline

        hf = run_hf_baseline(str(model_dir), work, [int(x) for x in args.hf_batch_sizes.split(",")],
                             progress, _hf_dtypes(args, dtype), device=engine_device(args))
    exact = None
    if exact_ours is not None:
        from pagoda.bench.exact_match import compare, hf_tokens

        exact = {**compare(exact_ours, hf_tokens(str(model_dir), work, len(exact_ours), dtype,
                                                 engine_device(args), progress)),
                 "oracle": f"HF transformers {dtype}, one at a time",
                 "kv_cache_dtype": kv_cache_dtype}
    config = {
        "model": _settings(args).model, "model_dir": str(model_dir), "mode": mode,
        "launch": bool(args.launch), "num_requests": len(work),
        "prompt_len": None if args.dataset else str(args.prompt_len),
        "output_len": str(args.output_len), "dataset": args.dataset, "seed": args.seed,
        "request_rate": args.request_rate if args.request_rate != float("inf") else None,
        "max_concurrency": args.max_concurrency, "engine": _engine_settings(args),
        "engine_dtype": dtype, "engine_device": engine_device(args),
        "engine_kv_cache_dtype": kv_cache_dtype,
    }
    report = build_report(config, records, scheduler, hf, vllm=vllm, bs1=bs1, cpu=cpu,
                          start_s=start_s)
    report["exact_match"] = exact
    if vllm_rounds is not None and vllm_rounds.figures is not None:
        add_vllm_rounds(report, vllm_rounds.rounds)
    if online is not None:
        add_online(report, online.records, online.cpu,
                   {"transport": "http", "frontends": args.frontends,
                    "max_concurrency": args.max_concurrency}, online.rounds)
    if roofline_machine is not None:
        from pagoda.bench.roofline import bs1_floor, ceiling, count_parameters, matmul_parameters

        bytes_per_param = 4 if dtype == "float32" else 2
        layer_params, lm_head_params = matmul_parameters(model_dir)
        roof = ceiling(roofline_machine, count_parameters(model_dir), bytes_per_param,
                       report["pagoda"], layer_params, lm_head_params)
        if bs1 and bs1_bandwidth:
            roof.update(bs1_floor(bs1["tpot_s"], roof, bs1_bandwidth))
        if step_log:
            from pagoda.bench.roofline import step_breakdown

            roof["steps"] = step_breakdown(step_log, roofline_machine,
                                           count_parameters(model_dir), bytes_per_param,
                                           layer_params, lm_head_params, kv_token_bytes)
        report["roofline"] = roof
    return report


def _release_memory() -> None:
    """Hands a dropped engine's memory back (its CUDA blocks too, for the next model)."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


OnlinePass = tuple[list[Any], dict[str, Any], dict[str, float | None] | None]


@dataclass(frozen=True)
class OnlineComparison:
    """``--online``: the first online pass (records, CPU seconds by role) and, with
    ``--online-rounds``, every round's figures."""

    records: list[Any]
    cpu: dict[str, float | None] | None
    rounds: list[dict[str, Any]] | None = None


def _online_pass(args: argparse.Namespace, mode: str, work: Workload, progress: bool,
                 url: str | None, native: tuple[str, ...], metrics_url: str | None,
                 ) -> tuple[list[Any], dict[str, Any]]:
    from pagoda.bench.runner_online import HttpSender, ZmqSender, bench_online

    def make() -> Any:
        if mode == "zmq":
            return ZmqSender(native)
        return HttpSender(url or "http://127.0.0.1:8000/v1")

    return asyncio.run(bench_online(make, work, metrics_url, args.request_rate,
                                    args.max_concurrency, args.seed, progress, f"pagoda {mode}"))


@contextmanager
def _launched_passes(args: argparse.Namespace, mode: str, model_dir: str,
                     progress: bool,
                     ) -> Iterator[tuple[Callable[[Workload], OnlinePass], dict[str, int]]]:
    """A launched stack, up until the block ends, as a function that serves one workload
    through it and returns that pass's records, scheduler figures and CPU seconds by role
    (each pass's warm-up, two short requests, counts in it), and its processes' ids."""
    from pagoda.bench.cpu_usage import CpuMeter
    from pagoda.bench.launch import launched_stack
    from shared.config import ProcessSettings
    from shared.ipc import lower_cpu_priority

    with launched_stack(model_dir, args.frontends, _engine_settings(args)) as stack:
        meter = CpuMeter(stack.pids)

        def serve(work: Workload) -> OnlinePass:
            # the client shares the stack's cores: it runs at the scheduler's and
            # frontends' priority, below the worker's, in a thread of its own (a thread's
            # nice value is its own on Linux, and this process's other work keeps its own)
            def client() -> tuple[list[Any], dict[str, Any]]:
                lower_cpu_priority(ProcessSettings().service_nice)  # the stack's default
                return _online_pass(args, mode, work, progress, stack.http_base, stack.native,
                                    args.metrics_url or stack.metrics_url)

            meter.start()
            records, scheduler = _run_in_thread(client)
            return records, scheduler, meter.stop()

        yield serve, stack.pids


def _run_online(args: argparse.Namespace, mode: str, model_dir: str, work: Workload,
                progress: bool, *, launch: bool) -> OnlinePass:
    """The records, the scheduler's figures and, for a launched stack, the CPU seconds
    each role took during the run (None for a server run elsewhere)."""
    if launch:
        with _launched_passes(args, mode, model_dir, progress) as (serve, _):
            return serve(work)
    metrics = args.metrics_url
    if metrics is None and args.url:
        metrics = args.url.rstrip("/").removesuffix("/v1") + "/metrics"
    records, scheduler = _online_pass(args, mode, work, progress, args.url,
                                      tuple(args.native or ()), metrics)
    return records, scheduler, None


def _alternating_rounds(args: argparse.Namespace, llm: Any, work: Workload, model_dir: str,
                        first_offline: tuple[list[Any], dict[str, Any]],
                        progress: bool) -> OnlineComparison:
    """``--online-rounds N``: the offline pass already run, then the online one, then
    N - 1 more rounds of the two in alternating order (online first in odd rounds), so
    that a machine whose speed drifts over minutes weighs on both sides alike. Round r
    serves the workload salted by r in both engines (Workload.salted), which stay up.
    ``--online-launches L``: N rounds more on each of L - 1 freshly launched stacks (the
    offline engine stays up, so the salts keep counting)."""
    from pagoda.bench.stats import summarize

    vocab_size = llm.engine.model_config.vocab_size

    rounds: list[dict[str, Any]] = []

    def add(off: tuple[list[Any], dict[str, Any]], on: OnlinePass, online_first: bool,
            launch: int, worker_pid: int | None) -> None:
        rounds.append({"offline_output_tok_s": summarize(off[0])["output_tok_s"],
                       "online_output_tok_s": summarize(on[0])["output_tok_s"],
                       "online_first": online_first, "launch": launch,
                       "worker_pid": worker_pid, "online_cpu_s": on[2],
                       "offline_prefix_cache_hits": off[1]["prefix_cache_hits"],
                       "online_prefix_cache_hits": on[1]["prefix_cache_hits"]})

    first: OnlinePass | None = None
    for launch in range(args.online_launches):
        with _launched_passes(args, "http", model_dir, progress) as (serve, pids):
            worker_pid = pids.get("worker-0")
            for r in range(args.online_rounds):
                salt = launch * args.online_rounds + r
                if salt == 0:
                    first = serve(work)
                    add(first_offline, first, False, launch, worker_pid)
                    continue
                salted = work.salted(salt, vocab_size)
                if r % 2:
                    on = serve(salted)
                    add(_offline_pass(args, llm, salted, progress), on, True, launch, worker_pid)
                else:
                    off = _offline_pass(args, llm, salted, progress)
                    add(off, serve(salted), False, launch, worker_pid)
    assert first is not None
    return OnlineComparison(first[0], first[2], rounds)


def _offline_pass(args: argparse.Namespace, llm: Any, work: Workload,
                  progress: bool) -> tuple[list[Any], dict[str, Any]]:
    """One pass of ``work`` through the offline engine as the command line sets it up."""
    from pagoda.bench.runner_offline import run_offline

    return run_offline(llm, work, args.request_rate, args.max_concurrency, args.seed, progress)


@dataclass(frozen=True)
class VllmRounds:
    """``--vllm-rounds``: vLLM's figures (its first pass and batch-1 probe; None when
    vLLM is not installed) and every round's pagoda and vLLM output tokens/s."""

    figures: dict[str, Any] | None
    rounds: list[dict[str, Any]]


def _vllm_rounds(args: argparse.Namespace, llm: Any, work: Workload, model_dir: str,
                 dtype: str, first_output_tok_s: float, first_hits: float | None,
                 progress: bool) -> VllmRounds:
    """vLLM's runner up beside the offline engine: its first pass against pagoda's first,
    then N - 1 rounds of a pass of each in alternating order (vLLM first in odd rounds),
    round r on the workload salted past every salt the online rounds used, so that a
    machine whose speed drifts over minutes weighs on both engines alike."""
    from pagoda.bench.baseline_vllm import vllm_session
    from pagoda.bench.runner_offline import BS1_OUTPUT, bs1_probe
    from pagoda.bench.stats import summarize

    vocab_size = llm.engine.model_config.vocab_size
    first_salt = max(1, args.online_rounds * args.online_launches) if args.online else 1
    salted = [work.salted(first_salt + r - 1, vocab_size) for r in range(1, args.vllm_rounds)]

    def pagoda_pass(w: Workload) -> tuple[float, float | None]:
        records, scheduler = _offline_pass(args, llm, w, progress)
        return float(summarize(records)["output_tok_s"]), scheduler["prefix_cache_hits"]

    with vllm_session(model_dir, work, dtype, llm.engine.max_model_len, bs1_probe(work),
                      BS1_OUTPUT, rounds=salted) as session:
        if session is None:
            return VllmRounds(None, [])
        rounds = [{"pagoda_output_tok_s": first_output_tok_s,
                   "vllm_output_tok_s": session.figures["output_tok_s"], "vllm_first": False,
                   "pagoda_prefix_cache_hits": first_hits}]
        for r, w in enumerate(salted, start=1):
            if r % 2:
                theirs = session.run_round(r)["output_tok_s"]
                ours, hits = pagoda_pass(w)
            else:
                ours, hits = pagoda_pass(w)
                theirs = session.run_round(r)["output_tok_s"]
            rounds.append({"pagoda_output_tok_s": ours, "vllm_output_tok_s": theirs,
                           "vllm_first": bool(r % 2), "pagoda_prefix_cache_hits": hits})
        return VllmRounds(session.figures, rounds)


def _run_in_thread(fn: Callable[[], Any]) -> Any:
    """fn() in a new thread, its result or exception handed back here."""
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
            out["error"] = e

    thread = threading.Thread(target=body, name="bench-client")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _settings(args)
    except ConfigError as e:
        print(f"pagoda bench: {e}", file=sys.stderr)
        return 2
    from pagoda.bench.report import format_text, write_json, write_png

    report = run(args)
    print(format_text(report), flush=True)
    if args.output_json:
        write_json(report, args.output_json)
        print(f"wrote {args.output_json}")
    if args.output_png:
        write_png(report, args.output_png)
        print(f"wrote {args.output_png}")
    return 0 if report["pagoda"]["num_completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
