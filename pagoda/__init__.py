"""pagoda: the public face of the engine (CLI, offline LLM, client library).

``from pagoda import LLM, SamplingParams`` loads the engine lazily, so the CLI and
the client library start without importing torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pagoda.llm import LLM

        return LLM
    if name == "SamplingParams":
        from shared.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from shared.sampling_params import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(f"module 'pagoda' has no attribute {name!r}")
