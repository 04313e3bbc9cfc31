"""Each supported family against HF transformers' own implementation, same weights.

Tiny random checkpoints made here with transformers (no download). Logits of a mixed
batch are checked in test_model_vs_hf.py; here: exactly HF's greedy tokens over 64
steps in float32 through the offline engine; for the families with sliding windows
(Gemma 2 / 3 on every other layer, Mistral on all) with windows of 6-8 tokens and
prompts past them, also through chunked prefill on every attention backend, and the
logits at every position of chunked prefills and decodes against one HF forward; and
the rules of ``shared/model_limits.py`` (which layers slide, what is refused).
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # the Triton case runs in the interpreter (read at import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagoda import LLM, SamplingParams
from services.worker.attention import get_attention_backend
from services.worker.layers.linear import pack_cpu_linears
from services.worker.loader import load_model
from services.worker.model_config import ModelConfig, ModelLoadError
from services.worker.model_runner import ModelRunner
from shared import model_limits
from support.checkpoints import load_hf, make_checkpoint
from support.paged import PagedDriver

HAS_TRITON = importlib.util.find_spec("triton") is not None

FAMILIES = {  # name: (kind, config overrides)
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
    "phi3": ("phi3", {}),
    "phi4-mini (partial rotary)": ("phi3", {"partial_rotary_factor": 0.75}),
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3", {}),
}
WINDOWED = {  # families whose windows the prompts below pass
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3", {}),
    "mistral (window 8)": ("mistral", {"sliding_window": 8}),
    "qwen2 (window 8 from layer 1)": ("qwen2", {"use_sliding_window": True, "sliding_window": 8,
                                                "max_window_layers": 1}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_tokens_equal_hf_generate(family: str, tmp_path: Path) -> None:
    kind, overrides = FAMILIES[family]
    model_dir = make_checkpoint(tmp_path / kind, kind, seed=5, **overrides)
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64)
    assert_greedy_equals_hf(llm, model_dir, seed=9, lengths=(5, 23, 70), what=family)


def assert_greedy_equals_hf(llm: LLM, model_dir: Path, seed: int, lengths: tuple[int, ...],
                            what: str, num_tokens: int = 64) -> None:
    """Greedy tokens of random prompts of these lengths: ours exactly HF generate's."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    ours = llm.generate(prompts, params, use_tqdm=False)
    hf = load_hf(model_dir)
    for prompt, out in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False,
                              min_new_tokens=num_tokens, eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist(), what


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_windowed_families_chunked_give_hf_greedy_tokens(family: str, backend: str,
                                                         tmp_path: Path) -> None:
    """Prompts past the window, prefilled in chunks of 16 tokens beside the decodes of
    the others (4-token blocks: windows start mid-block), 24 tokens decoded past it."""
    kind, overrides = WINDOWED[family]
    model_dir = make_checkpoint(tmp_path / kind, kind, seed=5, **overrides)
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=128, block_size=4,
              max_num_batched_tokens=16, attention_backend=backend)
    assert llm.engine.max_model_len == 1024  # the window no longer caps it
    assert_greedy_equals_hf(llm, model_dir, seed=9, lengths=(5, 23, 45),
                            what=f"{family} {backend}", num_tokens=24)


def _runner(model_dir: Path, backend: str) -> ModelRunner:
    """The production CPU path (oneDNN-packed linears, fused C++ kernels) for ``cpu``;
    plain torch for ``torch``; the Triton kernels (interpreted without a GPU) for
    ``triton``, tiny tiles and forced split-K so these shapes take every path."""
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    model = load_model(model_dir).to(dev)
    if backend == "cpu":
        pack_cpu_linears(model)
    if backend == "triton":
        from services.worker.attention.triton_backend import TritonAttentionBackend

        attention = TritonAttentionBackend(num_splits=2, decode_tile_n=16, prefill_block_m=16,
                                           prefill_tile_n=16)
    else:
        attention = get_attention_backend(torch.device(dev), backend)
    return ModelRunner(model, attention, num_blocks=64, block_size=4, device=dev)


