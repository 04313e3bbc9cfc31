"""Tool calls in a model's text: the formats of the common chat templates, parsed as the
text streams in.

A ``CallFormat`` says where calls sit in the text; a ``ToolCallStream`` (one per choice)
takes the text delta by delta and returns ``ParsedDelta``s: text outside the calls
(``content``) and, per call, a first delta with its id and name, then its ``arguments``
text as it grows. The non-streaming answer is the same stream fed the whole text at once
(``parse_tool_calls``), so streamed deltas concatenated always equal the whole result,
however the text was split.

Formats (``--tool-call-parser``; ``CallFormat`` fields in brackets):

- ``hermes`` (Hermes 2/3, Qwen 2.5/3): ``<tool_call>\\n{"name": ..., "arguments": {...}}
  \\n</tool_call>``, any number, text around them [marker, end];
- ``llama3_json`` (Llama 3.x): the output starts with ``{"name": ..., "parameters":
  {...}}``, optionally after ``<|python_tag|>``; several joined by ``;`` [lead_tag, bare];
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` after optional
  text [marker, array]; or, from Mistral's v11 tokenizers on (Mistral Small 3.1,
  Devstral, Magistral), ``[TOOL_CALLS]name[ARGS]{...}`` once per call [args_marker];
- ``json_array`` (not a flag value): ``[{"name": ..., "parameters": {...}}, ...]``, what
  ``tool_choice: "required"`` constrains the output to (``tool_calls.py``).

Rules, the same in every format: a call is a JSON object with a ``name`` (one of the
request's tools) and ``arguments`` or ``parameters``; its ``arguments`` are the model's raw
JSON text of that value (``{}`` when absent). Nothing of a call goes out before its name
is complete, so a block that turns out not to be a call (no JSON object, no or an unknown
name) becomes content, marker included; text that may be the start of a marker is held
back. Once named, a call stays a call: if the model breaks its JSON later, or stops
early, the call ends with the arguments it has (OpenAI's advice holds: check them).
Whitespace-only content around calls is dropped.
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from services.tokenizer.tool_call_scan import ArgsCallScan, CallScan, skip_ws


@dataclass(frozen=True)
class CallFormat:
    """Where the tool calls sit in a model's text (see the module docstring)."""

    name: str
    marker: str | None = None  # opens a block of calls anywhere in the text
    lead_tag: str | None = None  # opens a block, only at the start of the text
    bare: bool = False  # a block may also start with its opening bracket, at the start
    array: bool = False  # a block's calls are a JSON array
    separator: str | None = None  # between the calls of a block that is not an array
    end: str | None = None  # closes a block (optional in the text)
    id_chars: int = 0  # ids of exactly this many alphanumerics (Mistral's); 0: call_<24>
    # a block may instead be one call, ``name<args_marker><arguments JSON>``
    args_marker: str | None = None

    @property
    def markers(self) -> tuple[str, ...]:
        return tuple(m for m in (self.marker, self.lead_tag, self.end, self.args_marker) if m)

    def new_call_id(self) -> str:
        alphabet = string.ascii_letters + string.digits
        if self.id_chars:
            return "".join(secrets.choice(alphabet) for _ in range(self.id_chars))
        return "call_" + "".join(secrets.choice(alphabet) for _ in range(24))


HERMES = CallFormat("hermes", marker="<tool_call>", end="</tool_call>")
LLAMA3_JSON = CallFormat("llama3_json", lead_tag="<|python_tag|>", bare=True, separator=";")
# Mistral's chat templates refuse tool call ids that are not 9 alphanumerics
MISTRAL = CallFormat("mistral", marker="[TOOL_CALLS]", array=True, id_chars=9,
                     args_marker="[ARGS]")
JSON_ARRAY = CallFormat("json_array", bare=True, array=True)
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # JSON text

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedDelta:
    content: str = ""
    # OpenAI's delta.tool_calls entries: {"index", "id", "type", "function": {"name",
    # "arguments"}} for a call's first delta, {"index", "function": {"arguments"}} after
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def add_arguments(self, index: int, text: str) -> None:
        for entry in self.tool_calls:
            if entry["index"] == index:
                entry["function"]["arguments"] += text
                return
        self.tool_calls.append({"index": index, "function": {"arguments": text}})


# ToolCallStream block states
_B_ARRAY, _B_CALL, _B_IN_CALL, _B_AFTER, _B_END = range(5)


