"""Loads an HF Llama-family directory (safetensors, sharded or not) into our model.

HF checkpoint names are mapped onto our fused layout: q/k/v projections are
concatenated into one ``qkv_weight`` (and bias), gate/up into ``gate_up_weight``.
Every parameter of the model must be filled exactly once; anything missing is an
error that names the tensor, and unknown tensors (other than rotary buffers) too.

With tensor parallelism a rank reads only its slices (``safe_open(...).get_slice``):
its heads' rows of q/k/v, its columns of o, its rows of gate/up and columns of down,
its vocabulary rows of the embedding and lm_head (zero-padded past the vocabulary),
and the small replicated tensors whole, so its resident weights are about 1/M of
the split tensors plus the replicated ones.
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
from services.worker.parallel import SINGLE, ShardSizes, TensorParallel

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
    tp: TensorParallel = SINGLE,
) -> LlamaForCausalLM:
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_position, tp)
    reader = _ShardReader(config, model.shard, tp)
    tensors = _read_checkpoint(model_dir, config, reader)
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
            if tensors[name].shape != param.shape:
                raise ModelLoadError(f"{model_dir}: {name} has shape {tuple(tensors[name].shape)}, "
                                     f"the model expects {tuple(param.shape)}")
            param.data = tensors[name].to(device=device, dtype=dtype).contiguous()
        if config.tie_word_embeddings:
            model.lm_head_weight = model.embed_tokens.weight
    model.finish_loading()
    return model.eval()


class _ShardReader:
    """Reads one tensor of the checkpoint as this rank holds it (whole with one rank)."""

    def __init__(self, config: ModelConfig, shard: ShardSizes, tp: TensorParallel) -> None:
        self.config, self.shard, self.tp = config, shard, tp
        d = config.head_dim
        q_rows = shard.num_heads * d
        self.q = (tp.rank * q_rows, q_rows)  # (first row, rows) of q_proj
        self.kv = (shard.kv_head_start * d, shard.num_kv_heads * d)
        self.mlp = (tp.rank * shard.intermediate, shard.intermediate)

    def read(self, f, key: str, target: str, slot: int | None) -> torch.Tensor:  # type: ignore[no-untyped-def]
        if self.tp.size == 1:
            return f.get_tensor(key)
        part = f.get_slice(key)
        name = target.rsplit(".", 1)[-1]
        if slot is not None:  # one of q/k/v or gate/up: this rank's rows
            start, rows = (self.q if slot == 0 else self.kv) if ".qkv_" in target else self.mlp
            return part[start : start + rows]
        if name == "qkv_weight":  # stored fused (Phi-3): q, k and v rows of this rank
            cfg = self.config
            q_all, kv_all = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
            pieces = [(self.q[0], self.q[1]), (q_all + self.kv[0], self.kv[1]),
                      (q_all + kv_all + self.kv[0], self.kv[1])]
            return torch.cat([part[a : a + n] for a, n in pieces])
        if name == "gate_up_weight":  # stored fused (Phi-3): gate rows, then up rows
            start, rows = self.mlp
            inter = self.config.intermediate_size
            return torch.cat([part[start : start + rows], part[inter + start : inter + start + rows]])
        if name in ("o_weight", "down_weight"):  # row-parallel: this rank's columns
            start, cols = self.q if name == "o_weight" else self.mlp
            return part[:, start : start + cols]
        if target in ("embed_tokens.weight", "lm_head_weight"):
            return self._vocab_rows(part)
        return f.get_tensor(key)  # replicated: norms, the row-parallel biases

    def _vocab_rows(self, part) -> torch.Tensor:  # type: ignore[no-untyped-def]
        start, rows, vocab = self.shard.vocab_start, self.shard.vocab_per_rank, self.config.vocab_size
        held = part[start : min(start + rows, vocab)] if start < vocab else None
        if held is not None and held.shape[0] == rows:
            return held
        hidden = part.get_shape()[1]
        out = torch.zeros(rows, hidden, dtype=held.dtype if held is not None else torch.float32)
        if held is not None:
            out[: held.shape[0]] = held
        return out


def _read_checkpoint(model_dir: Path, config: ModelConfig,
                     reader: _ShardReader) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict: no __iter__)
                target = _map_key(key)
                if target is None:
                    continue
                if isinstance(target, tuple):
                    fused[target[0]][target[1]] = reader.read(f, key, target[0], target[1])
                else:
                    out[target] = reader.read(f, key, target, None)
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
