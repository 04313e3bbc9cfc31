"""Builds a worker's ModelRunner from settings: device, dtype, model, KV pool size.

On CUDA, unless ``kv_cache_bytes`` or ``num_kv_blocks`` sizes it, the KV pool is sized
from a profiling step (``memory_profile.py``: ``gpu_memory_utilization`` of the GPU's
memory, less weights, activations and a reserve for the graphs); then, unless
``enforce_eager``, the decode CUDA graphs are captured (``cuda_graphs.py``; one rank,
a capturable attention backend), and how long that took and what it used is logged.

Both the worker process (``services/worker/main.py``) and the in-process offline
engine (``pagoda/engine.py``) start here, so the two size the KV pool and resolve
``max_model_len`` the same way; the result is what the worker reports to the
scheduler in its ``WorkerReady`` handshake.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import cpu_fused, cpu_prefill
from services.worker.attention import get_attention_backend
from services.worker.attention.base import AttentionBackend
from services.worker.cpu_memory import keep_large_allocations_in_heap
from services.worker.cuda_graphs import DEFAULT_MAX_BATCH_SIZE
from services.worker.layers.linear import auto_kernel, cpu_has, pack_cpu_linears
from services.worker.loader import load_model
from services.worker.memory_profile import (
    cuda_used,
    describe,
    dummy_step,
    graph_reserve_bytes,
    kv_cache_budget,
    profile_memory,
)
from services.worker.model_config import ModelConfig
from services.worker.model_runner import ModelRunner, kv_cache_bytes_per_block
from services.worker.parallel import SINGLE, ShardingError, TensorParallel
from shared import model_limits
from shared.config import EngineSettings

log = logging.getLogger(__name__)
DEFAULT_KV_CACHE_BYTES = 2 * 1024**3  # CPU default; on CUDA: memory_profile.py
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class RunnerSpec:
    """The engine settings a model runner is built from (``from_settings``)."""

    block_size: int = 16
    kv_cache_bytes: int | None = None
    num_kv_blocks: int | None = None
    max_model_len: int | None = None
    dtype: str = "auto"  # see resolve_dtype
    kv_cache_dtype: str = "auto"  # see resolve_kv_cache_dtype
    device: str = "auto"  # auto: cuda if available, else cpu
    attention_backend: str = "auto"  # see services/worker/attention/selector.py
    max_num_seqs: int = 256  # the profiling step's sequences, the graphs' default bound
    max_num_batched_tokens: int = 2048  # the profiling step's tokens
    enforce_eager: bool = False  # no CUDA graphs
    cuda_graph_max_batch_size: int | None = None  # None: min(max_num_seqs, 256)
    gpu_memory_utilization: float = 0.9  # CUDA: the share of the GPU's memory used

    @classmethod
    def from_settings(cls, engine: EngineSettings) -> RunnerSpec:
        """The one place a runner's spec is derived (worker process, EngineCore, benches)."""
        return cls(
            block_size=engine.block_size, kv_cache_bytes=engine.kv_cache_bytes,
            num_kv_blocks=engine.num_kv_blocks, max_model_len=engine.max_model_len,
            dtype=engine.dtype, kv_cache_dtype=engine.kv_cache_dtype, device=engine.device,
            attention_backend=engine.attention_backend,
            max_num_seqs=engine.max_num_seqs, max_num_batched_tokens=engine.max_num_batched_tokens,
            enforce_eager=engine.enforce_eager,
            cuda_graph_max_batch_size=engine.cuda_graph_max_batch_size,
            gpu_memory_utilization=engine.gpu_memory_utilization,
        )

    @property
    def graph_max_batch_size(self) -> int:
        return min(self.cuda_graph_max_batch_size or DEFAULT_MAX_BATCH_SIZE, self.max_num_seqs)


