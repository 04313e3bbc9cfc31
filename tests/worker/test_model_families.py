"""Each supported family against HF transformers' own implementation, same weights.

Tiny random checkpoints made here with transformers (no download). Logits of a mixed
batch are checked in test_model_vs_hf.py; here: exactly HF's greedy tokens over 64
steps in float32 through the offline engine, and the sliding-window length rule
(``shared/model_limits.py``): full attention equals windowed attention only inside the
window, so the window caps max_model_len and a longer one is refused, naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagoda import LLM, SamplingParams
from shared import model_limits
from support.checkpoints import load_hf, make_checkpoint

FAMILIES = {  # name: (kind, config overrides)
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
    "phi3": ("phi3", {}),
    "phi4-mini (partial rotary)": ("phi3", {"partial_rotary_factor": 0.75}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_tokens_equal_hf_generate(family: str, tmp_path: Path) -> None:
    kind, overrides = FAMILIES[family]
    model_dir = make_checkpoint(tmp_path / kind, kind, seed=5, **overrides)
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64)
    assert_greedy_equals_hf(llm, model_dir, seed=9, lengths=(5, 23, 70), what=family)


def assert_greedy_equals_hf(llm: LLM, model_dir: Path, seed: int, lengths: tuple[int, ...],
                            what: str) -> None:
    """64 greedy tokens of random prompts of these lengths: ours exactly HF generate's."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]
    ours = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
                        use_tqdm=False)
    hf = load_hf(model_dir)
    for prompt, out in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                              min_new_tokens=64, eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist(), what


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
    if rope_type in ("dynamic", "longrope"):  # HF changes frequencies past the original length
        assert llm.engine.max_model_len == (256 if rope_type == "longrope" else 1024)
    assert_greedy_equals_hf(llm, model_dir, seed=3, lengths=(9, 60), what=rope_type)


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


def test_a_sliding_window_caps_max_model_len_and_a_longer_one_is_refused(tmp_path: Path) -> None:
    model_dir = make_checkpoint(tmp_path / "mistral", "mistral", seed=6, sliding_window=96)
    cfg = json.loads((model_dir / "config.json").read_text())
    assert model_limits.max_model_len(cfg) == 96
    assert model_limits.max_model_len(cfg, 80) == 80
    with pytest.raises(ValueError, match="sliding_window 96"):
        model_limits.max_model_len(cfg, 200)
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=32)
    assert llm.engine.max_model_len == 96
    with pytest.raises(ValueError, match="sliding_window"):
        LLM(str(model_dir), dtype="float32", num_kv_blocks=32, max_model_len=200)


def test_qwen_windows_apply_only_when_switched_on(tmp_path: Path) -> None:
    model_dir = make_checkpoint(tmp_path / "qwen2", "qwen2", seed=7, sliding_window=64)
    cfg = write_config(model_dir, use_sliding_window=False)
    assert model_limits.sliding_window(cfg) is None  # the HF default: full attention
    base = {k: v for k, v in cfg.items() if k != "layer_types"}
    on = {**base, "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0}
    assert model_limits.sliding_window(on) == 64
    with pytest.raises(ValueError, match="on layers \\[1\\] only"):
        model_limits.sliding_window({**on, "max_window_layers": 1})
    assert model_limits.sliding_window({**on, "max_window_layers": 2}) is None
    # transformers 5 writes layer_types, which wins
    assert model_limits.sliding_window(
        {**on, "layer_types": ["sliding_attention", "sliding_attention"]}) == 64
    with pytest.raises(ValueError, match="per-layer window"):
        model_limits.sliding_window({**on, "layer_types": ["full_attention", "sliding_attention"]})