LOGIT_CASES = [("gemma2", "torch"), ("gemma2", "cpu"), ("gemma3", "torch"), ("gemma3", "cpu")]
if HAS_TRITON:  # interpreted without a GPU (~20 s): Gemma 2 has both the window and soft cap
    LOGIT_CASES.append(("gemma2", "triton"))


@pytest.mark.parametrize("kind,backend", LOGIT_CASES)
def test_gemma_logits_match_hf_through_chunks_and_decodes(kind: str, backend: str,
                                                          tmp_path: Path) -> None:
    """Float32 logits at every sampled position against one HF forward over the final
    sequences: a 30-token prompt in chunks of 7, 9 and 14 (the chunks' keys reach back
    over cached context, past the 6-token window), beside two prompts prefilled whole
    and decoding; then 10 decodes of all three."""
    if backend == "triton" and not torch.cuda.is_available() and (
            os.environ.get("TRITON_INTERPRET") != "1"):
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1")
    model_dir = make_checkpoint(tmp_path / kind, kind, seed=11)
    driver = PagedDriver(_runner(model_dir, backend), seed=3)
    gen = torch.Generator().manual_seed(4)
    for rid, n in (("a", 30), ("b", 5), ("c", 13)):
        driver.add(rid, torch.randint(3, 512, (n,), generator=gen).tolist())
    seen: list[tuple[str, int, torch.Tensor]] = []  # (request, position, logits there)
    steps = [{"b": 5, "c": 13, "a": 7}, {"b": 1, "c": 1, "a": 9}, {"b": 1, "c": 1, "a": 14}]
    steps += [{"a": 1, "b": 1, "c": 1}] * 10
    for step in steps:
        for rid, logits in driver.step(step)[1].items():
            seen.append((rid, driver.computed[rid] - 1, logits.float().cpu()))
    assert [pos for rid, pos, _ in seen if rid == "a"] == list(range(29, 40))
    hf = load_hf(model_dir)
    with torch.no_grad():
        ref = {rid: hf(torch.tensor([driver.tokens[rid][:-1]])).logits[0] for rid in "abc"}
    for rid, pos, logits in seen:
        want = ref[rid][pos]
        diff = float((logits - want).abs().max())
        assert diff <= 1e-4 * float(want.max() - want.min()), f"{kind} {backend} {rid}@{pos}: {diff:.3g}"


def test_window_soft_caps_and_scales_each_matter(tmp_path: Path) -> None:
    """The test checkpoints are sensitive to every Gemma hook: without any one of them
    the last logits of a 40-token prompt move far past the tolerance above."""
    model_dir = make_checkpoint(tmp_path / "gemma2", "gemma2", seed=11)
    prompt = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = load_hf(model_dir)(torch.tensor([prompt])).logits[0, -1]

    def last_logits(**attn: object) -> torch.Tensor:
        runner = _runner(model_dir, "torch")
        for layer in runner.model.layers:
            for name, value in attn.items():
                setattr(layer.self_attn, name, value)
        driver = PagedDriver(runner)
        driver.add("p", prompt)
        return driver.prefill(["p"])[1]["p"]

    assert float((last_logits() - want).abs().max()) < 1e-4
    for change in ({"window": None}, {"softcap": None}, {"scale": 16**-0.5}):
        assert float((last_logits(**change) - want).abs().max()) > 0.05, change


def test_old_style_gemma3_config_reads_as_the_new_one(tmp_path: Path) -> None:
    """transformers 4 wrote Gemma 3 configs without layer_types and with rope_theta,
    rope_local_base_freq, rope_scaling and sliding_window_pattern at the top level; both
    forms give the same model, and HF's greedy tokens."""
    model_dir = make_checkpoint(tmp_path / "gemma3", "gemma3", seed=5)
    new = ModelConfig.from_dir(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    for key in ("layer_types", "rope_parameters", "_sliding_window_pattern"):
        cfg.pop(key, None)
    cfg.update(rope_theta=10000.0, rope_local_base_freq=100.0, sliding_window_pattern=2,
               rope_scaling={"rope_type": "linear", "factor": 2.0})
    (model_dir / "config.json").write_text(json.dumps(cfg))
    old = ModelConfig.from_dir(model_dir)
    assert replace(old, rope_scaling=None) == replace(new, rope_scaling=None)
    for cfg in (old, new):  # transformers 5 copies rope_theta into the scaling parameters
        assert cfg.rope_scaling is not None and cfg.rope_scaling["factor"] == 2.0
        assert cfg.rope_scaling["rope_type"] == "linear"
    assert new.layer_windows == (6, None, 6, None) and new.rope_local_theta == 100.0
    assert new.rope_theta == 10000.0
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64)
    assert_greedy_equals_hf(llm, model_dir, seed=2, lengths=(17,), what="old-style gemma3")


