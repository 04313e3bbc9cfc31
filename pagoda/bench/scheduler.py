"""Benchmark (not a test): the scheduler's own step time, and offline LLM throughput.

    python -m pagoda.bench.scheduler step [--running 256,1024] [--steps 200]
    python -m pagoda.bench.scheduler llm [--model smollm2] [--requests 64]
                                         [--hf-batch-sizes 8,16,32,64]

``step``: N requests with prompts of 1..4096 tokens are prefilled, then each decode
step's ``schedule()`` + ``update()`` is timed (a stand-in runner that returns a fixed
token runs between them, untimed); no model runs, so the figure is the scheduler's own
cost per step.

``llm``: a seeded workload of mixed prompt and output lengths (exact output lengths
through ``ignore_eos``; ``pagoda.bench.workload``) through ``LLM.generate``, beside HF
transformers ``generate`` (``pagoda.bench.baseline_hf``)
on the same requests in the same run, in static batches of each given size (left
padding, ``min_new_tokens = max_new_tokens`` = the batch's longest output; only the
requested tokens count), in fp32 and in the dtype pagoda computes in (bf16 on a CPU with
native bf16). The ratio is against HF's best batch size and dtype.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

from pagoda.bench.baseline_hf import bench_hf_static
from pagoda.bench.workload import Workload, make_workload
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from shared.config import EngineSettings
from shared.heap import freeze_startup_heap
from shared.protocol import StepBatch, StepResult
from shared.sampling_params import SamplingParams


class FixedTokenRunner:
    """Stands in for the workers: every sequence that reaches its last known token
    samples token 7. Tracks only the lengths it needs to tell who samples."""

    def __init__(self) -> None:
        self.lengths: dict[int, list[int]] = {}  # seq_id -> [num_tokens, num_computed]

    def execute(self, batch: StepBatch) -> StepResult:
        for rid in batch.finished_request_ids:
            self.lengths.pop(rid, None)
        for new in batch.new_requests:
            self.lengths[new.request_id] = [len(new.token_ids), new.num_computed_tokens]
        ids: list[int] = []
        for rid, n in zip(batch.scheduled_request_ids, batch.num_scheduled_tokens):
            state = self.lengths[rid]
            state[1] += n
            if state[1] == state[0]:
                state[0] += 1
                ids.append(rid)
        return StepResult(batch.step_id, ids, [7] * len(ids), [None] * len(ids))


def bench_step(num_running: int, steps: int, seed: int = 0) -> float:
    """Median seconds of one decode step (schedule + fixed runner + update)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 30000) for _ in range(rng.randint(1, 4096))] for _ in range(num_running)]
    block_size = 16
    num_blocks = sum(len(p) // block_size + steps // block_size + 3 for p in prompts)
    settings = EngineSettings(block_size=block_size, max_num_seqs=num_running,
                              max_num_batched_tokens=1 << 20)
    sched = Scheduler(SchedulerConfig.from_settings(
        settings, num_blocks=num_blocks, max_model_len=8192, vocab_size=32000))
    params = SamplingParams(temperature=0.0, max_tokens=steps + 10, ignore_eos=True)
    for i, p in enumerate(prompts):
        sched.add_request(str(i), p, params)
    runner = FixedTokenRunner()
    batch = sched.schedule()  # one step prefills everything
    sched.update(batch, runner.execute(batch))
    # as the scheduler process does after start-up: the block pool and the long-lived
    # request state leave the collector's generations (shared/heap.py)
    freeze_startup_heap()
    times = []
    for _ in range(steps):
        # the scheduler's own work: schedule() and update(), not the stand-in runner
        t0 = time.perf_counter()
        batch = sched.schedule()
        t1 = time.perf_counter()
        result = runner.execute(batch)
        t2 = time.perf_counter()
        sched.update(batch, result)
        times.append((t1 - t0) + (time.perf_counter() - t2))
        assert len(batch.scheduled_request_ids) == num_running
    gc.unfreeze()
    return statistics.median(times)


def bench_llm_outputs(settings: EngineSettings, work: Workload) -> tuple[float, list[list[int]]]:
    """Output tokens per second of LLM.generate on the workload, and the tokens."""
    from dataclasses import asdict

    from pagoda.llm import LLM

    llm = LLM(**asdict(settings))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in work.output_lens]
    llm.generate(work.prompts[:2], params[:2], use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(work.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    assert sum(map(len, tokens)) == sum(work.output_lens)
    return sum(map(len, tokens)) / elapsed, tokens


def bench_llm(model: str, work: Workload) -> float:
    return bench_llm_outputs(EngineSettings(model=model), work)[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    st = sub.add_parser("step")
    st.add_argument("--running", default="256,1024")
    st.add_argument("--steps", type=int, default=200)
    ll = sub.add_parser("llm")
    ll.add_argument("--model", default="smollm2")
    ll.add_argument("--requests", type=int, default=64)
    ll.add_argument("--prompt-range", default="32,512")
    ll.add_argument("--output-range", default="16,256")
    ll.add_argument("--hf-batch-sizes", default="8,16,32,64")
    args = parser.parse_args(argv)
    if args.what == "step":
        print(f"{'running':>8} {'step ms':>8} {'target ms':>9}")
        for n in (int(x) for x in args.running.split(",")):
            print(f"{n:>8} {bench_step(n, args.steps) * 1e3:>8.3f} {'1.000' if n == 256 else '-':>9}", flush=True)
        return
    from transformers import AutoTokenizer

    from pagoda.model_fetch import resolve_model

    model_dir = str(resolve_model(args.model))
    pr = tuple(int(x) for x in args.prompt_range.split(","))
    orange = tuple(int(x) for x in args.output_range.split(","))
    work = make_workload(AutoTokenizer.from_pretrained(model_dir), args.requests, pr, orange)  # type: ignore[arg-type]
    print(f"{args.requests} requests, prompts {pr}, outputs {orange}, {sum(work.output_lens)} output tokens")
    ours = bench_llm(model_dir, work)
    print(f"pagoda LLM (dtype auto): {ours:.1f} output tok/s", flush=True)
    from services.worker.runner_builder import resolve_device, resolve_dtype_name

    device = resolve_device("auto")  # the LLM's (device auto): HF runs beside it there
    engine_dtype = resolve_dtype_name("auto", device)
    best = 0.0
    for dtype in dict.fromkeys(("float32", engine_dtype)):
        for bs in (int(x) for x in args.hf_batch_sizes.split(",")):
            hf = bench_hf_static(model_dir, work, bs, dtype, str(device))
            best = max(best, hf)
            print(f"HF generate ({dtype}), static batch {bs}: {hf:.1f} output tok/s", flush=True)
    print(f"pagoda / HF best static batching: {ours / best:.2f}x (target >= 3x)")


if __name__ == "__main__":
    main()
