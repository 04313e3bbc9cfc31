"""The CPU steps' one-call path (services/worker/models/cpu_decoder_path.py,
kernels/cpu_decoder.py) against the Python layer loop it replaces.

Oracle: the same model run by the Python loop (same kernels, same order), so every
logit and KV-cache entry must be bit-identical, in fp32, bf16 and fp32 over a bf16 KV
cache (``--kv-cache-dtype bfloat16``), over prefills, mixed
steps (a chunked prefill beside decodes) and decode steps of ragged sequences; HF
agreement itself is tests/worker/test_model_vs_hf.py's, whose production runner takes
this path. The sampled rows a step asks for (``output_rows``), on both paths: those rows
of the whole forward, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels import cpu_decoder
from kernels.cpu_decoder import LayerDims
from services.worker.attention import get_attention_backend
from services.worker.layers.linear import pack_cpu_linears, pack_weight
from services.worker.loader import load_model
from services.worker.model_runner import ModelRunner
from services.worker.models.llama import LlamaForCausalLM
from support.checkpoints import make_checkpoint
from support.paged import PagedDriver

pytestmark = pytest.mark.skipif(not cpu_decoder.available(),
                                reason="the C++ CPU extensions do not build here")


def packed_model(model_dir: Path, dtype: torch.dtype, kernel: str = "auto") -> LlamaForCausalLM:
    model = load_model(model_dir, dtype)
    pack_cpu_linears(model, kernel)
    return model


# the kernels the linears are packed for: the machine's choice (cpu_gemm where it has the
# vector path), and oneDNN (bf16 on an AMX CPU; cpu_gemv then takes bf16 steps of up to
# GEMV_MAX_ROWS rows, as layers/linear.py's linear() does)
KERNELS = pytest.mark.parametrize("kernel", ["auto", "onednn"])


def runner_for(model: LlamaForCausalLM, dtype: torch.dtype) -> ModelRunner:
    return ModelRunner(model, get_attention_backend(torch.device("cpu"), None), num_blocks=64,
                       block_size=16, kv_dtype=dtype)


def count_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The token count of every decode_layers call."""
    seen: list[int] = []
    run = cpu_decoder.decode_layers

    def counted(hidden: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(hidden.shape[0])
        return run(hidden, *args, **kwargs)

    monkeypatch.setattr(cpu_decoder, "decode_layers", counted)
    return seen


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float32),
                                            (torch.bfloat16, torch.bfloat16),
                                            (torch.float32, torch.bfloat16)],
                         ids=["fp32", "bf16", "fp32-bf16kv"])
