"""services/worker/model_runner.py: the KV pool's size per block, against the pool it
allocates and the checkpoint's config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.worker.model_runner import kv_cache_bytes_per_block
from services.worker.runner_builder import RunnerSpec, build_runner
from shared.config import EngineSettings


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
def test_kv_bytes_per_block_is_what_the_pool_holds(tiny_llama_dir: Path,
                                                   kv_cache_dtype: str) -> None:
    """K and V of every layer: 2 x layers x kv heads x head_dim elements a token, as the
    config says and as the allocated caches hold (pagoda bench --roofline prices a
    step's K/V reads with it)."""
    settings = EngineSettings(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=8,
                              kv_cache_dtype=kv_cache_dtype)
    runner = build_runner(tiny_llama_dir, RunnerSpec.from_settings(settings)).runner
    dtype = runner.kv_caches[0][0].dtype
    assert dtype == (torch.float32 if kv_cache_dtype == "auto" else torch.bfloat16)
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    elem = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * elem
    assert kv_cache_bytes_per_block(runner.model, 1, dtype) == per_token
    assert kv_cache_bytes_per_block(runner.model, runner.block_size, dtype) == (
        per_token * runner.block_size)
    pool_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                     for k, v in runner.kv_caches)
    assert pool_bytes == per_token * runner.block_size * runner.num_blocks
