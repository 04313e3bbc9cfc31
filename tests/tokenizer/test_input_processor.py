"""InputProcessor in-process: limits from config.json, a model without a tokenizer, the
bounds on what a chat template renders and how long it may take."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from services.tokenizer.frontend_core import FrontendCore
from services.tokenizer.input_processor import (
    ChatTurn,
    InputProcessor,
    InvalidRequest,
    PromptInput,
    load_limits,
    load_tokenizer,
)
from shared.codec import MalformedFrameCounter
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


# a template that multiplies its input, and one that takes seconds on any input
MULTIPLYING = "{% for m in messages %}{% for i in range(1000) %}{{ m.content }}{% endfor %}{% endfor %}"
SLOW = ("{% set ns = namespace(n=0) %}{% for i in range(700) %}{% for j in range(700) %}"
        "{% set ns.n = ns.n + j %}{% endfor %}{% endfor %}{{ messages[0].content }}")


@pytest.fixture
def smollm2_processor(smollm2_dir: Path) -> InputProcessor:
    return InputProcessor(load_tokenizer(smollm2_dir), load_limits(smollm2_dir))


def test_a_template_that_multiplies_its_input_is_refused(smollm2_processor: InputProcessor) -> None:
    smollm2_processor.tokenizer.chat_template = MULTIPLYING
    chat = PromptInput(SamplingParams(), messages=[ChatTurn("user", "x" * 20_000)])
    with pytest.raises(InvalidRequest, match="rendered 20000000 characters; the limit is"):
        smollm2_processor.process(chat)


def test_rendering_past_the_deadline_is_a_400_and_the_loop_stays_free(
        smollm2_processor: InputProcessor) -> None:
    """The core renders on its prepare pool: past ``prepare_timeout_s`` the client gets
    InvalidRequest (400) while the event loop goes on serving (a quick request still
    validates meanwhile)."""
    smollm2_processor.tokenizer.chat_template = SLOW
    core = FrontendCore("f", smollm2_processor, None, MalformedFrameCounter(), None,  # type: ignore[arg-type]
                        ("m",), prepare_timeout_s=0.3)
    slow = PromptInput(SamplingParams(), messages=[ChatTurn("user", "hi")])
    quick = PromptInput(SamplingParams(), prompt_token_ids=[1, 2, 3])

    async def run() -> tuple[BaseException | None, list[int], float]:
        started = time.monotonic()
        slow_task = asyncio.ensure_future(core.validate([slow]))
        quick_ids = (await core.validate([quick]))[0].prompt_token_ids
        try:
            await slow_task
        except InvalidRequest as e:
            return e, quick_ids, time.monotonic() - started
        return None, quick_ids, time.monotonic() - started

    error, quick_ids, took = asyncio.run(run())
    assert isinstance(error, InvalidRequest) and "took over 0.3 s" in str(error)
    assert quick_ids == [1, 2, 3]
    assert took < 2.0, took
