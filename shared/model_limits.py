"""How long a sequence a model directory allows, read the same way by every process.

The frontend (validation), the worker (the KV pool and the model) and so the scheduler
must agree on ``max_model_len``. It is the model's ``max_position_embeddings``, capped
by a sliding attention window: pagoda's attention is full causal attention, which
equals windowed attention only while a sequence fits in the window, so a longer
sequence would be answered wrong. Until windowed attention lands in the kernels, such
models run with ``max_model_len <= sliding_window`` (a larger configured length is
refused, naming the field). Likewise for rope types whose frequencies HF changes with
the sequence length (``dynamic``, ``longrope``): below the original context they are
the initial frequencies, so sequences are kept there.
"""

from __future__ import annotations

from typing import Any

_WINDOW_FLAGGED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")  # window only with use_sliding_window


def sliding_window(cfg: dict[str, Any]) -> int | None:
    """The window HF's implementation applies on every layer, or None (full attention).

    As transformers reads a config: ``layer_types`` (written by transformers 5) names
    each layer's kind; without it, Qwen2/Qwen3 apply ``sliding_window`` only with
    ``use_sliding_window`` and from layer ``max_window_layers`` on, other families on
    every layer. A window that only some layers apply raises ValueError: the model code
    has no per-layer window yet, and attending fully there would be wrong past it.
    """
    window = cfg.get("sliding_window")
    archs = cfg.get("architectures") or []
    flagged = any(a in _WINDOW_FLAGGED for a in archs)
    if window is None or (flagged and not cfg.get("use_sliding_window", False)):
        return None
    layers = int(cfg.get("num_hidden_layers", 0))
    kinds = cfg.get("layer_types")
    if kinds is None:
        first = int(cfg.get("max_window_layers", 0)) if flagged else 0
        kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    sliding = [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]
    if not sliding:
        return None
    if len(sliding) < len(kinds):
        raise ValueError(
            f"sliding_window {window} on layers {sliding} only (layer_types / "
            "max_window_layers): a per-layer window is not supported yet")
    return int(window)


def max_model_len(cfg: dict[str, Any], configured: int | None = None) -> int:
    """``configured`` (validated) or the longest sequence the model allows."""
    text = cfg.get("text_config") or {}  # multimodal configs nest the language model
    max_pos = cfg.get("max_position_embeddings") or text.get("max_position_embeddings")
    if not isinstance(max_pos, int):
        raise ValueError("config.json lacks max_position_embeddings")  # noqa: TRY004 -- a bad model dir
    window = sliding_window(cfg)
    limit = max_pos if window is None else min(max_pos, window)
    rope_cap = _rope_length_cap(cfg)
    if rope_cap is not None and rope_cap < limit:
        limit, window = rope_cap, None
    if configured is None:
        return limit
    if configured > max_pos:
        raise ValueError(f"max_model_len {configured} exceeds the model's "
                         f"max_position_embeddings {max_pos}")
    if configured > limit and window is not None:
        raise ValueError(f"max_model_len {configured} exceeds the model's sliding_window "
                         f"{window}: past the window pagoda's full attention would differ "
                         "from the model's windowed attention")
    if configured > limit:
        raise ValueError(f"max_model_len {configured} exceeds {limit}, the rope_scaling "
                         "original_max_position_embeddings: past it HF changes the rotary "
                         "frequencies with the sequence length, which pagoda does not do yet")
    return configured


def rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """The rope scaling parameters, whether written as rope_parameters (transformers 5)
    or rope_scaling; empty for the default rope."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    return {} if kind == "default" else {**params, "rope_type": kind}


def _rope_length_cap(cfg: dict[str, Any]) -> int | None:
    params = rope_parameters(cfg)
    if params.get("rope_type") not in ("dynamic", "longrope"):
        return None
    original = params.get("original_max_position_embeddings") or cfg.get(
        "original_max_position_embeddings") or cfg.get("max_position_embeddings")
    return int(original)
