"""Benchmark (not a test): the full process pipeline vs the offline LLM, same requests.

    python -m pagoda.bench.pipeline [--model smollm2] [--requests 64] [--frontends 2]

The workload is ``pagoda.bench.workload``'s (seeded prompts cut from real text,
exact output lengths through ``ignore_eos``, greedy). First the offline ``LLM`` runs it
in this process; then a local stack (``pagoda serve``'s launcher: worker, scheduler,
frontends over ipc://) serves the same requests, all sent at once through the async
client spread over the frontends. Both print output tokens/s; the ratio says what the
process hops cost (target >= 0.9). The tokens must match exactly.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import asdict

from pagoda.bench.scheduler import bench_llm_outputs
from pagoda.bench.workload import Workload, make_workload
from pagoda.launcher import Stack
from pagoda.model_fetch import resolve_model
from shared.config import Endpoints, EngineSettings, load_config
from shared.ipc import private_run_dir


async def _run_clients(addresses: tuple[str, ...], work: Workload) -> tuple[float, list[list[int]]]:
    from pagoda.client import AsyncClient

    clients = [AsyncClient(a) for a in addresses]
    try:
        async def one(i: int) -> list[int]:
            client = clients[i % len(clients)]
            result = await client.generate(work.prompts[i], max_tokens=work.output_lens[i],
                                           temperature=0.0, ignore_eos=True)
            return list(result.outputs[0].token_ids)

        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(one(i) for i in range(len(work.prompts))))
        return time.perf_counter() - t0, tokens
    finally:
        for c in clients:
            await c.close()


def bench_pipeline(settings: EngineSettings, work: Workload,
                   num_frontends: int) -> tuple[float, list[list[int]]]:
    with private_run_dir() as run_dir:
        # env={}: the same engine settings as the offline run, not the shell's PAGODA_*
        config = load_config({**asdict(settings), "num_frontends": num_frontends}, env={},
                             default_endpoints=Endpoints.local(run_dir, num_frontends))
        stack = Stack(config)
        try:
            stack.start()
            # warm-up, as the offline run gets
            warm = Workload(work.prompts[:2], [4, 4])
            asyncio.run(_run_clients(config.endpoints.frontend_native, warm))
            elapsed, tokens = asyncio.run(_run_clients(config.endpoints.frontend_native, work))
        finally:
            stack.stop()
    return sum(len(t) for t in tokens) / elapsed, tokens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-range", default="32,512")
    parser.add_argument("--output-range", default="16,256")
    parser.add_argument("--frontends", type=int, default=2)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    model_dir = str(resolve_model(args.model))
    pr = tuple(int(x) for x in args.prompt_range.split(","))
    orange = tuple(int(x) for x in args.output_range.split(","))
    work = make_workload(AutoTokenizer.from_pretrained(model_dir), args.requests, pr, orange)  # type: ignore[arg-type]
    print(f"{args.requests} requests, prompts {pr}, outputs {orange}, {sum(work.output_lens)} output tokens")
    settings = EngineSettings(model=model_dir)  # one engine configuration for both runs
    offline, offline_tokens = bench_llm_outputs(settings, work)
    print(f"offline LLM:            {offline:8.1f} output tok/s", flush=True)
    online, online_tokens = bench_pipeline(settings, work, args.frontends)
    print(f"pipeline ({args.frontends} frontends): {online:8.1f} output tok/s", flush=True)
    print(f"pipeline / offline: {online / offline:.2f} (target >= 0.9); "
          f"tokens identical: {online_tokens == offline_tokens}")


if __name__ == "__main__":
    main()
