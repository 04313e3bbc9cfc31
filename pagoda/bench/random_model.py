"""Random-weight Llama-shaped checkpoints for benchmarks and the GPU check.

    python -m pagoda.bench.random_model OUT [--preset 1b|toy] [--tokenizer DIR|smollm2|none]
                                            [--dtype bfloat16] [--device auto] [--seed 0]

Made with transformers from a config (HF's own initialisation, seeded), saved as an HF
directory (config.json, model.safetensors) in the dtype asked for, with a tokenizer's
files copied beside it so text prompts and the chat template work. The ``1b`` preset is
SmolLM2's family at 1.07 B parameters (hidden 2048, 16 layers, 32 query / 8 KV heads of
64, intermediate 8192, SmolLM2's 49,152-token vocabulary, tied embeddings): 2.15 GB in
bf16, big enough that a GPU's step time means something, made in seconds on the GPU
(``--device auto``: there when there is one). ``toy`` is the same family at a few
million parameters, for dry runs on a CPU. A directory is written once: it appears under
its name only when complete, and an existing one is returned as it is.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

SMOLLM2_FAMILY: dict[str, Any] = {  # what every preset shares with SmolLM2
    "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 2,
}
PRESETS: dict[str, dict[str, Any]] = {
    "1b": {**SMOLLM2_FAMILY, "hidden_size": 2048, "intermediate_size": 8192,
           "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8},
    "toy": {**SMOLLM2_FAMILY, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


def tokenizer_source(name: str | None) -> Path | None:
    """The directory to copy tokenizer files from: a path, ``smollm2`` (the default model,
    fetched once into the cache) or None / ``none`` (no tokenizer: token-id prompts)."""
    if name is None or name == "none":
        return None
    if name == "smollm2":
        from pagoda.model_fetch import resolve_model

        return resolve_model("smollm2", progress=False)
    path = Path(name).expanduser()
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{path}: no tokenizer.json")
    return path


def make_random_model(path: Path, shape: dict[str, Any], dtype: str = "bfloat16",
                      device: str = "cpu", seed: int = 0, tokenizer: Path | None = None) -> Path:
    """Writes a random Llama of ``shape`` (LlamaConfig fields) to ``path`` unless a model
    is there already; returns ``path``."""
    if (path / "config.json").is_file():
        return path
    from transformers import AutoModelForCausalLM, LlamaConfig

    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.parent))
    try:
        torch.manual_seed(seed)
        with torch.device(device):  # initialised where it is made: seconds on a GPU
            model = AutoModelForCausalLM.from_config(LlamaConfig(**shape),
                                                     dtype=getattr(torch, dtype))
        model.save_pretrained(staging, safe_serialization=True)
        del model
        for name in TOKENIZER_FILES if tokenizer is not None else ():
            if (tokenizer / name).is_file():
                shutil.copy(tokenizer / name, staging / name)
        staging.chmod(0o755)  # mkdtemp's 0700 is for the staging only
        staging.rename(path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def count_parameters(shape: dict[str, Any]) -> int:
    """Parameters of a Llama of ``shape`` (tied embeddings counted once)."""
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    head_dim = shape.get("head_dim") or h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim
    q = shape["num_attention_heads"] * head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h  # attention, MLP, 2 norms
    embed = shape["vocab_size"] * h
    return embed * (1 if shape.get("tie_word_embeddings") else 2) + layers * per_layer + h


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagoda.bench.random_model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", type=Path)
    p.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    p.add_argument("--tokenizer", default="smollm2", help="a directory, smollm2 or none")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--device", default="auto", help="where to initialise: auto, cpu, cuda")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = PRESETS[args.preset]
    path = make_random_model(args.path, shape, args.dtype, device, args.seed,
                             tokenizer_source(args.tokenizer))
    print(json.dumps({"path": str(path), "preset": args.preset, "dtype": args.dtype,
                      "parameters": count_parameters(shape),
                      "tokenizer": (path / "tokenizer.json").is_file()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
