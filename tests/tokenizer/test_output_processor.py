"""OutputProcessor in-process: scheduler outputs in, client outputs into the right sinks.

The oracle for text is the tokenizer's own whole-sequence decode; the stop-string cut is
checked against ``str.find`` on that text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.tokenizer.frontend_core import ClientRequest
from services.tokenizer.input_processor import load_tokenizer
from services.tokenizer.output_processor import (
    OutputItem,
    OutputProcessor,
    RequestFailed,
    RequestState,
    SampleOutput,
)
from shared.protocol import EngineOutput
from shared.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    return load_tokenizer(smollm2_dir)


def collected(n: int) -> tuple[ClientRequest, list[OutputItem]]:
    items: list[OutputItem] = []
    return ClientRequest(n, items.append), items


def ids_of(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_two_prompts_stream_into_one_sink_and_concatenate_to_the_decode(tokenizer: Any) -> None:
    texts = ["Pagodas have 北京 tiers 🏯 and bells.", "Second prompt, n=2."]
    token_lists = [ids_of(tokenizer, t) for t in texts]
    request, items = collected(1 + 2)
    proc = OutputProcessor()
    proc.add(RequestState("a", 0, SamplingParams(max_tokens=64), 5, tokenizer, True, request))
    proc.add(RequestState("b", 1, SamplingParams(n=2, max_tokens=64), 7, tokenizer, True, request))
    steps = max(len(t) for t in token_lists)
    for step in range(steps):  # one token per sample per step, as the scheduler sends them
        outs = []
        for rid, ids, n in (("a", token_lists[0], 1), ("b", token_lists[1], 2)):
            if step < len(ids):
                last = step == len(ids) - 1
                outs += [EngineOutput(rid, i, [ids[step]], finish_reason="length" if last else None)
                         for i in range(n)]
        assert proc.process(outs) == []
    assert request.finished and len(proc) == 0
    for prompt, ids, n in ((0, token_lists[0], 1), (1, token_lists[1], 2)):
        for i in range(n):
            mine = [o for o in items if isinstance(o, SampleOutput)
                    and (o.prompt_index, o.index) == (prompt, i)]
            assert "".join(o.text for o in mine) == tokenizer.decode(ids, skip_special_tokens=True)
            assert [t for o in mine for t in o.token_ids] == ids
            assert mine[-1].finish_reason == "length" and mine[-1].num_output_tokens == len(ids)
            assert all(o.finish_reason is None for o in mine[:-1])


def test_stop_string_ends_the_sample_and_is_reported_for_an_abort(tokenizer: Any) -> None:
    text = "one two three STOP four five"
    ids = ids_of(tokenizer, text)
    request, items = collected(2)
    proc = OutputProcessor()
    params = SamplingParams(n=2, stop=["STOP"], max_tokens=64)
    proc.add(RequestState("r", 0, params, 3, tokenizer, False, request))
    stopped = []
    for t in ids:
        stopped += proc.process([EngineOutput("r", 0, [t]), EngineOutput("r", 1, [t])])
    assert sorted(stopped) == [("r", 0), ("r", 1)]
    finals = [o for o in items if isinstance(o, SampleOutput)]
    assert len(finals) == 2, "not streaming: one whole output per sample"
    assert all(o.text == text[: text.find("STOP")] and o.stop_reason == "STOP" for o in finals)
    assert request.finished and "r" not in proc
    # the scheduler catching up with the abort: ignored
    assert proc.process([EngineOutput("r", 0, [], finish_reason="abort")]) == []
    assert len(items) == 2


def test_end_delivers_abort_outputs_or_drops_them(tokenizer: Any) -> None:
    proc = OutputProcessor()
    kept, kept_items = collected(2)
    gone, gone_items = collected(1)
    proc.add(RequestState("k", 0, SamplingParams(n=2), 3, tokenizer, True, kept))
    proc.add(RequestState("g", 0, SamplingParams(), 3, tokenizer, True, gone))
    proc.process([EngineOutput("k", 0, ids_of(tokenizer, "Hi"))])
    assert proc.end("k", [1]) and not kept.finished
    assert proc.end("k") and kept.finished and "k" not in proc
    assert [o.finish_reason for o in kept_items if isinstance(o, SampleOutput)] == [None, "abort", "abort"]
    assert proc.end("g", deliver=False) and gone_items == [] and "g" not in proc
    assert not proc.end("k"), "ending twice is a no-op"


def test_a_scheduler_error_fails_the_sink(tokenizer: Any) -> None:
    proc = OutputProcessor()
    request, items = collected(1)
    proc.add(RequestState("x", 0, SamplingParams(), 3, tokenizer, True, request))
    proc.fail("x", "overloaded", "queue full")
    assert isinstance(items[0], RequestFailed) and items[0].code == "overloaded"
    assert request.finished and request.failed and len(proc) == 0
