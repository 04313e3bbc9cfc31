"""Benchmark (not a test): where one decode step's time goes, through ``torch.profiler``.

    python -m pagoda.bench.step_profile [--model DIR] [--batch 64] [--context 512]
                                        [--device cuda] [--dtype bfloat16] [--output-json F]

B requests sit at ``context`` tokens in the paged KV cache (random K/V: the timing does
not depend on the values) of the ModelRunner a worker builds (``runner_builder``), and
decode steps run through it as StepBatch messages, as a worker receives them (input
building, model, greedy sampler). After the warm-up steps, ``--steps`` unprofiled steps
give the wall time per step (median); then ``--profile-steps`` steps run under the
profiler, and per step it counts:

- CPU-side ops: every operator the dispatcher ran (``aten::*`` and custom ops, nested
  ones too), and the top-level ones (each one call from Python);
- on CUDA: kernels run on the GPU (and the launch calls that queued them), their summed
  time, and the GPU-busy share = that time / the unprofiled wall time per step (1.0: the
  GPU never waits for the CPU); on a CPU these fields are null;
- the top ops by self CPU time and the top kernels by GPU time.

The result prints as text and, with ``--output-json``, as JSON. The engine flags
(``--device``, ``--dtype``, ``--attention-backend``, ``--block-size``, ``--kv-cache-bytes``
...) are ``pagoda serve``'s; without a KV size the pool holds exactly the batch.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from shared.config import ConfigError, EngineSettings, add_arguments, engine_settings

_LAUNCH_CALLS = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                 "cudaGraphLaunch", "cudaLaunchCooperativeKernel"}
_RUNTIME_CALL = re.compile(r"^cu[A-Z]|^cuda[A-Z]")  # driver/runtime API calls, not ops


def decode_driver(runner: Any, batch: int, context: int, num_steps: int,
                  seed: int = 0) -> Callable[[], None]:
    """Seats ``batch`` requests at ``context`` tokens (one step computing each one's last
    prompt token) and returns a function running one decode step of all of them; the
    requests' blocks cover ``num_steps`` more tokens."""
    from shared.protocol import NewRequest, RunningRequest, StepBatch
    from shared.sampling_params import SamplingParams

    per_seq = -(-(context + num_steps + 1) // runner.block_size)
    if batch * per_seq + 1 > runner.num_blocks:  # block 0 is left alone, as the scheduler does
        raise ValueError(f"the KV pool has {runner.num_blocks} blocks; batch {batch} at context "
                         f"{context} + {num_steps} steps needs {batch * per_seq + 1}")
    for k, v in runner.kv_caches:
        k.normal_()
        v.normal_()
    gen = torch.Generator().manual_seed(seed)
    vocab = runner.model.config.vocab_size
    greedy = SamplingParams(temperature=0.0, max_tokens=None)
    news = [NewRequest(i, torch.randint(0, vocab, (context,), generator=gen).tolist(), context,
                       greedy, list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)), context - 1)
            for i in range(batch)]
    ids = [n.request_id for n in news]
    step_ids = iter(range(10**9))
    runner.execute(StepBatch(next(step_ids), news, [], ids, [1] * batch))
    running = [RunningRequest(r) for r in ids]

    def decode() -> None:
        runner.execute(StepBatch(next(step_ids), [], running, ids, [1] * batch))

    return decode


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[], None], num_steps: int, device: torch.device) -> list[float]:
    """Wall seconds of each of ``num_steps`` steps (a step ends with its sampled ids on the
    host, so its GPU work is done by then; the sync only keeps earlier work out)."""
    times = []
    for _ in range(num_steps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def profile_steps(step: Callable[[], None], num_steps: int,
                  device: torch.device) -> tuple[Any, float]:
    """The profiler's events of ``num_steps`` steps (CUDA activity too on a GPU), and the
    wall seconds per step under it."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(num_steps):
            step()
        _sync(device)
        wall = (time.perf_counter() - t0) / num_steps
    return prof.events(), wall


def _top(totals: dict[str, list[float]], num_steps: int, top: int) -> list[dict[str, Any]]:
    """name -> [calls, microseconds] as rows per step, the most time first."""
    rows = sorted(totals.items(), key=lambda kv: kv[1][1], reverse=True)[:top]
    return [{"name": name, "calls_per_step": calls / num_steps, "us_per_step": us / num_steps}
            for name, (calls, us) in rows]


def summarize_events(events: Iterable[Any], num_steps: int, wall_s: float, on_cuda: bool,
                     top: int = 15) -> dict[str, Any]:
    """Per-step counts and times from profiler events (``FunctionEvent``s); ``wall_s``:
    the unprofiled wall time per step, which the GPU-busy share divides by."""
    from torch.autograd import DeviceType

    cpu_ops = top_level = launches = kernels = 0
    kernel_us = 0.0
    cpu_totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    gpu_totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.device_type == DeviceType.CPU:
            if e.name in _LAUNCH_CALLS:
                launches += 1
            if e.is_async or _RUNTIME_CALL.match(e.name):
                continue
            cpu_ops += 1
            top_level += e.cpu_parent is None
            cpu_totals[e.name][0] += 1
            cpu_totals[e.name][1] += e.self_cpu_time_total
        else:  # a kernel, memcpy or memset on the GPU
            us = e.time_range.elapsed_us()
            kernels += not e.name.startswith(("Memcpy", "Memset"))
            kernel_us += us
            gpu_totals[e.name][0] += 1
            gpu_totals[e.name][1] += us
    gpu_s = kernel_us * 1e-6 / num_steps
    return {
        "cpu_ops_per_step": cpu_ops / num_steps,
        "top_level_cpu_ops_per_step": top_level / num_steps,
        "cuda_kernels_per_step": kernels / num_steps if on_cuda else None,
        "cuda_launch_calls_per_step": launches / num_steps if on_cuda else None,
        "gpu_time_s_per_step": gpu_s if on_cuda else None,
        "gpu_busy_share": gpu_s / wall_s if on_cuda else None,
        "top_cpu_ops": _top(cpu_totals, num_steps, top),
        "top_cuda_kernels": _top(gpu_totals, num_steps, top) if on_cuda else None,
    }


def run(settings: EngineSettings, batch: int, context: int, warmup: int, steps: int,
        num_profiled: int, top: int = 15, seed: int = 0) -> dict[str, Any]:
    from pagoda.model_fetch import resolve_model
    from services.worker.runner_builder import RunnerSpec, build_runner

    model_dir = resolve_model(settings.model, progress=False)
    built = build_runner(model_dir, RunnerSpec.from_settings(settings))
    runner = built.runner
    step = decode_driver(runner, batch, context, warmup + steps + num_profiled, seed)
    time_steps(step, warmup, runner.device)
    times = time_steps(step, steps, runner.device)
    wall = statistics.median(times)
    events, profiled_wall = profile_steps(step, num_profiled, runner.device)
    on_cuda = runner.device.type == "cuda"
    return {
        "config": {
            "model": settings.model, "model_dir": str(model_dir), "batch": batch,
            "context": context, "device": str(runner.device),
            "device_name": torch.cuda.get_device_name(runner.device) if on_cuda else "cpu",
            "dtype": str(runner.model.embed_tokens.weight.dtype).removeprefix("torch."),
            "kv_cache_dtype": str(runner.kv_caches[0][0].dtype).removeprefix("torch."),
            "attention_backend": type(runner.backend).__name__, "block_size": runner.block_size,
            "warmup_steps": warmup, "timed_steps": steps, "profiled_steps": num_profiled,
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        },
        "wall_s_per_step": {"median": wall, "min": min(times), "max": max(times)},
        "output_tok_s": batch / wall,
        "profiled_wall_s_per_step": profiled_wall,
        **summarize_events(events, num_profiled, wall, on_cuda, top),
    }


def format_text(r: dict[str, Any]) -> str:
    c, w = r["config"], r["wall_s_per_step"]

    def opt(value: float | None, fmt: str, scale: float = 1.0) -> str:
        return "-" if value is None else format(value * scale, fmt)

    kv = c.get("kv_cache_dtype", c["dtype"])
    head = (f"decode step: batch {c['batch']}, context {c['context']}, {c['device_name']} "
            f"{c['dtype']}" + (f" (KV cache {kv})" if kv != c["dtype"] else "")
            + f", {c['attention_backend']}")
    wall = (f"  wall per step   {w['median'] * 1e3:.3f} ms median "
            f"({w['min'] * 1e3:.3f}-{w['max'] * 1e3:.3f}), {r['output_tok_s']:.1f} output tok/s")
    ops = (f"  CPU ops         {r['cpu_ops_per_step']:.0f} per step "
           f"({r['top_level_cpu_ops_per_step']:.0f} called from Python)")
    kernels = (f"  CUDA kernels    {opt(r['cuda_kernels_per_step'], '.0f')} per step, "
               f"{opt(r['cuda_launch_calls_per_step'], '.0f')} launch calls")
    busy = (f"  GPU busy        {opt(r['gpu_busy_share'], '.1%')} "
            f"({opt(r['gpu_time_s_per_step'], '.3f', 1e3)} ms of kernels per step)")
    lines = [head, wall, ops, kernels, busy, "  top CPU ops (self time per step):"]
    lines += [f"    {o['us_per_step']:10.1f} us {o['calls_per_step']:6.1f}x  {o['name'][:70]}"
              for o in r["top_cpu_ops"]]
    if r["top_cuda_kernels"]:
        lines.append("  top CUDA kernels (GPU time per step):")
        lines += [f"    {o['us_per_step']:10.1f} us {o['calls_per_step']:6.1f}x  {o['name'][:70]}"
                  for o in r["top_cuda_kernels"]]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pagoda.bench.step_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64, help="requests decoding together")
    p.add_argument("--context", type=int, default=512, help="tokens each request holds")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--steps", type=int, default=10, help="timed steps (median)")
    p.add_argument("--profile-steps", type=int, default=3, help="steps under the profiler")
    p.add_argument("--top", type=int, default=15, help="rows of each top list")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    add_arguments(p, groups=("engine",))  # only the flags count, as in pagoda bench
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.batch, args.context, args.steps, args.profile_steps) < 1 or args.warmup < 0:
        print("step_profile: --batch, --context, --steps, --profile-steps must be >= 1",
              file=sys.stderr)
        return 2
    given = {f.name: getattr(args, f.name) for f in fields(EngineSettings)
             if getattr(args, f.name, None) is not None}
    given.setdefault("max_num_seqs", args.batch)  # what runs; bounds the CUDA graphs captured
    if "kv_cache_bytes" not in given and "num_kv_blocks" not in given:
        block = given.get("block_size", EngineSettings.block_size)
        total = args.warmup + args.steps + args.profile_steps
        given["num_kv_blocks"] = args.batch * -(-(args.context + total + 1) // block) + 1
    try:
        settings = engine_settings(given, caller="step_profile")
    except ConfigError as e:
        print(f"step_profile: {e}", file=sys.stderr)
        return 2
    report = run(settings, args.batch, args.context, args.warmup, args.steps, args.profile_steps,
                 args.top, args.seed)
    print(format_text(report), flush=True)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.output_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
