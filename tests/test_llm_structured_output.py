"""Structured output through the offline ``LLM`` on a tiny random checkpoint with a real
vocabulary (SmolLM2's tokenizer, logits padded past it): whatever the model would say,
every output under a JSON schema parses and validates, every output under a regex
matches it, a choice is one of the choices, an EBNF grammar holds; greedy and sampled,
n > 1, beside free requests, and through preemption. An unusable constraint is a
ValueError with the engine left idle."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from pagoda import LLM
from shared.sampling_params import SamplingParams, StructuredOutputsParams
from support.tool_model import make_tool_model

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{2,8}@[a-z]{2,6}\.(com|org|net)"
DATE = r"\d{4}-\d{2}-\d{2}"
GRAMMAR = 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'
CHOICES = ["positive", "negative", "neutral ground"]


@pytest.fixture(scope="module")
def llm(tiny_smollm_dir: Path) -> LLM:
    return LLM(str(tiny_smollm_dir), dtype="float32", num_kv_blocks=256, max_model_len=512)


def sampled(so: StructuredOutputsParams, seeds: range = range(3), **kw: Any) -> list[SamplingParams]:
    """Greedy, then temperature 1 with each seed."""
    kw.setdefault("max_tokens", 96)
    return [SamplingParams(temperature=0.0, structured_outputs=so, **kw)] + [
        SamplingParams(temperature=1.0, seed=s, structured_outputs=so, **kw) for s in seeds]


def texts(llm: LLM, params: list[SamplingParams]) -> list[tuple[str, str | None]]:
    outs = llm.generate(["Tell me about it."] * len(params), params, use_tqdm=False)
    return [(c.text, c.finish_reason) for o in outs for c in o.outputs]


def test_json_schema_outputs_validate(llm: LLM) -> None:
    so = StructuredOutputsParams(json=SCHEMA)  # a dict is serialized
    params = sampled(so) + [SamplingParams(temperature=1.0, seed=11, n=3, structured_outputs=so,
                                           max_tokens=96)]
    results = texts(llm, params)
    assert len(results) == 1 + 3 + 3
    for text, reason in results:
        assert reason == "stop", (text, reason)
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({t for t, _ in results[1:]}) > 1, "sampled outputs should differ"


@pytest.mark.parametrize("pattern", [EMAIL, DATE])
def test_regex_outputs_match(llm: LLM, pattern: str) -> None:
    for text, reason in texts(llm, sampled(StructuredOutputsParams(regex=pattern))):
        assert reason == "stop" and re.fullmatch(pattern, text), (text, reason)


def test_choice_and_grammar(llm: LLM) -> None:
    for text, reason in texts(llm, sampled(StructuredOutputsParams(choice=CHOICES))):
        assert reason == "stop" and text in CHOICES, text
    for text, reason in texts(llm, sampled(StructuredOutputsParams(grammar=GRAMMAR))):
        assert reason == "stop" and re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", text), text


def test_constrained_and_free_requests_share_steps(llm: LLM) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    so = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(
        regex=EMAIL))
    alone = llm.generate(["Tell me about it."], free, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate(["Tell me about it.", "Tell me about it."], [free, so], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone, "a free request is masked by its neighbour"
    assert re.fullmatch(EMAIL, outs[1].outputs[0].text)


def test_outputs_stay_valid_through_preemption(tiny_smollm_dir: Path) -> None:
    # 7 blocks of 16 tokens for 6 sequences of ~5 prompt + ~25 output tokens each
    small = LLM(str(tiny_smollm_dir), dtype="float32", num_kv_blocks=7, max_model_len=512)
    so = StructuredOutputsParams(json=json.dumps(SCHEMA))
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=96, structured_outputs=so)
              for s in range(4)] + [SamplingParams(temperature=1.0, seed=9, n=2, max_tokens=96,
                                                   structured_outputs=so)]
    outs = small.generate(["Tell me about it."] * len(params), params, use_tqdm=False)
    assert small.stats().num_preemptions > 0, "the pool was meant to force preemption"
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)


@pytest.mark.parametrize("so, message", [
    (StructuredOutputsParams(regex="(abc"), "parenthesis"),
    (StructuredOutputsParams(json='{"type": "objectx"}'), "objectx"),
    (StructuredOutputsParams(json="{not json"), "not valid JSON"),
    (StructuredOutputsParams(grammar='root ::= undefined_rule'), "undefined_rule"),
])
def test_an_unusable_constraint_is_a_value_error(llm: LLM, so: StructuredOutputsParams,
                                                 message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate(["hi"], SamplingParams(structured_outputs=so), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    st = llm.stats()
    assert (st.running, st.waiting, st.kv_usage) == (0, 0, 0.0)


def test_offline_chat_renders_tools_and_a_required_call_validates(
        smollm2_dir: Path, tmp_path: Path) -> None:
    """LLM.chat(tools=...) as vLLM's: the template renders the tools; a call is forced with
    the same JSON-schema constraint the HTTP API builds for tool_choice=required."""
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
    llm = LLM(str(make_tool_model(smollm2_dir, tmp_path / "tools")), dtype="float32",
              num_kv_blocks=128)
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=(
        StructuredOutputsParams(json=json.dumps(schema))))
    out = llm.chat([{"role": "user", "content": "Weather in Paris?"}], params,
                   use_tqdm=False, tools=[tool])[0]
    assert out.prompt is not None and '"name": "get_weather"' in out.prompt
    jsonschema.validate(json.loads(out.outputs[0].text), schema)
    plain = llm.chat([{"role": "user", "content": "Weather in Paris?"}], params, use_tqdm=False)[0]
    assert plain.prompt is not None and "get_weather" not in plain.prompt
