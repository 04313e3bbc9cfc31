"""``--baseline hf``: HF transformers ``generate`` on the same requests, in the same run.

Two ways, as a user without a serving engine would run them:

- one at a time (batch size 1): each request alone, greedy, exactly its output length;
  a streamer stamps every token, so TTFT and TPOT are measured as for pagoda;
- static batches of a given size, in workload order, left-padded to the batch's longest
  prompt, generating the batch's longest output (``min_new_tokens = max_new_tokens``);
  only the tokens each request asked for count as useful output.

Each way runs in every dtype asked for (by default fp32 and the dtype pagoda computes
in: on a CPU with native bf16, HF's bf16 runs about twice as fast as its fp32), on the
engine's device (``cuda`` when pagoda runs there: a GPU engine against a CPU baseline
would say nothing). The figure to beat is the best of all of these (highest useful output
tokens/s); the bs1 figure to beat is the lowest TPOT of the one-at-a-time runs.
"""

from __future__ import annotations

import time
from typing import Any

from tqdm import tqdm

from pagoda.bench.stats import RequestRecord, record_lists, summarize
from pagoda.bench.workload import Workload


def load_hf(model_dir: str, dtype: str = "float32", device: str = "cpu") -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    return hf.to(device).eval()


def _sync(hf: Any) -> None:
    """Waits for the model's device (a CUDA clock read must follow the work it times)."""
    import torch

    if hf.device.type == "cuda":
        torch.cuda.synchronize(hf.device)


def _pad_id(hf: Any) -> int:
    eos = hf.config.eos_token_id
    return eos if isinstance(eos, int) else (eos[0] if eos else 0)


def hf_static(hf: Any, work: Workload, batch_size: int, progress: bool = False) -> float:
    """Useful output tokens per second of static batches of ``batch_size`` (left padding)."""
    import torch

    pad = _pad_id(hf)
    starts = range(0, len(work), batch_size)
    t0 = time.perf_counter()
    for start in tqdm(starts, desc=f"HF static batch {batch_size}", unit="batch", disable=not progress):
        prompts = work.prompts[start : start + batch_size]
        new = max(work.output_lens[start : start + batch_size])
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=hf.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                            device=hf.device)
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, pad_token_id=pad)
    _sync(hf)
    return work.num_output_tokens / (time.perf_counter() - t0)


def bench_hf_static(model_dir: str, work: Workload, batch_size: int, dtype: str = "float32",
                    device: str = "cpu") -> float:
    """``hf_static`` with its own model load (the older scripts' entry point)."""
    return hf_static(load_hf(model_dir, dtype, device), work, batch_size)


class _StampStreamer:
    """A transformers streamer that records when each generated token comes out."""

    def __init__(self, rec: RequestRecord, clock: Any) -> None:
        self.rec, self.clock = rec, clock
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:  # generate() first puts the prompt itself
            self._prompt_seen = True
            return
        if value.is_cuda:  # the token exists once its kernels are done
            import torch

            torch.cuda.synchronize(value.device)
        self.rec.add(self.clock(), int(value.numel()))

    def end(self) -> None:
        pass


def hf_one_at_a_time(hf: Any, work: Workload, progress: bool = False) -> list[RequestRecord]:
    """Each request alone; per-token timestamps, as pagoda's records have them."""
    import torch

    pad = _pad_id(hf)
    records = [RequestRecord(len(p), n) for p, n in zip(work.prompts, work.output_lens)]
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    for i in tqdm(range(len(work)), desc="HF one at a time", unit="req", disable=not progress):
        rec = records[i]
        rec.start = clock()
        n = work.output_lens[i]
        with torch.inference_mode():
            hf.generate(input_ids=torch.tensor([work.prompts[i]], device=hf.device), max_new_tokens=n,
                        min_new_tokens=n, do_sample=False, pad_token_id=pad,
                        streamer=_StampStreamer(rec, clock))
    return records


def run_hf_baseline(model_dir: str, work: Workload, batch_sizes: list[int],
                    progress: bool = True, dtypes: tuple[str, ...] = ("float32",),
                    device: str = "cpu") -> dict[str, Any]:
    """Every requested way (1 = one at a time) in every dtype, on ``device`` (the engine's);
    the best by output tokens/s."""
    import torch

    result: dict[str, Any] = {"dtypes": list(dtypes), "device": device,
                              "static_batch_output_tok_s": {}}
    for dtype in dtypes:
        hf = load_hf(model_dir, dtype, device)
        with torch.inference_mode():  # warm-up: first-call costs stay out of the figures
            hf.generate(input_ids=torch.tensor([work.prompts[0]], device=hf.device),
                        max_new_tokens=2, do_sample=False, pad_token_id=_pad_id(hf))
        by_bs: dict[str, float] = {}
        for bs in batch_sizes:
            if bs == 1:
                records = hf_one_at_a_time(hf, work, progress)
                summary = summarize(records)
                best_bs1 = result.get("one_at_a_time")
                if best_bs1 is None or summary["tpot_s"]["p50"] < best_bs1["tpot_s"]["p50"]:
                    result["one_at_a_time"] = summary
                    result["one_at_a_time_dtype"] = dtype
                    result["one_at_a_time_samples"] = record_lists(records)  # the plot's CDFs
                by_bs["1"] = summary["output_tok_s"]
            else:
                by_bs[str(bs)] = hf_static(hf, work, bs, progress)
        result["static_batch_output_tok_s"][dtype] = by_bs
        del hf
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()  # the next dtype's copy needs the room
    best = max(((dt, bs, v) for dt, by_bs in result["static_batch_output_tok_s"].items()
                for bs, v in by_bs.items()), key=lambda x: x[2])
    result["best_dtype"], result["best_batch_size"], result["best_output_tok_s"] = best[0], int(best[1]), best[2]
    return result