@dataclass
class BuiltRunner:
    runner: ModelRunner
    model_config: ModelConfig
    max_model_len: int
    num_blocks: int


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def cpu_runs_bf16_fast() -> bool:
    """Whether bf16 is this CPU's faster dtype for the engine: where it multiplies bf16
    in hardware (AVX512-BF16 or AMX-BF16), and wherever ``kernels.cpu_gemm`` runs bf16
    tiles (AVX2, or AVX-512 without BF16, widening the weights in registers).

    With AVX512-BF16 or AMX, bf16 linears run ~2x fp32 ones (oneDNN: 370-410 vs 190-210
    GFLOP/s at 24-1,024 rows on a 2-core Zen 4). On a 2-core Zen 3 EPYC (AVX2 only)
    cpu_gemm's bf16 tiles multiply about as fast as its fp32 ones (145-155 GFLOP/s from 64
    rows) on half the weight and KV bytes: the default workload ran at 142 output tok/s
    in bf16 against 114 in fp32, batch-1 TPOT 12.3 against 22.1 ms (``pagoda bench``).
    On a 2-core Ice Lake class Xeon (AVX-512 without BF16) cpu_gemm's widening bf16
    tiles ran SmolLM2's linears level with or faster than its fp32 AVX-512 ones at every
    row count (whole model step: 12.7 vs 25.0 ms at 1 row, 68 vs 70 ms at 54, 270 vs
    327 ms at 256; ``python -m kernels.bench_linear``). Without a compiled kernel bf16
    falls to slower paths.
    """
    return cpu_has("avx512_bf16", "amx_bf16") or auto_kernel(torch.bfloat16) == "cpu_gemm"


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on CUDA and on CPUs where it is the faster dtype
    (``cpu_runs_bf16_fast``), else float32 (as vLLM's CPU backend, which runs 16-bit
    checkpoints and fp32 ones alike in bf16)."""
    if dtype == "auto":
        if device.type == "cuda" or (device.type == "cpu" and cpu_runs_bf16_fast()):
            return torch.bfloat16
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def resolve_dtype_name(dtype: str, device: torch.device) -> str:
    """``resolve_dtype`` as its setting name (``float32``, ``bfloat16``, ...)."""
    resolved = resolve_dtype(dtype, device)
    return next(name for name, d in _DTYPES.items() if d == resolved)


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype,
                           device: torch.device) -> torch.dtype:
    """The KV cache's element type: ``auto``, the model's; ``bfloat16``, bf16 under a bf16
    model (the same) and under a float32 one on the CPU, where the attention kernels read
    bf16 K/V against fp32 queries (the Triton kernels read the cache in the model's dtype
    only: refused on CUDA, as under fp16)."""
    if kv_cache_dtype == "auto" or _DTYPES.get(kv_cache_dtype) == dtype:
        return dtype
    if kv_cache_dtype != "bfloat16":
        raise ValueError(f"kv_cache_dtype must be auto or bfloat16, got {kv_cache_dtype!r}")
    model = str(dtype).removeprefix("torch.")
    if dtype != torch.float32:
        raise ValueError(f"--kv-cache-dtype bfloat16 is for float32 models, not {model} ones; "
                         "use --kv-cache-dtype auto")
    if device.type != "cpu":
        raise ValueError(f"--kv-cache-dtype bfloat16 under a float32 model runs on the CPU only "
                         f"(this worker runs on {device.type}: its attention kernels read the "
                         "cache in the model's dtype); use --kv-cache-dtype auto")
    return torch.bfloat16


def build_runner(model_dir: Path, spec: RunnerSpec, tp: TensorParallel = SINGLE) -> BuiltRunner:
    """The runner of one rank (``tp``: its tensor-parallel group; the whole model alone)."""
    device = resolve_device(spec.device)
    baseline_used = 0
    if device.type == "cpu":
        keep_large_allocations_in_heap()
    elif device.type == "cuda":
        if tp.size > 1 and device.index is None:
            device = torch.device("cuda", tp.rank % torch.cuda.device_count())  # a GPU per rank
        if device.index is not None:  # the current device: Triton launches and graph
            torch.cuda.set_device(device)  # replays go to its streams
        baseline_used = cuda_used(device)  # before the weights: not the worker's
    dtype = resolve_dtype(spec.dtype, device)
    kv_dtype = resolve_kv_cache_dtype(spec.kv_cache_dtype, dtype, device)
    log.info("computing in %s on %s%s", str(dtype).removeprefix("torch."), device,
             " (--dtype auto)" if spec.dtype == "auto" else "")
    if kv_dtype != dtype:
        log.info("KV cache in %s (--kv-cache-dtype): tokens may differ from the model's own "
                 "dtype", str(kv_dtype).removeprefix("torch."))
    try:
        model = load_model(model_dir, dtype, device, max_position=None, tp=tp)
    except ShardingError as e:
        raise ValueError(f"{model_dir}: {e}") from None
    if device.type == "cpu":
        pack_cpu_linears(model)
        # compiled (first run on a machine) or loaded now, not in step 1
        cpu_fused.available()
        cpu_prefill.available()
        log.info("CPU decode steps: %s", "one C++ call for all layers"
                 if model.enable_cpu_decoder() else "the Python layer loop")
        if model.enable_screened_argmax():
            log.info("greedy CPU steps: the fp32 LM head screened in bf16")
    # the frontend applies the same rule to the same config.json (shared/model_limits.py)
    max_model_len = model_limits.max_model_len(model.config.hf_config, spec.max_model_len)
    attention = get_attention_backend(device, spec.attention_backend)
    graphs = _use_cuda_graphs(spec, device, tp, attention)
    num_blocks = _num_blocks(model, spec, kv_dtype, device)
    if num_blocks is None:  # CUDA, no size given: what the profiling step leaves
        num_blocks = _profiled_num_blocks(model, attention, spec, dtype, device, max_model_len,
                                          baseline_used,
                                          graph_reserve_bytes(spec.graph_max_batch_size,
                                                              model.config.vocab_size)
                                          if graphs else 0)
    runner = ModelRunner(model, attention, num_blocks, spec.block_size, kv_dtype, device)
    if graphs:
        _capture_graphs(runner, spec.graph_max_batch_size, max_model_len, device)
    return BuiltRunner(runner, model.config, max_model_len, num_blocks)


def _use_cuda_graphs(spec: RunnerSpec, device: torch.device, tp: TensorParallel,
                     attention: AttentionBackend) -> bool:
    if device.type != "cuda" or spec.enforce_eager:
        return False
    if tp.size > 1:
        log.info("CUDA graphs off: not yet with tensor parallelism")
        return False
    if not attention.supports_cuda_graphs:
        log.info("CUDA graphs off: the %s attention backend cannot be captured", attention.name)
        return False
    return True


def _capture_graphs(runner: ModelRunner, max_batch_size: int, max_model_len: int,
                    device: torch.device) -> None:
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info(device)[0]
    started = time.perf_counter()
    try:
        graphs = runner.enable_decode_graphs(max_batch_size, max_model_len, capture=True)
    except RuntimeError as e:
        raise RuntimeError(f"capturing the decode CUDA graphs failed ({e}); "
                           "--enforce-eager runs without them") from e
    used = free_before - torch.cuda.mem_get_info(device)[0]
    reserved = graph_reserve_bytes(graphs.max_batch_size, runner.model.config.vocab_size)
    log.info("CUDA graphs: %d decode batch sizes (1..%d) captured in %.1f s, %.0f MiB",
             len(graphs.captured), graphs.max_batch_size, time.perf_counter() - started,
             used / 2**20)
    if used > reserved:
        log.warning("the CUDA graphs took %.0f MiB, more than the %.0f MiB reserved for them; "
                    "lower --gpu-memory-utilization or --cuda-graph-max-batch-size if memory "
                    "runs out", used / 2**20, reserved / 2**20)


def _num_blocks(model, spec: RunnerSpec, dtype: torch.dtype, device: torch.device) -> int | None:  # type: ignore[no-untyped-def]
    """The pool as the settings size it; None on CUDA without a size (profiled)."""
    if spec.num_kv_blocks is not None:
        if spec.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {spec.num_kv_blocks}")
        return spec.num_kv_blocks
    budget = spec.kv_cache_bytes
    if budget is None:
        if device.type == "cuda":
            return None
        budget = DEFAULT_KV_CACHE_BYTES
    per_block = kv_cache_bytes_per_block(model, spec.block_size, dtype)
    num_blocks = budget // per_block
    if num_blocks < 2:
        raise ValueError(f"kv_cache_bytes {budget} holds fewer than 2 blocks of {per_block} bytes")
    return int(num_blocks)


def _profiled_num_blocks(model, attention: AttentionBackend, spec: RunnerSpec,  # type: ignore[no-untyped-def]
                         dtype: torch.dtype, device: torch.device, max_model_len: int,
                         baseline_used: int, graph_reserve: int) -> int:
    def step() -> None:
        dummy_step(model, attention, spec.max_num_batched_tokens, spec.max_num_seqs,
                   max_model_len, spec.block_size, dtype, device)

    profile = profile_memory(step, device, baseline_used)
    terms = describe(profile, spec.gpu_memory_utilization, graph_reserve)
    per_block = kv_cache_bytes_per_block(model, spec.block_size, dtype)
    num_blocks = kv_cache_budget(profile, spec.gpu_memory_utilization, graph_reserve) // per_block
    if num_blocks < 2:
        raise ValueError(f"no memory left for the KV cache ({terms}); raise "
                         "--gpu-memory-utilization, or lower --max-num-batched-tokens / "
                         "--max-num-seqs")
    log.info("KV pool: %d blocks of %d bytes, from %s", num_blocks, per_block, terms)
    return int(num_blocks)