class ToolCallStream:
    """One choice's text in, content and tool call deltas out (``push``, then ``finish``).

    Outside a block of calls the text is content, up to a possible marker prefix; inside
    one, the current call's ``CallScan`` decides. A block that ends with no named call
    is content again, from its first character; one that breaks after a named call
    resumes as content where it broke.
    """

    def __init__(self, fmt: CallFormat, names: Collection[str] | None = None,
                 new_id: Callable[[], str] | None = None) -> None:
        self.fmt = fmt
        self._names = names
        self._new_id = new_id or fmt.new_call_id
        self.buf = ""
        self.content = ""  # all content returned so far
        self.calls: list[ToolCall] = []
        self._pos = 0  # outside a block: the next undecided char
        self._in_block = False
        self._leading_done = not (fmt.lead_tag or fmt.bare)
        self._ws = ""  # trailing whitespace of the content, held back
        self._delta = ParsedDelta()
        # the current block
        self._block_body = 0  # where the block's calls start (after its marker)
        self._bstate = _B_CALL
        self._bpos = 0
        self._last_end = 0  # after the block's last complete part
        self._block_calls = 0
        self._scan: CallScan | None = None
        self._named = False  # the current scan's call was returned

    def push(self, text: str) -> ParsedDelta:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> ParsedDelta:
        """The text is complete: release what was held back."""
        delta = self._run(final=True)
        if not self.calls and self._ws:  # whitespace around calls is dropped, not text's
            delta.content += self._ws
            self.content += self._ws
        self._ws = ""
        return delta

    def _run(self, final: bool) -> ParsedDelta:
        self._delta = ParsedDelta()
        while self._block(final) if self._in_block else self._outside(final):
            pass
        return self._delta

    # -- outside blocks: content --------------------------------------------------------------
    def _outside(self, final: bool) -> bool:
        """Content up to the next block (True: a block opened) or what is safe."""
        buf, fmt, n = self.buf, self.fmt, len(self.buf)
        if not self._leading_done:
            j = skip_ws(buf, self._pos)
            if j == n:
                if final:
                    self._content(n)
                return False
            if fmt.lead_tag and buf.startswith(fmt.lead_tag, j):
                return self._open_block(j, j + len(fmt.lead_tag))
            if fmt.bare and buf[j] == ("[" if fmt.array else "{"):
                return self._open_block(j, j)
            if fmt.lead_tag and fmt.lead_tag.startswith(buf[j:]) and not final:
                return False
            self._leading_done = True
        if fmt.marker is None:
            self._content(n)
            return False
        i = buf.find(fmt.marker, self._pos)
        if i >= 0:
            return self._open_block(i, i + len(fmt.marker))
        self._content(n if final else n - _partial_suffix(buf, fmt.marker, self._pos))
        return False

    def _content(self, end: int) -> None:
        """buf[pos:end] is content: out, but for its trailing whitespace."""
        text, self._pos = self._ws + self.buf[self._pos:end], max(self._pos, end)
        keep = len(text.rstrip())
        self._ws = text[keep:]
        if keep:
            self._delta.content += text[:keep]
            self.content += text[:keep]

    def _open_block(self, start: int, body: int) -> bool:
        self._content(start)
        self._in_block, self._leading_done = True, True
        self._block_body = body
        self._bstate = _B_ARRAY if self.fmt.array else _B_CALL
        self._bpos = self._last_end = body
        self._block_calls = 0
        return True

    def _close_block(self, resume: int) -> bool:
        """The block ends; the text from ``resume`` on is outside it again."""
        self._in_block, self._pos = False, resume
        return True

    def _reject_block(self) -> bool:
        """Not a block of calls after all: content again, from its first char (a marker
        is content; the text after it is searched for markers again)."""
        if self._block_calls:
            return self._close_block(self._last_end)
        self._content(self._block_body)
        return self._close_block(self._block_body)

    # -- inside a block: calls ----------------------------------------------------------------
    def _block(self, final: bool) -> bool:
        buf, fmt, n = self.buf, self.fmt, len(self.buf)
        while True:
            if self._bstate == _B_IN_CALL:
                more = self._call(final)
                if more is not None:
                    return more
                continue
            j = skip_ws(buf, self._bpos)
            if j == n:
                return self._reject_block() if final else False
            c, st = buf[j], self._bstate
            if st == _B_ARRAY and c == "[":
                self._bpos, self._bstate = j + 1, _B_CALL
            elif st == _B_ARRAY and fmt.args_marker and (c.isalnum() or c in "_-."):
                self._scan = ArgsCallScan(j, self._names, fmt.args_marker)
                self._named, self._bstate = False, _B_IN_CALL
            elif st == _B_CALL and c == "{":
                self._scan, self._named = CallScan(j, self._names), False
                self._bstate = _B_IN_CALL
            elif st == _B_AFTER and fmt.array and c == ",":
                self._bpos, self._bstate = j + 1, _B_CALL
            elif st == _B_AFTER and fmt.array and c == "]":
                self._bpos = self._last_end = j + 1
                self._bstate = _B_END
            elif st == _B_AFTER and not fmt.array and c == fmt.separator:
                self._bpos, self._bstate = j + 1, _B_CALL
            elif st == _B_AFTER and not fmt.array:
                self._bstate = _B_END
            elif st == _B_END and fmt.end and buf.startswith(fmt.end, j):
                return self._close_block(j + len(fmt.end))
            elif st == _B_END and fmt.end and fmt.end.startswith(buf[j:]) and not final:
                return False
            elif st == _B_END:
                return self._close_block(self._last_end)
            else:
                return self._reject_block()

    def _call(self, final: bool) -> bool | None:
        """Advance the current call; None to go on with the block, else ``_block``'s result."""
        scan, buf = self._scan, self.buf
        assert scan is not None
        scan.feed(buf)
        if final and scan.open:
            scan.truncate(buf)
        if scan.name is not None and not self._named:
            self._named = True
            self._block_calls += 1
            call = ToolCall(self._new_id(), scan.name)
            self.calls.append(call)
            self._delta.tool_calls.append({"index": len(self.calls) - 1, "id": call.id,
                                           "type": "function",
                                           "function": {"name": call.name, "arguments": ""}})
        if self._named:
            self._arguments(scan.args_text(buf))
        if scan.closed and self._named:
            self._end_call()
            self._bpos = self._last_end = scan.end
            # a name[ARGS] call is its block's one call (the next has its own marker)
            self._bstate = _B_END if isinstance(scan, ArgsCallScan) else _B_AFTER
            return None
        if scan.failed and self._named:
            self._end_call()
            return self._close_block(scan.failed_at)
        if scan.closed or scan.failed or final:
            if self._named:  # the text ended inside a named call
                self._end_call()
                return self._close_block(len(buf))
            return self._reject_block()
        return False  # wait for more text

    def _arguments(self, text: str) -> None:
        call = self.calls[-1]
        if len(text) > len(call.arguments):
            self._delta.add_arguments(len(self.calls) - 1, text[len(call.arguments):])
            call.arguments = text

    def _end_call(self) -> None:
        if not self.calls[-1].arguments:
            self._arguments("{}")


