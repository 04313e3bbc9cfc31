"""A client process for the e2e tests: runs a JSON list of jobs against one frontend.

    python tests/e2e/client_proc.py ADDRESS JOBS_JSON OUT_JSON

Each job: {"prompt": str | [ids], "messages": [...], "params": {...}, "stream": bool}.
All jobs run concurrently through one AsyncClient. For streamed jobs the deltas are
concatenated; for each job the result holds text, token ids and finish reason.
With OUT_JSON "-" and one job, it prints "first-delta" after the first delta and
then keeps streaming (the test kills it there).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from pagoda.client import AsyncClient


async def run_job(client: AsyncClient, job: dict, announce: bool) -> dict:  # type: ignore[type-arg]
    kwargs = dict(job.get("params", {}))
    if "messages" in job:
        kwargs["messages"] = job["messages"]
    prompt = job.get("prompt")
    if job.get("stream"):
        text, ids, finish = "", [], None
        async with client.stream(prompt, **kwargs) as stream:
            async for delta in stream:
                if announce:
                    print("first-delta", flush=True)
                    announce = False
                text += delta.text
                ids += list(delta.token_ids)
                finish = delta.finish_reason or finish
        return {"text": text, "token_ids": ids, "finish_reason": finish}
    result = await client.generate(prompt, **kwargs)
    out = result.outputs[0]
    return {"text": out.text, "token_ids": list(out.token_ids), "finish_reason": out.finish_reason}


async def run_jobs(address: str, jobs: list[Any], announce: bool) -> list[Any]:
    """Every job at once through one client; the results in job order."""
    async with AsyncClient(address, timeout=600) as client:
        return await asyncio.gather(*(run_job(client, j, announce) for j in jobs))


def main(address: str, jobs_path: str, out_path: str) -> None:
    jobs = json.loads(Path(jobs_path).read_text())
    results = asyncio.run(run_jobs(address, jobs, out_path == "-"))
    if out_path != "-":
        Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:4])
