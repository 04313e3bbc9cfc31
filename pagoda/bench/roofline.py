"""``--roofline``: the machine's limits, and how close a run came to them.

Measured here with torch, a few seconds in all: matmul FLOP/s in the dtype the engine
computes in (large square products) and memory read bandwidth (summing a buffer far
larger than the caches).

The ceiling (``CEILING_DEFINITION``) is a roofline for the workload as run: every token
(prompt or output) costs 2 x the parameters of its matmuls in FLOPs (the embedding is a
lookup, and the lm_head runs only for tokens that are sampled, so a prompt token costs
the decoder layers' and an output token those plus the lm_head's), and every decode step
reads all the weights once, a step producing one token for each of the B requests in flight (B = the
run's time-weighted mean). The lowest possible time is the larger of the compute time
and the weight-reading time; the ceiling is output tokens over that time. Attention and
KV reads are left out, so the ceiling is optimistic, and a fraction near 1 is the best
a run can show.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

CEILING_DEFINITION = (
    "ceiling output tok/s = output_tokens / max(T_compute, T_memory), where "
    "T_compute = (prompt_tokens * 2 * layer_params + output_tokens * 2 * (layer_params + "
    "lm_head_params)) / matmul_flops (layer_params: the decoder layers' weights; the "
    "embedding is a lookup and the lm_head runs for sampled tokens only) and "
    "T_memory = (output_tokens / B) * params * bytes_per_param / mem_read_bandwidth "
    "(each decode step reads the weights once and yields B tokens, B = mean requests in "
    "flight); attention and KV-cache traffic are ignored, so the ceiling is optimistic"
)

_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I8": 1, "U8": 1}


def count_parameters(model_dir: str | Path) -> int:
    """Parameters in the checkpoint's safetensors files, read from their headers only."""
    total = 0
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for f in files:
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, meta in header.items():
            if name != "__metadata__":
                n = 1
                for d in meta["shape"]:
                    n *= d
                total += n
    return total


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn: Any, device: str, budget_s: float) -> float:
    """Best seconds of one call of ``fn`` over repeats filling about ``budget_s``."""
    fn()
    _sync(device)
    best, spent = float("inf"), 0.0
    while spent < budget_s:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
    return best


def measure_matmul_flops(device: str = "cpu", n: int | None = None, budget_s: float = 1.5,
                         dtype: str = "float32") -> float:
    """FLOP/s of n x n products: the fastest of torch.mm and, on a CPU, the engine's own
    packed linears (oneDNN's and kernels.cpu_gemm)."""
    import torch

    n = n or (8192 if device.startswith("cuda") else 1024)
    a = torch.randn(n, n, device=device).to(getattr(torch, dtype))
    b = torch.randn(n, n, device=device).to(getattr(torch, dtype))
    best = _timed(lambda: torch.mm(a, b), device, budget_s)
    if device == "cpu":
        # and the ways the engine multiplies (packed weights): in fp32 on a Zen 5 torch.mm
        # reached 239 GFLOP/s and the packed linears ~550, so mm alone put the ceiling
        # below what the engine ran at
        from services.worker.layers.linear import linear, pack_weight

        for kernel in ("onednn", "auto"):  # auto: cpu_gemm where it has a vector path
            packed = pack_weight(b, kernel)
            if packed is not None:
                best = min(best, _timed(lambda p=packed: linear(a, b, None, p), device, budget_s))
    return 2 * n**3 / best


