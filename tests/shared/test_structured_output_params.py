"""The structured-output request field on the wire and its grammar: exactly one
constraint, bounded sizes, a schema dict serialized, the native client's dict form,
StepBatch masks consistent with their rows, and the grammar every process builds."""

from __future__ import annotations

import json

import msgspec
import pytest

from shared.codec import decode, encode
from shared.protocol import SCHEDULER_TO_WORKER, StepBatch
from shared.sampling_params import (
    MAX_CONSTRAINT_CHARS,
    SamplingParams,
    SamplingParamsError,
    StructuredOutputsParams,
)
from shared.structured_output import GrammarError, build_grammar, check_constraint, constraint_key


def test_exactly_one_bounded_constraint() -> None:
    for bad in ({}, {"regex": "a", "choice": ["b"]}, {"json_object": True, "grammar": "x"}):
        with pytest.raises(SamplingParamsError, match="exactly one"):
            StructuredOutputsParams(**bad)
    with pytest.raises(SamplingParamsError, match="non-empty"):
        StructuredOutputsParams(choice=["a", ""])
    with pytest.raises(SamplingParamsError, match="at most"):
        StructuredOutputsParams(regex="a" * (MAX_CONSTRAINT_CHARS + 1))
    with pytest.raises(SamplingParamsError, match="at most"):
        StructuredOutputsParams(choice=["ab"] * (MAX_CONSTRAINT_CHARS // 2 + 1))


def test_a_schema_dict_is_serialized_and_the_dict_form_decodes() -> None:
    so = StructuredOutputsParams(json={"type": "object"})
    assert so.json == '{"type": "object"}'
    params = SamplingParams.from_dict({"max_tokens": 3, "structured_outputs": {"regex": "a+"}})
    assert params.structured_outputs == StructuredOutputsParams(regex="a+")
    with pytest.raises(SamplingParamsError, match="unknown field 'pattern'"):
        SamplingParams.from_dict({"structured_outputs": {"pattern": "a+"}})
    wire = msgspec.msgpack.encode(params)
    assert msgspec.msgpack.decode(wire, type=SamplingParams) == params


def test_step_batch_masks_match_their_rows() -> None:
    ok = StepBatch(3, grammar_seq_ids=[1, 2], grammar_bitmasks=bytes(16))
    assert decode(encode(ok), SCHEDULER_TO_WORKER) == ok
    for ids, data in (([1], b""), ([], bytes(4)), ([1, 2], bytes(12))):
        with pytest.raises(ValueError, match="bitmask bytes"):
            StepBatch(3, grammar_seq_ids=ids, grammar_bitmasks=data)


def test_keys_and_grammars() -> None:
    assert constraint_key(StructuredOutputsParams(choice=["a", 'b"'])) == ("choice", '["a", "b\\""]')
    assert constraint_key(StructuredOutputsParams(json_object=True)) == ("json_object", "")
    # choices are EBNF literals: quotes, backslashes, newlines and non-ASCII survive
    grammar = str(build_grammar(StructuredOutputsParams(choice=['say "hi"', "a\\b", "ü\n"])))
    assert "root" in grammar
    check_constraint(StructuredOutputsParams(json=json.dumps({"type": "integer"})))
    with pytest.raises(GrammarError, match=r"^structured_outputs.regex: Regex parsing error"):
        check_constraint(StructuredOutputsParams(regex="(a"))
    with pytest.raises(GrammarError, match="not valid JSON"):
        check_constraint(StructuredOutputsParams(json="{"))
