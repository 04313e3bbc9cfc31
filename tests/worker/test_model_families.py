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

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_tokens_equal_hf_generate(kind: str, tmp_path: Path) -> None:
    model_dir = make_checkpoint(tmp_path / kind, kind, seed=5)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 23, 70)]
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64)
    ours = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
                        use_tqdm=False)
    hf = load_hf(model_dir)
    for prompt, out in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                              min_new_tokens=64, eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist(), kind


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
