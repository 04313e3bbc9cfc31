"""How long a sequence a model directory allows, and which layers attend through a sliding
window, read the same way by every process.

The frontend (validation), the worker (the KV pool and the model) and so the scheduler
must agree on ``max_model_len``. It is the model's ``max_position_embeddings``. A sliding
attention window does not cap it: every attention path (``kernels/``: the torch
reference, the C++ CPU kernels and the Triton kernels) honours a per-layer window, which
the model reads from ``layer_windows`` here. A config that describes attention the
kernels do not compute (a layer type other than full or sliding) is refused, naming the
field. Rope types whose frequencies HF changes with the sequence length (``dynamic``,
``longrope``) are computed that way by the worker (``layers/rotary.py``), so they do not
cap it; ``dynamic`` NTK scaling exists to go past ``max_position_embeddings``, so its
limit is that times the rope ``factor`` (vLLM's rule).
"""

from __future__ import annotations

from typing import Any

_WINDOW_FLAGGED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")  # window only with use_sliding_window
# HF applies sliding_window on every layer of these, whatever layer_types says
_WINDOW_EVERY_LAYER = ("MistralForCausalLM", "Phi3ForCausalLM")
SLIDING, FULL = "sliding_attention", "full_attention"


def layer_windows(cfg: dict[str, Any]) -> list[int | None]:
    """Per layer, the sliding window HF's implementation applies there (a query at
    position p sees keys p - window < j <= p), or None for full causal attention.

    As transformers reads a config: ``layer_types`` (written by transformers 5) names
    each layer's kind; without it, Qwen2/Qwen3 apply ``sliding_window`` only with
    ``use_sliding_window`` and from layer ``max_window_layers`` on, Gemma 2 on every
    other layer (0, 2, ...), Gemma 3 on all but every ``sliding_window_pattern``-th,
    other families on every layer. A layer kind other than full or sliding attention
    raises ValueError naming it.
    """
    layers = int(cfg.get("num_hidden_layers", 0))
    window = cfg.get("sliding_window")
    archs = cfg.get("architectures") or []
    flagged = any(a in _WINDOW_FLAGGED for a in archs)
    if window is None or (flagged and not cfg.get("use_sliding_window", False)):
        return [None] * layers
    kinds = cfg.get("layer_types")
    if kinds is None or any(a in _WINDOW_EVERY_LAYER for a in archs):
        kinds = [SLIDING if _slides_by_default(cfg, archs, i) else FULL for i in range(layers)]
    unknown = sorted({str(k) for k in kinds} - {SLIDING, FULL})
    if unknown:
        raise ValueError(f"layer_types {unknown} not supported (only {FULL!r} and {SLIDING!r})")
    return [int(window) if kind == SLIDING else None for kind in kinds]


def _slides_by_default(cfg: dict[str, Any], archs: list[str], layer: int) -> bool:
    """Whether layer ``layer`` is windowed in a config without ``layer_types``."""
    if any(a in _WINDOW_FLAGGED for a in archs):
        return layer >= int(cfg.get("max_window_layers", 28))  # HF's default: 28
    if "Gemma2ForCausalLM" in archs:
        return layer % 2 == 0
    if "Gemma3ForCausalLM" in archs:
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        return (layer + 1) % pattern != 0
    return True


def sliding_window(cfg: dict[str, Any]) -> int | None:
    """The window of the model's windowed layers (``layer_windows``), or None when every
    layer attends fully. Some layers may be full (Gemma, Qwen's ``max_window_layers``)."""
    return next((w for w in layer_windows(cfg) if w is not None), None)


def max_model_len(cfg: dict[str, Any], configured: int | None = None) -> int:
    """``configured`` (validated) or the longest sequence the model allows."""
    text = cfg.get("text_config") or {}  # multimodal configs nest the language model
    max_pos = cfg.get("max_position_embeddings") or text.get("max_position_embeddings")
    if not isinstance(max_pos, int):
        raise ValueError("config.json lacks max_position_embeddings")  # noqa: TRY004 -- a bad model dir
    layer_windows(cfg)  # a layer type the kernels do not compute is refused here
    params = rope_parameters(cfg)
    limit, why = max_pos, f"the model's max_position_embeddings {max_pos}"
    if params.get("rope_type") == "dynamic":
        limit = int(max_pos * float(params.get("factor", 1.0)))
        why = f"max_position_embeddings {max_pos} x the dynamic rope factor ({limit})"
    if configured is None:
        return limit
    if configured > limit:
        raise ValueError(f"max_model_len {configured} exceeds {why}")
    return configured


def rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """The rope scaling parameters, whether written as rope_parameters (transformers 5)
    or rope_scaling; empty for the default rope. Where transformers 5 nests them by layer
    type (Gemma 3: ``{"full_attention": {...}, "sliding_attention": {...}}``), those of
    the full-attention layers (the local rope of Gemma 3's sliding layers is unscaled)."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if isinstance(params.get(FULL), dict) or isinstance(params.get(SLIDING), dict):
        params = params.get(FULL) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    return {} if kind == "default" else {**params, "rope_type": kind}

