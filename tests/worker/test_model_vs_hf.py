"""Our model through the paged runner against HF transformers (float32, CPU).

Oracle: one HF forward over each full final sequence gives the logits at every
position; our prefill (4 prompts in one flattened step) and each of 16 following
decode steps must match them at the same positions.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.worker.attention import get_attention_backend
from services.worker.layers.linear import pack_cpu_linears
from services.worker.loader import load_model
from services.worker.model_runner import ModelRunner
from support.checkpoints import load_hf
from support.paged import PagedDriver

MODELS = ["tiny_llama_dir", "tiny_llama3_rope_dir", "tiny_qwen2_dir", "tiny_qwen3_dir",
          "smollm2_dir"]


def make_runner(model_dir: Path, num_blocks: int = 256, block_size: int = 16,
                packed: bool = True, dtype: torch.dtype = torch.float32,
                kv_dtype: torch.dtype | None = None) -> ModelRunner:
    """The production CPU path packs the linears (cpu_gemm or oneDNN: layers/linear.py), runs
    the default CPU attention backend and fused kernels (the C++ kernels where they
    build; decode steps through models/cpu_decoder_path.py where it covers the model);
    the plain path runs F.linear, torch's elementwise ops and the pure torch
    attention backend."""
    model = load_model(model_dir, dtype)
    if packed:
        assert pack_cpu_linears(model) > 0, "weight packing did not apply on this CPU"
        model.enable_cpu_decoder()  # as runner_builder: decode steps in one C++ call
    if not packed:  # the torch ops in place of the fused C++ norm/rotary/SiLU kernels
        for module in model.modules():
            if hasattr(module, "fused"):
                module.fused = False
    backend = get_attention_backend(torch.device("cpu"), None if packed else "torch")
    return ModelRunner(model, backend, num_blocks, block_size, kv_dtype=kv_dtype or dtype)


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    logit_range = float(ref.max() - ref.min())
    diff = float((ours - ref).abs().max())
    assert diff <= 1e-3 * logit_range, f"{what}: max abs diff {diff:.3g}, range {logit_range:.3g}"


@pytest.mark.parametrize("packed", [True, False], ids=["production", "plain"])
@pytest.mark.parametrize("model_fixture", MODELS)
def test_prefill_and_decode_logits_match_hf(model_fixture: str, packed: bool,
                                            request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(model_fixture)
    runner = make_runner(model_dir, packed=packed)
    vocab = runner.model.config.vocab_size
    gen = torch.Generator().manual_seed(7)
    lengths = [3, 17, 40, 9]
    driver = PagedDriver(runner, seed=11)
    ids = [f"r{i}" for i in range(len(lengths))]
    for rid, n in zip(ids, lengths):
        driver.add(rid, torch.randint(0, vocab, (n,), generator=gen).tolist())
    steps = [driver.prefill(ids)[1]]
    for _ in range(16):
        steps.append(driver.decode(ids)[1])

    hf = load_hf(model_dir)
    for rid, n in zip(ids, lengths):
        with torch.no_grad():
            ref = hf(torch.tensor([driver.tokens[rid][:-1]])).logits[0].float()
        for s, logits in enumerate(steps):
            assert_logits_close(logits[rid], ref[n - 1 + s], f"{model_fixture} {rid} step {s}")


def bf16_rounding_cache(hf: torch.nn.Module) -> dict[str, object]:
    """HF's DynamicCache with K/V rounded to bf16 as they enter it, as hf's forward takes
    it: the oracle of an fp32 model over a bf16 KV cache, whose attention reads every key
    (the fresh ones too) as the cache holds it."""
    from transformers import DynamicCache

    from pagoda.bench.exact_match import hf_cache

    class Bf16KVCache(DynamicCache):
        def update(self, key_states: torch.Tensor, value_states: torch.Tensor,  # type: ignore[override]
                   layer_idx: int, *args: object, **kwargs: object) -> object:
            return super().update(key_states.bfloat16().float(), value_states.bfloat16().float(),
                                  layer_idx, *args, **kwargs)

    return hf_cache(hf, Bf16KVCache)


@pytest.mark.parametrize("packed", [True, False], ids=["production", "plain"])
@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_fp32_over_a_bf16_kv_cache_matches_hf_with_a_rounding_cache(
        model_fixture: str, packed: bool, request: pytest.FixtureRequest) -> None:
    """``--kv-cache-dtype bfloat16`` under an fp32 model: prefill and 16 decode steps
    against HF fp32 whose cache rounds K/V to bf16, within the fp32 test's tolerance; plain
    HF fp32 is many times further off (the rounding is really there)."""
    model_dir = request.getfixturevalue(model_fixture)
    runner = make_runner(model_dir, packed=packed, kv_dtype=torch.bfloat16)
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(7)
    lengths = [3, 17, 40, 9]
    driver = PagedDriver(runner, seed=11)
    ids = [f"r{i}" for i in range(len(lengths))]
    for rid, n in zip(ids, lengths):
        driver.add(rid, torch.randint(0, runner.model.config.vocab_size, (n,),
                                      generator=gen).tolist())
    steps = [driver.prefill(ids)[1]]
    for _ in range(16):
        steps.append(driver.decode(ids)[1])
    hf = load_hf(model_dir)
    err_rounded = err_plain = 0.0
    for rid, n in zip(ids, lengths):
        seq = torch.tensor([driver.tokens[rid][:-1]])
        with torch.no_grad():
            ref = hf(seq, use_cache=True, **bf16_rounding_cache(hf)).logits[0].float()
            plain = hf(seq).logits[0].float()
        for s, logits in enumerate(steps):
            want = ref[n - 1 + s]
            assert_logits_close(logits[rid], want, f"{model_fixture} {rid} step {s}")
            scale = float(want.max() - want.min())
            err_rounded += float((logits[rid] - want).abs().mean()) / scale
            err_plain += float((logits[rid] - plain[n - 1 + s]).abs().mean()) / scale
    assert err_rounded < 0.1 * err_plain, (err_rounded, err_plain)


def test_bfloat16_runner_is_as_close_to_fp32_as_hf_bfloat16(smollm2_dir: Path) -> None:
    """bf16 (``dtype=auto`` where it is the faster CPU dtype): weights, activations and KV cache
    in bf16, norms, rotary and softmax in fp32. Oracle: HF in fp32; the yardstick: HF's
    own bf16 model at the same positions. Our error must be of the same size as HF's
    (a broken path, e.g. a wrong dtype in the cache or a lost scale, is many times off)
    and the top token must agree as often."""
    runner = make_runner(smollm2_dir, dtype=torch.bfloat16)
    layer = runner.model.layers[0]
    assert layer.self_attn.qkv_weight.dtype == torch.bfloat16
    assert layer.self_attn.qkv_weight_packed is not None
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(3)
    lengths = [5, 33, 70]
    driver = PagedDriver(runner, seed=4)
    ids = [f"r{i}" for i in range(len(lengths))]
    for rid, n in zip(ids, lengths):
        driver.add(rid, torch.randint(0, runner.model.config.vocab_size, (n,), generator=gen).tolist())
    steps = [driver.prefill(ids)[1]]
    for _ in range(12):
        steps.append(driver.decode(ids)[1])
    hf32 = load_hf(smollm2_dir)
    hf16 = load_hf(smollm2_dir).to(torch.bfloat16)
    ours_err = hf_err = 0.0
    ours_top1 = hf_top1 = total = 0
    for rid, n in zip(ids, lengths):
        seq = torch.tensor([driver.tokens[rid][:-1]])
        with torch.no_grad():
            ref, ref16 = hf32(seq).logits[0].float(), hf16(seq).logits[0].float()
        for s, logits in enumerate(steps):
            want, got, yard = ref[n - 1 + s], logits[rid].float(), ref16[n - 1 + s]
            scale = float(want.max() - want.min())
            ours_err += float((got - want).abs().mean()) / scale
            hf_err += float((yard - want).abs().mean()) / scale
            ours_top1 += int(got.argmax() == want.argmax())
            hf_top1 += int(yard.argmax() == want.argmax())
            total += 1
    assert ours_err <= 2.5 * hf_err, f"mean error {ours_err / total:.4f} vs HF bf16 {hf_err / total:.4f}"
    assert ours_top1 >= hf_top1 - 0.1 * total, f"top-1 {ours_top1}/{total} vs HF bf16 {hf_top1}"


def _prompts_of_lengths(tokenizer, lengths: list[int]) -> list[list[int]]:  # type: ignore[no-untyped-def]
    text = (
        "The history of the city begins with a small fishing village on the river. "
        "Over the centuries, merchants built warehouses, bridges and a cathedral; "
        "scholars founded a university, and the printing press made it famous. "
        "Today visitors walk along the old walls, eat in the markets and listen to music "
        "in the squares, while engineers design new quarters on the former docks. "
    ) * 12
    ids = tokenizer(text)["input_ids"]
    return [ids[:n] for n in lengths]


def test_greedy_batch_matches_hf_generate_alone(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = _prompts_of_lengths(tokenizer, [5, 12, 31, 64, 97, 150, 222, 300])
    runner = make_runner(smollm2_dir, num_blocks=256, block_size=16)
    driver = PagedDriver(runner, seed=3)
    ids = [f"p{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        driver.add(rid, prompt)
    driver.prefill(ids)
    for _ in range(63):
        driver.decode(ids)

    hf = load_hf(smollm2_dir)
    for rid, prompt in zip(ids, prompts):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                pad_token_id=tokenizer.pad_token_id or 0,
            )
        expected = out[0, len(prompt):].tolist()
        ours = driver.output(rid)
        assert len(ours) == 64
        assert ours[: len(expected)] == expected, f"prompt of {len(prompt)} tokens diverged"


@pytest.mark.parametrize("kv_dtype", [None, torch.bfloat16], ids=["kv-auto", "kv-bf16"])
@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "smollm2_dir"])
def test_prompt_in_three_chunks_matches_one_step(model_fixture: str, kv_dtype: torch.dtype | None,
                                                 request: pytest.FixtureRequest) -> None:
    """Also over a bf16 KV cache under fp32: the chunks' attention reads the earlier
    chunks' keys as the cache holds them, and so does the whole prompt's."""
    model_dir = request.getfixturevalue(model_fixture)
    vocab_gen = torch.Generator().manual_seed(5)
    runner = make_runner(model_dir, kv_dtype=kv_dtype)
    prompt = torch.randint(0, runner.model.config.vocab_size, (70,), generator=vocab_gen).tolist()
    side = torch.randint(0, runner.model.config.vocab_size, (9,), generator=vocab_gen).tolist()

    whole = PagedDriver(runner, seed=1)
    whole.add("a", prompt)
    _, one_step = whole.prefill(["a"])

    chunked_runner = make_runner(model_dir, kv_dtype=kv_dtype)
    chunked = PagedDriver(chunked_runner, seed=2)
    chunked.add("a", prompt)
    chunked.add("side", side)
    chunked.prefill(["side"])
    # 3 chunks, sharing each step with a decode of another request; 23 is off-block
    results = [chunked.step({"a": 23, "side": 1}), chunked.step({"a": 32, "side": 1})]
    assert all("a" not in r[0].request_ids for r in results), "a mid-prefill request sampled"
    result, last = chunked.step({"a": 15, "side": 1})
    assert "a" in result.request_ids
    torch.testing.assert_close(last["a"], one_step["a"], rtol=1e-4, atol=1e-4)
    assert chunked.tokens["a"][-1] == whole.tokens["a"][-1]
