"""The Triton attention backend in the worker: backend selection, and greedy tokens of a
tiny random Llama equal to the torch backend's (interpreter mode without a GPU).

Without CUDA, TRITON_INTERPRET=1 is set before the kernels are imported (their
decoration reads it), so the kernels run on CPU tensors in Triton's interpreter.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import itertools

from services.worker.attention.base import AttentionBackend
from services.worker.attention.selector import ENV_VAR, default_backend_name, get_attention_backend
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.loader import load_model
from services.worker.model_runner import ModelRunner
from support.checkpoints import make_checkpoint
from support.paged import PagedDriver

HAS_TRITON = importlib.util.find_spec("triton") is not None


def test_selector_defaults_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    from kernels import cpu_decode

    cpu_default = "cpu" if cpu_decode.available() else "torch"
    assert default_backend_name(torch.device("cpu")) == cpu_default
    assert default_backend_name(torch.device("cuda")) == ("triton" if HAS_TRITON else "torch")
    assert get_attention_backend(torch.device("cpu")).name == cpu_default
    monkeypatch.setenv(ENV_VAR, "cpu")
    assert get_attention_backend(torch.device("cpu")).name == "cpu"
    monkeypatch.setenv(ENV_VAR, "torch")
    assert get_attention_backend(torch.device("cuda")).name == "torch"
    if HAS_TRITON and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        monkeypatch.setenv(ENV_VAR, "triton")
        assert get_attention_backend(torch.device("cpu")).name == "triton"
    assert get_attention_backend(torch.device("cpu"), "torch").name == "torch"  # config wins
    monkeypatch.setenv(ENV_VAR, "nope")
    with pytest.raises(ValueError, match=f"{ENV_VAR}: expected one of"):
        get_attention_backend(torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        get_attention_backend(torch.device("cpu"), "nope")


def test_selector_knows_exactly_the_settings_choices() -> None:
    from services.worker.attention.selector import _BACKENDS
    from shared.config import ATTENTION_BACKENDS

    assert {"auto", *_BACKENDS} == set(ATTENTION_BACKENDS)


def _greedy_run(
    model_dir: Path, backend: AttentionBackend
) -> tuple[dict[str, list[int]], list[dict[str, torch.Tensor]]]:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(model_dir).to(dev)
    runner = ModelRunner(model, backend, num_blocks=24, block_size=16, device=dev)
    driver = PagedDriver(runner, seed=5)
    gen = torch.Generator().manual_seed(9)
    prompts = {"a": 16, "b": 17, "c": 5, "d": 40}  # on / one past a block boundary
    for rid, n in prompts.items():
        driver.add(rid, torch.randint(3, 512, (n,), generator=gen).tolist())
    logits = [driver.prefill(["a", "b", "c"])[1]]
    logits.append(driver.step({"a": 1, "b": 1, "c": 1, "d": 24})[1])  # decodes + first chunk
    logits.append(driver.step({"a": 1, "b": 1, "c": 1, "d": 16})[1])  # last chunk over context
    for _ in range(5):
        logits.append(driver.decode(list(prompts))[1])
    return {rid: driver.output(rid) for rid in prompts}, logits


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_tiny_llama_greedy_tokens_match_torch_backend(tmp_path: Path) -> None:
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1")
    # head_dim 64 (SmolLM2's), 2 query heads per KV head
    model_dir = make_checkpoint(tmp_path, "llama", seed=4, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=64)
    from services.worker.attention.triton_backend import TritonAttentionBackend

    # tiny tiles and forced split-K, so that these tiny shapes take every kernel path
    triton_backend = TritonAttentionBackend(
        num_splits=2, decode_tile_n=16, prefill_block_m=16, prefill_tile_n=16
    )
    ours, ours_logits = _greedy_run(model_dir, triton_backend)
    ref, ref_logits = _greedy_run(model_dir, TorchAttentionBackend())
    assert ours == ref, f"greedy tokens differ: triton {ours} vs torch {ref}"
    for step, (a, b) in enumerate(zip(ours_logits, ref_logits, strict=True)):
        for rid in b:
            diff = float((a[rid].cpu() - b[rid].cpu()).abs().max())
            assert diff < 1e-3, f"step {step} {rid}: logits differ by {diff:.3g}"


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fresh_prompts_go_to_flash_attention_and_chunks_stay_on_triton(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The routing, on the CPU: FlashAttention is CUDA-only, so its place is taken by the
    reference attention over the same arguments (tests/kernels/test_flash_prefill.py
    checks the real kernel against it on a GPU); the tokens must stay the torch
    backend's, and only the steps whose prefills are all fresh may use it."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1")
    from kernels import reference
    from services.worker.attention import triton_backend

    calls: list[list[int]] = []

    def flash_on_cpu(query, key, value, cu, max_len, scale, window=None):  # type: ignore[no-untyped-def]
        bounds = cu.tolist()
        calls.append(bounds)
        assert max_len >= max(b - a for a, b in itertools.pairwise(bounds))
        out = torch.empty_like(query)
        for a, b in itertools.pairwise(bounds):
            out[a:b] = reference.prefill_attention(query[a:b], key[a:b], value[a:b], scale, window)
        return out

    if not torch.cuda.is_available():
        monkeypatch.setattr(triton_backend, "flash_prefill_usable", lambda q, softcap: True)
        monkeypatch.setattr(triton_backend, "flash_prefill", flash_on_cpu)
    model_dir = make_checkpoint(tmp_path, "llama", seed=4, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=64)
    backend = triton_backend.TritonAttentionBackend(
        num_splits=2, decode_tile_n=16, prefill_block_m=16, prefill_tile_n=16)
    ours, _ = _greedy_run(model_dir, backend)
    ref, _ = _greedy_run(model_dir, TorchAttentionBackend())
    assert ours == ref
    if not torch.cuda.is_available():
        # every layer of step 1 (a, b, c whole) and of step 2 (d's first chunk, behind
        # three decodes); never step 3 (d's second chunk has 24 tokens of context)
        layers = len(load_model(model_dir).layers)
        assert calls == [[0, 16, 33, 38]] * layers + [[0, 24]] * layers