def test_gemma_defaults_and_refusals() -> None:
    base = {"architectures": ["Gemma2ForCausalLM"], "vocab_size": 8, "hidden_size": 8,
            "intermediate_size": 8, "num_hidden_layers": 3, "num_attention_heads": 1,
            "sliding_window": 4}
    cfg = ModelConfig.from_hf_dict(base)  # Gemma2Config's defaults fill the absent keys
    assert cfg.layer_windows == (4, None, 4)
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (50.0, 30.0)
    assert cfg.query_pre_attn_scalar == 256 and cfg.hidden_act == "gelu_pytorch_tanh"
    nulls = ModelConfig.from_hf_dict({**base, "attn_logit_softcapping": None,
                                      "final_logit_softcapping": None})
    assert nulls.attn_logit_softcapping is None and nulls.final_logit_softcapping is None
    gemma3 = {**base, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 7}
    cfg3 = ModelConfig.from_hf_dict(gemma3)  # every 6th layer full, global rope 1e6
    assert cfg3.layer_windows == (4, 4, 4, 4, 4, None, 4)
    assert (cfg3.rope_theta, cfg3.rope_local_theta) == (1e6, 10000.0)
    assert cfg3.attn_logit_softcapping is None and cfg3.qk_norm  # HF ignores the former
    with pytest.raises(ModelLoadError, match="use_bidirectional_attention"):
        ModelConfig.from_hf_dict({**gemma3, "use_bidirectional_attention": True})
    with pytest.raises(ModelLoadError, match="hidden activation 'silu'"):
        ModelConfig.from_hf_dict({**base, "hidden_activation": "silu"})
    with pytest.raises(ModelLoadError, match="sliding_attention: unsupported rope type 'yarn'"):
        ModelConfig.from_hf_dict({**gemma3, "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "yarn", "factor": 2.0}}})


ROPE = {  # rope_parameters of a tiny Llama (head_dim 16, max_position_embeddings 1024)
    "linear": {"rope_type": "linear", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 256,
                 "short_factor": [1.0 + 0.1 * i for i in range(8)],
                 "long_factor": [2.0 + 0.5 * i for i in range(8)]},
}


@pytest.mark.parametrize("rope_type", sorted(ROPE))
def test_rope_scaling_types_give_hf_greedy_tokens(rope_type: str, tmp_path: Path) -> None:
    params = {**ROPE[rope_type], "rope_theta": 10000.0}
    model_dir = make_checkpoint(tmp_path / rope_type, "llama", seed=8, rope_parameters=params)
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64)
    # dynamic NTK scaling goes past max_position_embeddings (1024) by its factor
    assert llm.engine.max_model_len == (2048 if rope_type == "dynamic" else 1024)
    assert_greedy_equals_hf(llm, model_dir, seed=3, lengths=(9, 60), what=rope_type)


LENGTH_DEPENDENT = {  # (rope parameters, max_position_embeddings, prompt lengths)
    # longrope: long factors once a sequence is past original_max_position_embeddings 24
    "longrope": ({"rope_type": "longrope", "original_max_position_embeddings": 24,
                  "short_factor": [1.0 + 0.1 * i for i in range(8)],
                  "long_factor": [2.0 + 0.5 * i for i in range(8)]}, 128, (10, 20, 40)),
    # dynamic: a new NTK base for every length past max_position_embeddings 32
    "dynamic": ({"rope_type": "dynamic", "factor": 4.0}, 32, (10, 25, 40)),
}


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("rope_type", sorted(LENGTH_DEPENDENT))
def test_length_dependent_rope_past_the_original_context(rope_type: str, backend: str,
                                                         tmp_path: Path) -> None:
    """Prompts below, across and past the length where HF switches frequencies, and 64
    greedy tokens decoded across it, batched: each sequence exactly what HF generate gives
    it alone (a fresh HF model per prompt: HF's dynamic rope keeps the longest length it
    has seen across calls)."""
    params, max_pos, lengths = LENGTH_DEPENDENT[rope_type]
    model_dir = make_checkpoint(tmp_path / rope_type, "llama", seed=8, max_position_embeddings=max_pos,
                                rope_parameters={**params, "rope_theta": 10000.0})
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=128, block_size=4,
              attention_backend=backend)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]
    num_tokens = 64
    ours = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=num_tokens,
                                                ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, ours):
        hf = load_hf(model_dir)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False,
                              min_new_tokens=num_tokens, eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist(), (rope_type, len(prompt))


