"""One tool call, a JSON object, scanned as its text streams in (``tool_parsers.py``).

``CallScan`` parses only the object's top level: its keys, and where each value starts
and ends; nested values are followed by bracket depth and strings. It is resumable
anywhere (mid-string, mid-escape), so scanning a call costs time linear in its length
however the text is split, and regexes skip over the runs of ordinary characters.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection

_STRING_STOP = re.compile(r'["\\]')  # inside a JSON string
_NESTED_STOP = re.compile(r'["{}\[\]]')  # inside a nested value, outside strings
_SCALAR_END = re.compile(r'[\s,}\]]')  # a top-level number / true / false / null ends here
_WS = " \t\r\n"
ARGUMENT_KEYS = ("arguments", "parameters")


def skip_ws(buf: str, i: int) -> int:
    n = len(buf)
    while i < n and buf[i] in _WS:
        i += 1
    return i


def _string_end(buf: str, i: int) -> tuple[int, int]:
    """(index after the closing quote of the string whose body starts at ``i``, or -1
    while it is incomplete; where to resume then: never inside an escape)."""
    while (m := _STRING_STOP.search(buf, i)) is not None:
        if m.group() == '"':
            return m.end(), m.end()
        if m.end() >= len(buf):
            return -1, m.start()
        i = m.end() + 1
    return -1, len(buf)


# CallScan states: where the scan is inside the call object
_KEY_OR_CLOSE, _KEY_NEXT, _KEY, _COLON, _VALUE, _VSTRING, _VNESTED, _VSCALAR, _AFTER = range(9)
_CLOSED, _FAILED = 9, 10


class CallScan:
    """One call object scanned over a growing buffer, from its ``{`` at ``start``.

    Only the top level is parsed (keys, where each value starts and ends); nested values
    are tracked by bracket depth and strings. ``name`` is set once the ``name`` value is
    a complete string naming an allowed tool; ``args_start``/``args_end`` delimit the
    arguments value (``args_end`` -1 while it is open).
    """

    def __init__(self, start: int, names: Collection[str] | None) -> None:
        self.start = start
        self.pos = start + 1  # next char to scan
        self.state = _KEY_OR_CLOSE
        self._names = names
        self._mark = 0  # where the current key or value starts
        self._key: str | None = None
        self._depth = 0  # brackets open inside a nested value
        self._in_string = False  # inside a string of a nested value
        self.name: str | None = None
        self.args_start = -1
        self.args_end = -1
        self.end = -1  # index after the closing brace
        self.failed_at = -1  # index of the char that is not a call's

    @property
    def closed(self) -> bool:
        return self.state == _CLOSED

    @property
    def failed(self) -> bool:
        return self.state == _FAILED

    @property
    def open(self) -> bool:
        """Neither closed nor failed: the object may go on."""
        return self.state < _CLOSED

    def args_text(self, buf: str) -> str:
        """The arguments text so far (a scalar only once complete)."""
        if self.args_start < 0:
            return ""
        if self.args_end >= 0:
            return buf[self.args_start:self.args_end]
        return buf[self.args_start:self.pos] if self.state in (_VSTRING, _VNESTED) else ""

    def truncate(self, buf: str) -> None:
        """The text ended inside the object: a pending scalar ends at the end."""
        if self.state == _VSCALAR:
            self._value_done(buf, len(buf))

    def feed(self, buf: str) -> None:
        """Scan what ``buf`` (which only grows) holds past ``pos``."""
        n = len(buf)
        while self.pos < n and self.state < _CLOSED:
            i, st = self.pos, self.state
            if st in (_KEY_OR_CLOSE, _KEY_NEXT, _COLON, _VALUE, _AFTER):
                i = skip_ws(buf, i)
                if i == n:
                    self.pos = i
                    return
            c = buf[i]
            if st in (_KEY_OR_CLOSE, _KEY_NEXT):
                if c == '"':
                    self._mark, self.state, i = i, _KEY, i + 1
                elif c == "}" and st == _KEY_OR_CLOSE:
                    self.end, self.state, i = i + 1, _CLOSED, i + 1
                else:
                    self._fail(i)
            elif st in (_KEY, _VSTRING):
                end, resume = _string_end(buf, i)
                if end < 0:
                    self.pos = resume
                    return
                i = end
                if st == _KEY:
                    try:
                        key = json.loads(buf[self._mark:end])
                    except ValueError:
                        self._fail(self._mark)
                        continue
                    self._key, self.state = key, _COLON
                else:
                    self._value_done(buf, end)
            elif st == _COLON:
                if c == ":":
                    self.state, i = _VALUE, i + 1
                else:
                    self._fail(i)
            elif st == _VALUE:
                i = self._value_start(c, i)
            elif st == _VNESTED:
                i = self._nested(buf, i)
            elif st == _VSCALAR:
                m = _SCALAR_END.search(buf, i)
                if m is None:
                    i = n
                else:
                    i = m.start()
                    self._value_done(buf, i)
            else:  # _AFTER
                if c == ",":
                    self.state, i = _KEY_NEXT, i + 1
                elif c == "}":
                    self.end, self.state, i = i + 1, _CLOSED, i + 1
                else:
                    self._fail(i)
            if self.state == _FAILED or (i == self.pos and self.state == st):
                return  # failed, or waiting for the rest of an escape
            self.pos = i

    def _value_start(self, c: str, i: int) -> int:
        self._mark = i
        if self._key in ARGUMENT_KEYS and self.args_start < 0:
            self.args_start = i
        if c == '"':
            self.state = _VSTRING
        elif c in "{[":
            self.state, self._depth, self._in_string = _VNESTED, 1, False
        elif c in "}],:":
            self._fail(i)
            return i
        else:
            self.state = _VSCALAR
            return i
        return i + 1

    def _nested(self, buf: str, i: int) -> int:
        n = len(buf)
        while i < n:
            if self._in_string:
                end, resume = _string_end(buf, i)
                if end < 0:
                    return resume
                i, self._in_string = end, False
                continue
            m = _NESTED_STOP.search(buf, i)
            if m is None:
                return n
            c, i = m.group(), m.end()
            if c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth == 0:
                    self._value_done(buf, i)
                    return i
        return i

    def _value_done(self, buf: str, end: int) -> None:
        self.state = _AFTER
        key, raw = self._key, buf[self._mark:end]
        if key == "name" and self.name is None:
            try:
                name = json.loads(raw) if raw.startswith('"') else None
            except ValueError:
                name = None
            if not isinstance(name, str) or not name or (
                    self._names is not None and name not in self._names):
                self._fail(self._mark)
                return
            self.name = name
        elif key in ARGUMENT_KEYS and self.args_start == self._mark:
            self.args_end = end

    def _fail(self, i: int) -> None:
        self.state, self.failed_at = _FAILED, i


_NAME_CHARS = re.compile(r"[A-Za-z0-9_.-]*")
MAX_NAME_CHARS = 64  # OpenAI's limit on function names


class ArgsCallScan(CallScan):
    """Mistral's newer calls (tokenizers v11 and later): ``name[ARGS]{...}``, from the
    name's first char at ``start``; the name ends at ``marker``, the arguments are the
    JSON value after it, and the call ends with that value."""

    def __init__(self, start: int, names: Collection[str] | None, marker: str) -> None:
        super().__init__(start, names)
        self.pos = start
        self._marker = marker
        self._naming = True

    def feed(self, buf: str) -> None:
        if self._naming and not self._feed_name(buf):
            return
        super().feed(buf)

    def _feed_name(self, buf: str) -> bool:
        """True once the name and its marker are complete (or failed)."""
        m = _NAME_CHARS.match(buf, self.start)
        end, marker = m.end(), self._marker
        if end - self.start > MAX_NAME_CHARS:
            self._fail(self.start)
            return False
        if end == len(buf) or (marker.startswith(buf[end:]) and not buf.startswith(marker, end)):
            return False  # the name or the marker goes on
        name = buf[self.start:end]
        if not buf.startswith(marker, end) or not name or (
                self._names is not None and name not in self._names):
            self._fail(self.start if buf.startswith(marker, end) else end)
            return False
        self.name, self._naming = name, False
        self._key, self.state, self.pos = ARGUMENT_KEYS[0], _VALUE, end + len(marker)
        return True

    def _value_done(self, buf: str, end: int) -> None:
        super()._value_done(buf, end)
        if self.state == _AFTER:  # the arguments were the call's one value
            self.end, self.state = end, _CLOSED
