"""Benchmark (not a test): offline throughput of one rank vs a tensor-parallel group.

    python -m pagoda.bench.tensor_parallel [--sizes 1,2] [--requests 32] [--dtype float32]

The same workload (random prompt ids, exact output lengths, greedy) runs on the offline
engine (``pagoda.LLM``) once per group size in one process run, the machine's cores
shared out between the ranks (size 1: every core in one rank; size 2: half each). It
prints output tokens/s side by side with the single rank's as a ratio, and for a group
the share of rank 0's wall time spent in collectives (the all-reduces of the o/down
projections and the embedding, the logits gather and the step relay).

SmolLM2 (9 heads) cannot split over 2 ranks, so the default model is a random-weight
Llama of SmolLM2's shape with 8 heads and 4 KV heads (head_dim 72), written once to the
cache; ``--model DIR`` runs any local checkpoint instead.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch

from pagoda.bench.random_model import make_random_model
from pagoda.bench.runner_offline import greedy_exact, run_offline
from pagoda.bench.stats import summarize
from pagoda.bench.workload import Workload
from pagoda.llm import LLM
from pagoda.model_fetch import default_cache_dir

SMOLLM2_SHAPE = {  # SmolLM2-135M's, with heads that split over 2 (and 4) ranks
    "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 8, "num_key_value_heads": 4,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "rope_theta": 100000.0, "bos_token_id": 1, "eos_token_id": 2,
}


def shaped_model(cache: Path) -> Path:
    """The random SmolLM2-shaped checkpoint, made once (``random_model``)."""
    return make_random_model(cache / "bench" / "smollm2-shaped-8h", SMOLLM2_SHAPE)


def workload(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
             vocab: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))]
               for _ in range(n)]
    return Workload(prompts, [rng.randint(*output_range) for _ in range(n)])


def run_size(model: Path, size: int, dtype: str, work: Workload) -> dict[str, float]:
    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)  # the group shares them out (1 rank: all of them)
    with LLM(str(model), dtype=dtype, device="cpu", tensor_parallel_size=size,
             num_kv_blocks=2048, max_model_len=2048) as llm:
        warm = workload(2, (16, 32), (4, 8), 100, seed=1)
        llm.generate(warm.prompts, [greedy_exact(n) for n in warm.output_lens], use_tqdm=False)
        timer = llm.engine.collective_timer()
        before = timer.seconds if timer is not None else 0.0
        started = time.perf_counter()
        records, _ = run_offline(llm, work, progress=False)
        wall = time.perf_counter() - started
        in_collectives = (timer.seconds - before) if timer is not None else 0.0
    summary = summarize(records)
    return {"output_tok_s": summary["output_tok_s"], "wall_s": wall,
            "collective_share": in_collectives / wall, "threads_per_rank": max(1, cores // size)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagoda.bench.tensor_parallel")
    parser.add_argument("--model", default=None, help="a local checkpoint (default: SmolLM2-shaped, random)")
    parser.add_argument("--sizes", default="1,2", help="group sizes, the first is the baseline")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-range", default="32,256")
    parser.add_argument("--output-range", default="16,128")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    model = Path(args.model) if args.model else shaped_model(default_cache_dir())
    sizes = [int(s) for s in args.sizes.split(",")]
    lo_p, hi_p = (int(x) for x in args.prompt_range.split(","))
    lo_o, hi_o = (int(x) for x in args.output_range.split(","))
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    work = workload(args.requests, (lo_p, hi_p), (lo_o, hi_o), vocab)
    print(f"model {model}, {args.dtype}, {len(work)} requests, "
          f"{sum(work.output_lens)} output tokens, {os.cpu_count()} cores")
    results = {size: run_size(model, size, args.dtype, work) for size in sizes}
    base = results[sizes[0]]["output_tok_s"]
    print(f"{'ranks':>5} {'threads/rank':>12} {'output tok/s':>12} {'vs ' + str(sizes[0]):>8} "
          f"{'collectives':>11}")
    for size, r in results.items():
        print(f"{size:>5} {r['threads_per_rank']:>12} {r['output_tok_s']:>12.1f} "
              f"{r['output_tok_s'] / base:>7.2f}x {100 * r['collective_share']:>10.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