def _partial_suffix(buf: str, marker: str, start: int) -> int:
    """Length of the longest end of buf[start:] that a marker could still complete."""
    for k in range(min(len(marker) - 1, len(buf) - start), 0, -1):
        if buf.endswith(marker[:k]):
            return k
    return 0


class NamedCallStream:
    """``tool_choice`` naming a function: the whole output is that call's arguments (the
    structured-output engine holds it to the function's parameter schema)."""

    def __init__(self, name: str, new_id: Callable[[], str]) -> None:
        self.calls = [ToolCall(new_id(), name)]
        self.content = ""
        self._started = False

    def push(self, text: str) -> ParsedDelta:
        call, delta = self.calls[0], ParsedDelta()
        if not self._started:
            self._started = True
            delta.tool_calls.append({"index": 0, "id": call.id, "type": "function",
                                     "function": {"name": call.name, "arguments": ""}})
        if text:
            call.arguments += text
            delta.add_arguments(0, text)
        return delta

    def finish(self) -> ParsedDelta:
        return self.push("" if self.calls[0].arguments else "{}")


CallStream = ToolCallStream | NamedCallStream


def parse_tool_calls(fmt: CallFormat, text: str, names: Collection[str] | None = None,
                     new_id: Callable[[], str] | None = None) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole text: the stream fed all of it at once."""
    stream = ToolCallStream(fmt, names, new_id)
    stream.push(text)
    stream.finish()
    return stream.content, stream.calls


# -- choosing the format ------------------------------------------------------------------


def template_text(tokenizer: Any) -> str:
    """All of the tokenizer's chat templates as one text ('' when it has none)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    if isinstance(template, list):  # [{"name": ..., "template": ...}] in older configs
        return "\n".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return template if isinstance(template, str) else ""


def detect_format(template: str) -> tuple[CallFormat | None, str]:
    """The format a chat template's text makes clear, and why; (None, why) otherwise."""
    if "<tool_call>" in template:
        return HERMES, "the chat template mentions <tool_call>"
    if "[TOOL_CALLS]" in template:
        return MISTRAL, "the chat template mentions [TOOL_CALLS]"
    if "<|python_tag|>" in template:
        return LLAMA3_JSON, "the chat template mentions <|python_tag|>"
    return None, "the chat template shows no known tool call format"


def select_format(setting: str, tokenizer: Any) -> tuple[CallFormat | None, str]:
    """The ``--tool-call-parser`` setting as a format (None: no parsing), and why."""
    if setting == "none":
        return None, "--tool-call-parser none"
    if setting != "auto":
        return FORMATS[setting], f"--tool-call-parser {setting}"
    fmt, why = detect_format(template_text(tokenizer))
    return fmt, f"auto: {why}"


def keeps_special_tokens(fmt: CallFormat, tokenizer: Any) -> bool:
    """Whether a marker of the format is a special token of the tokenizer (Mistral's
    [TOOL_CALLS], Llama's <|python_tag|>), so the text must keep special tokens."""
    special = set(getattr(tokenizer, "all_special_tokens", None) or ())
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special |= {t.content for t in decoder.values() if getattr(t, "special", False)}
    return any(m in special for m in fmt.markers)
