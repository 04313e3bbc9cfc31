"""Benchmark (not a test): one decode step of the model runner vs one HF forward.

    python -m pagoda.bench.worker [--model smollm2] [--batch-sizes 1,8,32,64] [--context 512]

For each batch size, B requests sit at `context` tokens in the paged KV cache (the
cache holds random K/V: the timing does not depend on the values) and one decode
step runs through the whole runner (input building, model, greedy sampler). The
baseline is HF transformers' forward of the same batch, one new token per sequence
over a DynamicCache of the same length, timed in the same run. Median of N steps.
Both run in this process, after the allocator settings a CPU worker applies
(``services/worker/cpu_memory.py``), so HF gets them too.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from pagoda.bench.step_profile import decode_driver
from services.worker.runner_builder import RunnerSpec, build_runner
from shared.config import EngineSettings


def _time(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_runner(model_dir: str, batch: int, context: int, repeats: int, block_size: int = 16) -> float:
    # blocks for the context and the warm-up + repeats decode steps, and block 0 left alone
    per_seq = -(-(context + repeats + 2) // block_size)
    # the same runner a CPU worker builds (packed linears, allocator settings)
    settings = EngineSettings(model=model_dir, block_size=block_size,
                              num_kv_blocks=batch * per_seq + 1, dtype="float32", device="cpu")
    runner = build_runner(Path(model_dir), RunnerSpec.from_settings(settings)).runner
    return _time(decode_driver(runner, batch, context, repeats + 1), repeats)


def bench_hf(model_dir: str, batch: int, context: int, repeats: int) -> float:
    from transformers import AutoModelForCausalLM, DynamicCache

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = hf.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache = DynamicCache()
    shape = (batch, cfg.num_key_value_heads, context, head_dim)
    for layer in range(cfg.num_hidden_layers):
        cache.update(torch.randn(shape), torch.randn(shape), layer)
    input_ids = torch.randint(0, cfg.vocab_size, (batch, 1))
    mask = torch.ones(batch, context + 1, dtype=torch.long)
    positions = torch.full((batch, 1), context)

    @torch.inference_mode()
    def forward() -> None:
        hf(input_ids=input_ids, attention_mask=mask, position_ids=positions,
           past_key_values=cache, use_cache=True)
        cache.crop(-1)  # drop the token just appended (negative = remove that many)

    return _time(forward, repeats)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    from pagoda.model_fetch import resolve_model

    model_dir = str(resolve_model(args.model))
    print(f"model {args.model}, context {args.context}, torch threads {torch.get_num_threads()}")
    print(f"{'batch':>5} {'pagoda ms':>10} {'HF ms':>10} {'pagoda/HF':>10} {'pagoda tok/s':>12}")
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        ours = bench_runner(model_dir, batch, args.context, args.repeats)
        hf = bench_hf(model_dir, batch, args.context, args.repeats)
        print(f"{batch:>5} {ours * 1e3:>10.1f} {hf * 1e3:>10.1f} {ours / hf:>10.2f} {batch / ours:>12.1f}",
              flush=True)


if __name__ == "__main__":
    main()