@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
@KERNELS
def test_steps_bit_identical_to_the_python_loop(
    model_fixture: str, kernel: str, dtype: torch.dtype, kv_dtype: torch.dtype,
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # qwen2: qkv biases, a tied head; qwen3: per-head q/k norms, head_dim 32 (not hidden /
    # heads)
    model_dir = request.getfixturevalue(model_fixture)
    fast_model = packed_model(model_dir, dtype, kernel)
    if not fast_model.enable_cpu_decoder():
        pytest.skip(f"no {kernel} packing of these linears on this CPU")
    assert fast_model.cpu_decoder_path is not None
    assert bool(fast_model.cpu_decoder_path.weights.onednn_plain) == (
        not fast_model.layers[0].self_attn.qkv_weight_packed.gemm)
    loop_model = packed_model(model_dir, dtype, kernel)
    assert loop_model.cpu_decoder_path is None
    drivers = [PagedDriver(runner_for(m, kv_dtype), seed=5) for m in (loop_model, fast_model)]
    gen = torch.Generator().manual_seed(3)
    lengths = {"a": 5, "b": 23, "c": 40}
    for d in drivers:
        for rid, n in lengths.items():
            d.add(rid, torch.randint(3, 500, (n,), generator=gen).tolist())
        gen.manual_seed(3)
    calls = count_calls(monkeypatch)
    # prefills (c chunked), then c's last chunk beside two decodes: a mixed step
    steps = [{"a": 5, "b": 23, "c": 16}, {"a": 1, "b": 1, "c": 24}]
    steps += [{"a": 1, "b": 1, "c": 1}] * 6 + [{"b": 1}, {"a": 1, "c": 1}]
    for step in steps:
        results = [d.step(step) for d in drivers]
        (loop_result, loop_logits), (fast_result, fast_logits) = results
        assert loop_result.sampled_token_ids == fast_result.sampled_token_ids
        for rid in loop_logits:
            assert torch.equal(loop_logits[rid], fast_logits[rid]), f"{step}: {rid} differs"
    assert calls == [44, 26] + [3] * 6 + [1, 2]  # every step, of the fast model only
    for rid in lengths:
        assert drivers[0].output(rid) == drivers[1].output(rid)
    for (k0, v0), (k1, v1) in zip(drivers[0].runner.kv_caches, drivers[1].runner.kv_caches):
        assert k0.dtype == kv_dtype
        assert torch.equal(k0, k1) and torch.equal(v0, v1)  # the same cache writes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("one_call", [True, False], ids=["one-call", "python-loop"])
@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen3_dir"])
@KERNELS
def test_output_rows_are_those_rows_of_the_whole_forward(
    model_fixture: str, kernel: str, one_call: bool, dtype: torch.dtype,
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The runner asks the model for the sampled rows only (a prefill's other tokens skip
    # the last layer's MLP). Oracle: the whole forward of the same step (its K/V writes
    # are the same values to the same slots), those rows taken after it.
    model = packed_model(request.getfixturevalue(model_fixture), dtype, kernel)
    if not model.enable_cpu_decoder():
        pytest.skip(f"no {kernel} packing of these linears on this CPU")
    if not one_call:
        model.cpu_decoder_path = None
    runner = runner_for(model, dtype)
    forward = runner._forward
    asked: list[list[int]] = []

    def both(flat, output_rows=None):  # type: ignore[no-untyped-def]
        kept = forward(flat, output_rows)
        if output_rows is None:
            return kept
        asked.append(output_rows.tolist())
        whole = forward(flat)
        assert kept.shape == (len(output_rows), whole.shape[1])
        assert torch.equal(kept, whole.index_select(0, output_rows))
        return kept

    monkeypatch.setattr(runner, "_forward", both)
    driver = PagedDriver(runner, seed=2)
    gen = torch.Generator().manual_seed(4)
    for rid, n in {"a": 7, "b": 30, "c": 19}.items():
        driver.add(rid, torch.randint(3, 500, (n,), generator=gen).tolist())
    # a chunk that samples nothing, prefills (b chunked: no row of it samples), a mixed
    # step, decodes
    for step in [{"b": 6}, {"a": 7, "b": 6}, {"a": 1, "b": 18, "c": 19},
                 {"a": 1, "b": 1, "c": 1}]:
        driver.step(step)
    assert asked == [[], [6], [0, 18, 37]]  # the decode-only step keeps every row: none asked


def test_models_and_settings_it_does_not_cover(tmp_path: Path, tiny_llama_dir: Path) -> None:
    # sandwich norms, soft cap and windows (Gemma 2); unpacked linears; an unfused norm
    gemma = make_checkpoint(tmp_path / "gemma2", "gemma2", seed=1)
    assert not packed_model(gemma, torch.float32).enable_cpu_decoder()
    assert not load_model(tiny_llama_dir, torch.float32).enable_cpu_decoder()
    unfused = packed_model(tiny_llama_dir, torch.float32)
    unfused.layers[1].post_attention_layernorm.fused = False
    assert not unfused.enable_cpu_decoder()
    # linears on two kernels (one layer's o packed for oneDNN, the rest for cpu_gemm); a
    # oneDNN SwiGLU whose silu_mul is not cpu_fused's
    mixed = packed_model(tiny_llama_dir, torch.float32)
    if mixed.layers[0].self_attn.qkv_weight_packed.gemm:
        attn = mixed.layers[1].self_attn
        attn.o_weight_packed = pack_weight(attn.o_weight, "onednn")
        assert attn.o_weight_packed is not None and not attn.o_weight_packed.gemm
        assert not mixed.enable_cpu_decoder()
    onednn = packed_model(tiny_llama_dir, torch.bfloat16, "onednn")
    if onednn.enable_cpu_decoder():
        onednn.layers[0].mlp.fused = False
        assert not onednn.enable_cpu_decoder()
    plain = packed_model(tiny_llama_dir, torch.float32)
    if plain.enable_cpu_decoder():
        path = plain.cpu_decoder_path
        assert path is not None and len(path.weights.qkv) == 2
        assert path.dims == LayerDims(4, 2, 16, 128, 64, 128, 64)


def test_bad_input_raises_value_error(tiny_llama_dir: Path) -> None:
    model = packed_model(tiny_llama_dir, torch.float32)
    if not model.enable_cpu_decoder():
        pytest.skip("the linears are not packed for cpu_gemm on this CPU")
    path = model.cpu_decoder_path
    assert path is not None
    runner = runner_for(model, torch.float32)
    ks = [k for k, _ in runner.kv_caches]
    vs = [v for _, v in runner.kv_caches]
    hidden = torch.randn(1, 64)
    args = (path.rotary.cos_cache, path.rotary.sin_cache)
    good = {"slot_mapping": torch.tensor([3]),
            "block_tables": torch.zeros(1, 2, dtype=torch.int32),
            "seq_lens": torch.tensor([4], dtype=torch.int32)}
    cpu_decoder.decode_layers(hidden, torch.tensor([3]), path.weights, path.dims, ks, vs, *args,
                              **good, eps=path.eps, scale=path.scale)
    with pytest.raises(ValueError, match="per-layer list"):
        cpu_decoder.decode_layers(hidden, torch.tensor([3]), path.weights, path.dims, ks[:1],
                                  vs, *args, **good, eps=path.eps, scale=path.scale)
    for rows in (torch.tensor([1]), torch.tensor([-1]), torch.tensor([0], dtype=torch.int32)):
        with pytest.raises(ValueError, match="output_rows"):
            cpu_decoder.decode_layers(hidden, torch.tensor([3]), path.weights, path.dims, ks,
                                      vs, *args, **good, eps=path.eps, scale=path.scale,
                                      output_rows=rows)
    with pytest.raises(ValueError):  # a slot past the cache: the KV write's own check
        cpu_decoder.decode_layers(hidden, torch.tensor([3]), path.weights, path.dims, ks, vs,
                                  *args, slot_mapping=torch.tensor([64 * 16]),
                                  block_tables=good["block_tables"], seq_lens=good["seq_lens"],
                                  eps=path.eps, scale=path.scale)
