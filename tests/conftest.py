"""Session fixtures: tiny random checkpoints and the default model (fetched once)."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.checkpoints import make_checkpoint


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=1)


@pytest.fixture(scope="session")
def tiny_llama3_rope_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    scaling = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
    }
    return make_checkpoint(
        tmp_path_factory.mktemp("tiny-llama3"), "llama", seed=2, rope_scaling=scaling,
        num_key_value_heads=1, head_dim=32, rope_theta=500000.0,
    )


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", seed=3)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", seed=4)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from pagoda.model_fetch import resolve_model

    return resolve_model("smollm2", progress=False)