def measure_read_bandwidth(device: str = "cpu", num_bytes: int | None = None,
                           budget_s: float = 1.5) -> float:
    """Bytes/s of a full read of a large fp32 buffer (a sum: one read, no write)."""
    import torch

    num_bytes = num_bytes or ((1 << 30) if device.startswith("cuda") else (256 << 20))
    x = torch.ones(num_bytes // 4, device=device, dtype=torch.float32)
    return num_bytes / _timed(lambda: x.sum(), device, budget_s)


def measure_machine(device: str = "cpu", dtype: str = "float32") -> dict[str, Any]:
    """``dtype``: the engine's compute dtype (bf16 doubles the matmul rate where the CPU
    has native bf16, so the ceiling is measured in the dtype the run computes in)."""
    return {"matmul_flops": measure_matmul_flops(device, dtype=dtype), "matmul_dtype": dtype,
            "mem_read_bytes_s": measure_read_bandwidth(device)}


def matmul_parameters(model_dir: str | Path) -> tuple[int, int]:
    """(the decoder layers' parameters, the lm_head's) of a checkpoint: the total less the
    embedding (and less a separate lm_head), and vocab x hidden."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    head = int(text["vocab_size"]) * int(text["hidden_size"])
    tied = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    total = count_parameters(model_dir)
    return total - head - (0 if tied else head), head


def ceiling(machine: dict[str, Any], params: int, bytes_per_param: int, summary: dict[str, Any],
            layer_params: int | None = None, lm_head_params: int = 0) -> dict[str, Any]:
    """The roofline of the run described by ``summary`` (``stats.summarize``'s dict).

    ``params``: every weight (read once a step); ``layer_params`` / ``lm_head_params``:
    those of the per-token matmuls (``matmul_parameters``; default: all of ``params``)."""
    flops, bw = machine["matmul_flops"], machine["mem_read_bytes_s"]
    prompt, output = summary["prompt_tokens"], summary["output_tokens"]
    batch = max(1.0, summary.get("mean_in_flight") or 1.0)
    layers = params if layer_params is None else layer_params
    t_compute = (prompt * 2 * layers + output * 2 * (layers + lm_head_params)) / flops
    t_memory = (output / batch) * params * bytes_per_param / bw
    ceiling_tok_s = output / max(t_compute, t_memory) if output else float("nan")
    step_weights = params * bytes_per_param / bw  # seconds to read the weights once
    return {
        **machine,
        "params": params,
        "layer_params": layers,
        "lm_head_params": lm_head_params,
        "bytes_per_param": bytes_per_param,
        "batch": batch,
        "bound": "compute" if t_compute >= t_memory else "memory",
        "ceiling_output_tok_s": ceiling_tok_s,
        "fraction": summary["output_tok_s"] / ceiling_tok_s if output else float("nan"),
        # pure decode (no prompts): one step of B tokens costs max(weights read, B * 2P FLOPs)
        "decode_ceiling_bs1_tok_s": 1.0 / max(step_weights, 2 * params / flops),
        "decode_ceiling_at_batch_tok_s": batch / max(step_weights, batch * 2 * params / flops),
        "weights_read_s": step_weights,  # the floor of a batch-1 decode step (TPOT)
        "definition": CEILING_DEFINITION,
    }


# decode steps grouped by their rows (a step with any prompt chunk is a prefill step)
DECODE_BUCKETS = ((8, "decode 1-8 rows"), (32, "decode 9-32 rows"), (56, "decode 33-56 rows"))
WIDEST_BUCKET = "decode 57+ rows"


def step_breakdown(log: list[tuple[Any, float]], machine: dict[str, Any], params: int,
                   bytes_per_param: int, layer_params: int, lm_head_params: int,
                   kv_token_bytes: int) -> dict[str, dict[str, float]]:
    """Each step of a run (``EngineCore.step_log``: its StepBatch and execute seconds)
    beside its own roofline: the larger of its matmul time at the measured rate (2 x
    the layers' parameters per computed token, plus the lm_head's per sampled row) and
    one read of the weights; and, apart, its K/V reads (every scheduled sequence's
    context after the step, once) at the measured bandwidth, which the ceiling leaves
    out. Summed by kind of step: prefill (any prompt chunk), and decode by rows."""
    flops, bw = machine["matmul_flops"], machine["mem_read_bytes_s"]
    weights_s = params * bytes_per_param / bw
    context: dict[str, int] = {}
    prompt: dict[str, int] = {}
    out: dict[str, dict[str, float]] = {}
    for batch, seconds in log:
        for rid in batch.finished_request_ids:
            context.pop(rid, None)
            prompt.pop(rid, None)
        for new in batch.new_requests:  # preempted ones come back as new, from their hits
            context[new.request_id] = new.num_computed_tokens
            prompt[new.request_id] = new.num_prompt_tokens
        tokens = sampled = kv_tokens = 0
        prefill = False
        for rid, n in zip(batch.scheduled_request_ids, batch.num_scheduled_tokens):
            before = context.get(rid, 0)
            context[rid] = before + n
            tokens += n
            kv_tokens += before + n
            prefill = prefill or before < prompt.get(rid, 0)
            sampled += before + n >= prompt.get(rid, 0)
        if not tokens:
            continue
        rows = len(batch.scheduled_request_ids)
        kind = "prefill" if prefill else next(
            (name for top, name in DECODE_BUCKETS if rows <= top), WIDEST_BUCKET)
        compute_s = (tokens * 2 * layer_params + sampled * 2 * lm_head_params) / flops
        b = out.setdefault(kind, {"steps": 0, "seconds": 0.0, "roofline_s": 0.0, "kv_read_s": 0.0})
        b["steps"] += 1
        b["seconds"] += seconds
        b["roofline_s"] += max(compute_s, weights_s)
        b["kv_read_s"] += kv_tokens * kv_token_bytes / bw
    if out:
        out["all"] = {key: sum(b[key] for b in out.values())
                      for key in ("steps", "seconds", "roofline_s", "kv_read_s")}
    for b in out.values():
        b["share"] = b["roofline_s"] / b["seconds"] if b["seconds"] else float("nan")
        b["share_with_kv"] = ((b["roofline_s"] + b["kv_read_s"]) / b["seconds"]
                              if b["seconds"] else float("nan"))
    return out


def bs1_floor(tpot_s: float, roof: dict[str, Any], bandwidths: list[float]) -> dict[str, Any]:
    """Batch-1 TPOT against its floor, one read of every weight, at the read bandwidth
    measured just before and just after the batch-1 probe (their mean): a VM's bandwidth
    drifts by 2x over minutes, so the run-start figure (``mem_read_bytes_s``) can belong
    to another moment than the probe's."""
    bandwidth = sum(bandwidths) / len(bandwidths)
    floor_s = roof["params"] * roof["bytes_per_param"] / bandwidth
    return {"bs1_mem_read_bytes_s": bandwidth, "bs1_mem_read_samples": list(bandwidths),
            "bs1_weights_read_s": floor_s, "bs1_tpot_vs_weights_read": tpot_s / floor_s}
