"""Loads an HF Llama-family directory (safetensors, sharded or not) into our model.

HF checkpoint names are mapped onto our fused layout: q/k/v projections are
concatenated into one ``qkv_weight`` (and bias), gate/up into ``gate_up_weight``.
Every parameter of the model must be filled exactly once; anything missing is an
error that names the tensor, and unknown tensors (other than rotary buffers) too.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from services.worker.model_config import ModelConfig, ModelLoadError
from services.worker.models.llama import LlamaForCausalLM

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF name inside a layer -> (our parameter, slot of the fused tensor)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv", 0),
    "self_attn.k_proj": ("self_attn.qkv", 1),
    "self_attn.v_proj": ("self_attn.qkv", 2),
    "mlp.gate_proj": ("mlp.gate_up", 0),
    "mlp.up_proj": ("mlp.gate_up", 1),
}
_RENAMED = {
    # Phi-3/4 store q/k/v and gate/up fused, in our order already
    "self_attn.qkv_proj.weight": "self_attn.qkv_weight",
    "mlp.gate_up_proj.weight": "mlp.gate_up_weight",
    "self_attn.o_proj.weight": "self_attn.o_weight",
    "self_attn.o_proj.bias": "self_attn.o_bias",
    "mlp.down_proj.weight": "mlp.down_weight",
    "mlp.down_proj.bias": "mlp.down_bias",
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "pre_feedforward_layernorm.weight": "pre_feedforward_layernorm.weight",  # Gemma 2 / 3
    "post_feedforward_layernorm.weight": "post_feedforward_layernorm.weight",
    "self_attn.q_norm.weight": "self_attn.q_norm.weight",  # Qwen3, Gemma 3
    "self_attn.k_norm.weight": "self_attn.k_norm.weight",
}
_TOP = {
    "model.embed_tokens.weight": "embed_tokens.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head_weight",
}


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise ModelLoadError(f"{model_dir}: shard(s) named in {index.name} missing: {missing}")
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{model_dir}: no *.safetensors weights (model.safetensors or an index) found"
        )
    return files


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    max_position: int | None = None,
) -> LlamaForCausalLM:
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_position)
    tensors = _read_checkpoint(model_dir, config)
    params = dict(model.named_parameters())
    missing = [n for n in params if n not in tensors and n != "lm_head_weight"]
    if missing:
        raise ModelLoadError(f"{model_dir}: checkpoint lacks tensors for {missing[:5]}")
    if "lm_head_weight" not in tensors:
        if not config.tie_word_embeddings:
            raise ModelLoadError(f"{model_dir}: no lm_head.weight and tie_word_embeddings is false")
        tensors["lm_head_weight"] = tensors["embed_tokens.weight"]
    # materialise on the target device in the requested dtype (the meta parameters were
    # made in the default dtype), then the derived state (rotary caches, which stay fp32)
    model = model.to_empty(device=device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.data = tensors[name].to(device=device, dtype=dtype).contiguous()
        if config.tie_word_embeddings:
            model.lm_head_weight = model.embed_tokens.weight
    model.finish_loading()
    return model.eval()


def _read_checkpoint(model_dir: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict: no __iter__)
                target = _map_key(key)
                if target is None:
                    continue
                if isinstance(target, tuple):
                    fused[target[0]][target[1]] = f.get_tensor(key)
                else:
                    out[target] = f.get_tensor(key)
    for name, parts in fused.items():
        expected = 3 if ".qkv_" in name else 2
        if len(parts) != expected:
            raise ModelLoadError(f"{model_dir}: incomplete fused tensor {name} ({len(parts)} parts)")
        out[name] = torch.cat([parts[i] for i in range(expected)], dim=0)
    return out


def _map_key(key: str) -> str | tuple[str, int] | None:
    if key in _TOP:
        return _TOP[key]
    m = _LAYER_KEY.match(key)
    if m is None:
        if key.endswith("rotary_emb.inv_freq"):
            return None
        raise ModelLoadError(f"unexpected tensor {key!r} in checkpoint")
    layer, rest = m.group(1), m.group(2)
    if rest.endswith("rotary_emb.inv_freq"):
        return None
    module, _, kind = rest.rpartition(".")
    if module in _FUSED:
        fused_name, slot = _FUSED[module]
        return (f"layers.{layer}.{fused_name}_{kind}", slot)
    if rest in _RENAMED:
        return f"layers.{layer}.{_RENAMED[rest]}"
    raise ModelLoadError(f"unexpected tensor {key!r} in checkpoint")
