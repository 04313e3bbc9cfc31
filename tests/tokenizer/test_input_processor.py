"""InputProcessor in-process: limits from config.json, a model without a tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.tokenizer.input_processor import (
    ChatTurn,
    InputProcessor,
    InvalidRequest,
    PromptInput,
    load_limits,
    load_tokenizer,
)
from shared.sampling_params import SamplingParams, StructuredOutputsParams


def test_limits_come_from_config_and_respect_a_configured_length(tiny_llama_dir: Path) -> None:
    limits = load_limits(tiny_llama_dir)
    assert (limits.vocab_size, limits.max_model_len) == (512, 1024)
    assert load_limits(tiny_llama_dir, 100).max_model_len == 100
    with pytest.raises(ValueError, match="max_position_embeddings"):
        load_limits(tiny_llama_dir, 4096)


def test_a_model_without_tokenizer_serves_token_ids_only(tiny_llama_dir: Path) -> None:
    assert load_tokenizer(tiny_llama_dir) is None
    proc = InputProcessor(None, load_limits(tiny_llama_dir, 32))
    ok = proc.process(PromptInput(SamplingParams(max_tokens=None), prompt_token_ids=[3, 4]))
    assert ok.prompt_token_ids == [3, 4] and ok.sampling_params.max_tokens == 30
    for req in (PromptInput(SamplingParams(), prompt="hello"),
                PromptInput(SamplingParams(), messages=[ChatTurn("user", "hi")])):
        with pytest.raises(InvalidRequest, match="no tokenizer"):
            proc.process(req)
    constrained = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(InvalidRequest, match="structured_outputs needs the model's tokenizer"):
        proc.process(PromptInput(constrained, prompt_token_ids=[3, 4]))
