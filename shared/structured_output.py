"""Structured output: what a request's constraint means, as an xgrammar grammar.

One function (``build_grammar``) turns a ``StructuredOutputsParams`` into an
``xgrammar.Grammar``, so every process agrees on what a constraint allows:

- the frontend builds it to validate a request (an invalid JSON schema, regex or EBNF
  grammar is an ``invalid_request`` before anything reaches the engine); this needs no
  tokenizer;
- the scheduler compiles the same grammar against the model's vocabulary
  (``services/scheduler/structured_output.py``) and ships a token bitmask per step.

Meanings (vLLM's, through xgrammar):
- ``json``: the JSON schema (xgrammar's converter, strict: no properties beyond those
  the schema lists unless it allows them), written compactly: ``", "`` and ``": "``
  between items, no other whitespace (as OpenAI's outputs read). vLLM's default allows
  any whitespace; a model can then spend its whole ``max_tokens`` on it (a random
  checkpoint always did: of SmolLM2's 49k tokens, hundreds are whitespace runs), and
  bounding it (``max_whitespace_cnt``) made a schema compile 5x slower and its compiled
  form 47x larger (4.2 MB at 32 characters); strings bounded by minLength/maxLength
  exclude raw control characters (an xgrammar bug otherwise lets them in, see below);
- ``json_object``: any JSON object (the schema ``{"type": "object"}``);
- ``regex``: the whole output matches it (xgrammar's regex dialect, close to Python's);
- ``choice``: the output is exactly one of the strings;
- ``grammar``: an EBNF grammar in xgrammar's (GBNF-like) syntax, rooted at ``root``.

``xgrammar`` (which imports torch) is imported at the first use, so a process that never
sees a constraint never pays for it.
"""

from __future__ import annotations

import functools
import json
import re
from typing import TYPE_CHECKING, Any

from shared.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

# "[21:17:55] /project/cpp/json_schema_converter.cc:5082: Unsupported type ..." -> the message
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarError(ValueError):
    """The constraint is not a valid JSON schema, regex or grammar; the message says why."""


def constraint_key(so: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, text): equal keys are the same constraint (the scheduler's compile cache key)."""
    if so.json is not None:
        return "json", so.json
    if so.regex is not None:
        return "regex", so.regex
    if so.choice is not None:
        return "choice", json.dumps(so.choice)
    if so.grammar is not None:
        return "grammar", so.grammar
    return "json_object", ""


def choice_ebnf(choices: list[str]) -> str:
    """``root ::= "a" | "b"``: JSON string escapes are EBNF literal escapes too."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def build_grammar(so: StructuredOutputsParams) -> xgrammar.Grammar:
    """The grammar of a constraint, or GrammarError naming what is wrong."""
    kind, text = constraint_key(so)
    xgr = _xgrammar()
    try:
        if kind == "json":
            json.loads(text)  # a clear message for text that is not JSON at all
            return _json_strings_fixed(xgr.Grammar.from_json_schema(text, any_whitespace=False))
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(so.choice or []))
        return xgr.Grammar.from_ebnf(text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"structured_outputs.json: not valid JSON: {e}") from None
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse errors are RuntimeError
        raise GrammarError(f"structured_outputs.{kind}: {clean_message(e)}") from None


def check_constraint(so: StructuredOutputsParams) -> None:
    """GrammarError unless the constraint builds; the last distinct valid ones are remembered
    (a client repeating one schema pays for its check once)."""
    _check_key(*constraint_key(so))


@functools.lru_cache(maxsize=256)
def _check_key(kind: str, text: str) -> None:  # an error is raised, so never cached
    build_grammar(_params_of(kind, text))


def _params_of(kind: str, text: str) -> StructuredOutputsParams:
    if kind == "choice":
        return StructuredOutputsParams(choice=json.loads(text))
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json":
        return StructuredOutputsParams(json=text)
    if kind == "regex":
        return StructuredOutputsParams(regex=text)
    return StructuredOutputsParams(grammar=text)


# xgrammar (0.2.9; its issue #800) writes a string with minLength/maxLength as a repetition
# of this class, which lets raw control characters (U+0000-U+001F but CR, LF) into the
# string: invalid JSON (a random checkpoint emitted "\x07"). Rewritten to exclude them.
_BOUNDED_STRING_CLASS = r"[^\"\\\r\n]"
_JSON_STRING_CLASS = r"[^\0-\x1f\"\\]"


def _json_strings_fixed(grammar: xgrammar.Grammar) -> xgrammar.Grammar:
    ebnf = str(grammar)
    if _BOUNDED_STRING_CLASS not in ebnf:
        return grammar
    return _xgrammar().Grammar.from_ebnf(ebnf.replace(_BOUNDED_STRING_CLASS, _JSON_STRING_CLASS))


def clean_message(error: BaseException) -> str:
    """xgrammar's C++ error text without its time stamp and source location, bounded."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return _CPP_PREFIX.sub("", first)[:500]


def _xgrammar() -> Any:
    import xgrammar

    return xgrammar
