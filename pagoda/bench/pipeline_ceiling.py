"""Benchmark (not a test): what the pipeline around the model carries, at a GPU's pace.

    python -m pagoda.bench.pipeline_ceiling [--model smollm2] [--step-ms 2] [--frontends 2]
        [--num-requests 256] [--max-concurrency 64] [--transport zmq|http]
        [--no-async-scheduling] [--output-json FILE]

A launched stack whose worker is ``pagoda.bench.synthetic_worker``: the real scheduler,
frontends, wire and client, and a worker that answers each step after ``--step-ms``
without a model (the emulated forward pass). At batch 64 and 2 ms a step, the model
side would deliver 32k output tokens/s; what arrives is the pipeline's ceiling. It
prints, side by side: output tokens/s against that ideal, the worker's busy share (the
time it spent on steps over the wall time: how much of the time a GPU would be fed), the
steps per second, and each role's CPU seconds and CPU microseconds per output token
(scheduler, frontends, client), so the role that sets the ceiling shows. Run it once
with and once without ``--no-async-scheduling`` to see what overlapping the scheduler
with the step buys.

On a 2-core box every process shares the two cores, so the figures are a lower bound
of what a GPU host (16+ cores) carries; the per-token CPU costs carry over.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

from pagoda.bench.cpu_usage import CpuMeter
from pagoda.bench.launch import launched_stack
from pagoda.bench.runner_online import HttpSender, ZmqSender, run_online
from pagoda.bench.stats import summarize
from pagoda.bench.workload import LengthDist, make_workload
from pagoda.model_fetch import resolve_model
from shared.tokenizer_loader import load_tokenizer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pagoda.bench.pipeline_ceiling",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="its tokenizer and config only")
    p.add_argument("--step-ms", type=float, default=2.0, help="the emulated step time")
    p.add_argument("--frontends", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=LengthDist.parse, default=LengthDist(128, 128))
    p.add_argument("--output-len", type=LengthDist.parse, default=LengthDist(256, 256))
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--transport", choices=("zmq", "http"), default="zmq")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--output-json", default=None)
    p.add_argument("--no-progress", action="store_true")
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = str(resolve_model(args.model))
    tokenizer = load_tokenizer(Path(model_dir))
    vocab = None if tokenizer is not None else json.loads(
        (Path(model_dir) / "config.json").read_text())["vocab_size"]
    work = make_workload(tokenizer, args.num_requests, args.prompt_len, args.output_len, seed=0,
                         vocab_size=vocab)
    engine = {"max_num_seqs": args.max_concurrency, "async_scheduling": args.async_scheduling,
              "service_nice": 0}
    with tempfile.TemporaryDirectory(prefix="pagoda-ceiling-") as tmp:
        stats = Path(tmp) / "worker.json"
        worker = ("pagoda.bench.synthetic_worker",
                  ["--step-ms", str(args.step_ms), "--stats-file", str(stats)])
        with launched_stack(model_dir, args.frontends, engine, worker) as stack:
            sender = (ZmqSender(stack.native) if args.transport == "zmq"
                      else HttpSender(stack.http_base))
            meter = CpuMeter(stack.pids)
            meter.start()

            async def drive() -> Any:
                try:
                    return await run_online(sender, work, max_concurrency=args.max_concurrency,
                                            progress=not args.no_progress, label="pipeline")
                finally:
                    await sender.aclose()

            records = asyncio.run(drive())
            cpu = meter.stop()
        # the worker wrote its totals when the stack stopped: it served only this run
        worker_stats = json.loads(stats.read_text()) if stats.exists() else {}
    steps, busy_s = worker_stats.get("steps", 0), worker_stats.get("busy_s", 0.0)
    summary = summarize(records)
    wall = summary["duration_s"]  # first request sent to last token in
    out_tokens = summary["output_tokens"]
    ideal = args.max_concurrency / (args.step_ms / 1000)
    report = {
        "step_ms": args.step_ms, "frontends": args.frontends, "transport": args.transport,
        "async_scheduling": args.async_scheduling, "max_concurrency": args.max_concurrency,
        "failed": summary["num_failed"], "output_tokens": out_tokens,
        "output_tok_s": summary["output_tok_s"], "ideal_output_tok_s": ideal,
        "steps": steps, "steps_per_s": steps / wall if wall else 0.0,
        "worker_busy_share": busy_s / wall if wall else 0.0,
        "cpu_s": cpu,
        "cpu_us_per_output_token": {role: (s / out_tokens * 1e6 if s is not None and out_tokens
                                           else None)
                                    for role, s in cpu.items() if role != "wall_s"},
    }
    return report


def print_report(r: dict[str, Any]) -> None:
    print(f"pipeline ceiling: {r['frontends']} frontends, {r['transport']}, concurrency "
          f"{r['max_concurrency']}, emulated step {r['step_ms']:g} ms, async scheduling "
          f"{'on' if r['async_scheduling'] else 'off'}")
    print(f"  output tok/s   {r['output_tok_s']:10.0f}   ideal {r['ideal_output_tok_s']:.0f} "
          f"({r['output_tok_s'] / r['ideal_output_tok_s']:.2f}x)   failed {r['failed']}")
    print(f"  steps/s        {r['steps_per_s']:10.0f}   worker busy {r['worker_busy_share']:.0%}")
    print("  role        CPU s   CPU us/token")
    for role, s in r["cpu_s"].items():
        if role == "wall_s":
            continue
        per = r["cpu_us_per_output_token"].get(role)
        print(f"  {role:<10} {s if s is not None else float('nan'):6.2f}   "
              f"{per if per is not None else float('nan'):8.1f}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = run(args)
    print_report(report)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
