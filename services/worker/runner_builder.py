"""Builds a worker's ModelRunner from settings: device, dtype, model, KV pool size.

Both the worker process (``services/worker/main.py``) and the in-process offline
engine (``pagoda/engine.py``) start here, so the two size the KV pool and resolve
``max_model_len`` the same way; the result is what the worker reports to the
scheduler in its ``WorkerReady`` handshake.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import cpu_fused, cpu_prefill
from services.worker.attention import get_attention_backend
from services.worker.cpu_memory import keep_large_allocations_in_heap
from services.worker.layers.linear import pack_cpu_linears
from services.worker.loader import load_model
from services.worker.model_config import ModelConfig
from services.worker.model_runner import ModelRunner, kv_cache_bytes_per_block
from services.worker.parallel import SINGLE, ShardingError, TensorParallel
from shared import model_limits
from shared.config import EngineSettings

DEFAULT_KV_CACHE_BYTES = 2 * 1024**3  # CPU default; on CUDA the pool takes free memory
CUDA_MEMORY_UTILISATION = 0.85  # of the memory free after the weights
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class RunnerSpec:
    """The engine settings a model runner is built from (``from_settings``)."""

    block_size: int = 16
    kv_cache_bytes: int | None = None
    num_kv_blocks: int | None = None
    max_model_len: int | None = None
    dtype: str = "auto"  # see resolve_dtype
    device: str = "auto"  # auto: cuda if available, else cpu
    attention_backend: str = "auto"  # see services/worker/attention/selector.py

    @classmethod
    def from_settings(cls, engine: EngineSettings) -> RunnerSpec:
        """The one place a runner's spec is derived (worker process, EngineCore, benches)."""
        return cls(
            block_size=engine.block_size, kv_cache_bytes=engine.kv_cache_bytes,
            num_kv_blocks=engine.num_kv_blocks, max_model_len=engine.max_model_len,
            dtype=engine.dtype, device=engine.device, attention_backend=engine.attention_backend,
        )


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


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX-BF16).

    There, oneDNN's bf16 linears run ~2x its fp32 ones (370-410 vs 190-210 GFLOP/s at
    24-1,024 rows on a 2-core Zen 4); without it, bf16 is emulated and slower than fp32.
    """
    try:
        caps = torch.cpu.get_capabilities()
    except (AttributeError, RuntimeError):
        return False
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on CUDA and on CPUs with native bf16, else float32 (as vLLM's
    CPU backend, which runs 16-bit checkpoints and fp32 ones alike in bf16)."""
    if dtype == "auto":
        if device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16()):
            return torch.bfloat16
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def resolve_dtype_name(dtype: str, device: torch.device) -> str:
    """``resolve_dtype`` as its setting name (``float32``, ``bfloat16``, ...)."""
    resolved = resolve_dtype(dtype, device)
    return next(name for name, d in _DTYPES.items() if d == resolved)


def build_runner(model_dir: Path, spec: RunnerSpec, tp: TensorParallel = SINGLE) -> BuiltRunner:
    """The runner of one rank (``tp``: its tensor-parallel group; the whole model alone)."""
    device = resolve_device(spec.device)
    if device.type == "cpu":
        keep_large_allocations_in_heap()
    elif device.type == "cuda" and tp.size > 1 and device.index is None:
        device = torch.device("cuda", tp.rank % torch.cuda.device_count())  # a GPU per rank
        torch.cuda.set_device(device)
    dtype = resolve_dtype(spec.dtype, device)
    try:
        model = load_model(model_dir, dtype, device, max_position=None, tp=tp)
    except ShardingError as e:
        raise ValueError(f"{model_dir}: {e}") from None
    if device.type == "cpu":
        pack_cpu_linears(model)
        # compiled (first run on a machine) or loaded now, not in step 1
        cpu_fused.available()
        cpu_prefill.available()
    # the frontend applies the same rule to the same config.json (shared/model_limits.py)
    max_model_len = model_limits.max_model_len(model.config.hf_config, spec.max_model_len)
    num_blocks = _num_blocks(model, spec, dtype, device)
    attention = get_attention_backend(device, spec.attention_backend)
    runner = ModelRunner(model, attention, num_blocks, spec.block_size, dtype, device)
    return BuiltRunner(runner, model.config, max_model_len, num_blocks)


def _num_blocks(model, spec: RunnerSpec, dtype: torch.dtype, device: torch.device) -> int:  # type: ignore[no-untyped-def]
    if spec.num_kv_blocks is not None:
        if spec.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {spec.num_kv_blocks}")
        return spec.num_kv_blocks
    per_block = kv_cache_bytes_per_block(model, spec.block_size, dtype)
    budget = spec.kv_cache_bytes
    if budget is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * CUDA_MEMORY_UTILISATION)
        else:
            budget = DEFAULT_KV_CACHE_BYTES
    num_blocks = budget // per_block
    if num_blocks < 2:
        raise ValueError(f"kv_cache_bytes {budget} holds fewer than 2 blocks of {per_block} bytes")
    return int(num_blocks)
