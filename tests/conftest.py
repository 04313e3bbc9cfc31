"""Session fixtures: tiny random checkpoints and the default model (fetched once); tests
marked ``gpu`` skip where there is no CUDA device.

Without CUDA, Triton kernels run in its interpreter: TRITON_INTERPRET is read when a
kernel is decorated (its module imported), and any test module may import one through
the worker (runner_builder -> the attention backends), so it is set here, before any
test module is collected; set later, a kernel decorated for compilation fails when an
interpreted one calls it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from support.checkpoints import make_checkpoint


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` need a CUDA device: without one they are skipped, not failed."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


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


@pytest.fixture(scope="session")
def tiny_smollm_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and chat template; its logits are 64
    ids wider than the tokenizer (padded, as many real checkpoints are). A random model
    with a real vocabulary: what structured output must constrain on its own."""
    import shutil

    path = make_checkpoint(tmp_path_factory.mktemp("tiny-smollm"), "llama", seed=5,
                           vocab_size=49152 + 64, bos_token_id=1, eos_token_id=2)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, path / name)
    return path