def test_an_unknown_rope_type_is_refused_at_load(tmp_path: Path) -> None:
    model_dir = make_checkpoint(tmp_path / "m", "llama", seed=8)
    write_config(model_dir, rope_parameters={"rope_type": "mrope", "rope_theta": 10000.0})
    with pytest.raises(Exception, match="rope_scaling: unsupported rope type 'mrope'"):
        LLM(str(model_dir), dtype="float32", num_kv_blocks=16)


def write_config(path: Path, **fields: object) -> dict[str, object]:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(fields)
    (path / "config.json").write_text(json.dumps(cfg))
    return cfg


def test_a_sliding_window_no_longer_caps_max_model_len(tmp_path: Path) -> None:
    model_dir = make_checkpoint(tmp_path / "mistral", "mistral", seed=6, sliding_window=96)
    cfg = json.loads((model_dir / "config.json").read_text())
    assert model_limits.max_model_len(cfg) == 1024
    assert model_limits.max_model_len(cfg, 200) == 200
    with pytest.raises(ValueError, match="max_position_embeddings 1024"):
        model_limits.max_model_len(cfg, 2000)
    assert model_limits.layer_windows(cfg) == [96, 96]
    # HF's Mistral windows every layer, whatever layer_types says
    assert model_limits.layer_windows({**cfg, "layer_types": ["full_attention"] * 2}) == [96, 96]
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=32, max_model_len=200)
    assert llm.engine.max_model_len == 200


def test_qwen_windows_apply_only_when_switched_on(tmp_path: Path) -> None:
    model_dir = make_checkpoint(tmp_path / "qwen2", "qwen2", seed=7, sliding_window=64)
    cfg = write_config(model_dir, use_sliding_window=False)
    assert model_limits.sliding_window(cfg) is None  # the HF default: full attention
    assert model_limits.layer_windows(cfg) == [None, None]
    base = {k: v for k, v in cfg.items() if k != "layer_types"}
    on = {**base, "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0}
    assert model_limits.sliding_window(on) == 64
    assert model_limits.layer_windows({**on, "max_window_layers": 1}) == [None, 64]
    assert model_limits.layer_windows({**on, "max_window_layers": 2}) == [None, None]
    assert model_limits.layer_windows({k: v for k, v in on.items()
                                       if k != "max_window_layers"}) == [None, None]  # HF: 28
    # transformers 5 writes layer_types, which wins
    assert model_limits.layer_windows(
        {**on, "layer_types": ["full_attention", "sliding_attention"]}) == [None, 64]


def test_unsupported_layer_types_are_refused_by_name(tmp_path: Path) -> None:
    model_dir = make_checkpoint(tmp_path / "gemma2", "gemma2", seed=7)
    cfg = write_config(model_dir, layer_types=["sliding_attention", "chunked_attention",
                                               "full_attention", "full_attention"])
    with pytest.raises(ValueError, match="layer_types \\['chunked_attention'\\] not supported"):
        model_limits.max_model_len(cfg)
    with pytest.raises(ModelLoadError, match="chunked_attention"):
        ModelConfig.from_dir(model_dir)
    write_config(model_dir, layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ModelLoadError, match="names 2 layers, num_hidden_layers is 4"):
        ModelConfig.from_dir(model_dir)
