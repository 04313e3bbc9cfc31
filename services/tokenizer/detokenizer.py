"""Incremental detokenization with stop strings: token ids in, text deltas out.

Uses the tokenizers library's streaming decoder (``DecodeStream``), which buffers
tokens until they form valid UTF-8, so multi-byte characters split over tokens and
byte-fallback tokens come out whole. Stop strings are searched in the new text only
(plus a lookback of the longest stop string); while streaming, text that could still
become the start of a stop string is held back, so the deltas concatenated always
equal the final text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


@dataclass
class TextDelta:
    text: str  # new text, safe to show
    stop_string: str | None = None  # set when a stop string ended the text


def raw_tokenizer(tokenizer: object) -> Tokenizer:
    """The tokenizers.Tokenizer behind an HF fast tokenizer (or the object itself)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    inner = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if not isinstance(inner, Tokenizer):
        raise TypeError("a fast (tokenizers-backed) tokenizer is required for streaming decode")
    return inner


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: object,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = raw_tokenizer(tokenizer)
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stops = list(stop)
        self._include_stop = include_stop_str_in_output
        self._holdback = max((len(s) for s in self._stops), default=1) - 1
        self._text = ""  # everything decoded so far
        self._emitted = 0  # chars of _text already returned
        self._searched = 0  # chars of _text already searched for stop strings
        self.stopped: str | None = None

    @property
    def text(self) -> str:
        """The text returned so far (the final text once finished)."""
        return self._text[: self._emitted]

    def push(self, token_ids: Sequence[int]) -> TextDelta:
        if self.stopped is not None:
            return TextDelta("", self.stopped)
        for token_id in token_ids:
            chunk = self._stream.step(self._tokenizer, token_id)
            if chunk:
                self._text += chunk
        if self._stops:
            hit = self._find_stop()
            if hit is not None:
                return hit
            safe_end = max(self._emitted, len(self._text) - self._holdback)
        else:
            safe_end = len(self._text)
        delta = self._text[self._emitted : safe_end]
        self._emitted = safe_end
        return TextDelta(delta)

    def finish(self) -> TextDelta:
        """Releases the held-back tail when the request ends without a stop string."""
        if self.stopped is not None:
            return TextDelta("", self.stopped)
        delta = self._text[self._emitted :]
        self._emitted = len(self._text)
        return TextDelta(delta)

    def _find_stop(self) -> TextDelta | None:
        start = max(0, self._searched - self._holdback)
        self._searched = len(self._text)
        best: tuple[int, str] | None = None
        for stop in self._stops:
            idx = self._text.find(stop, start)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        end = idx + len(stop) if self._include_stop else idx
        self._text = self._text[:end]
        delta = self._text[self._emitted :] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        self.stopped = stop
        return TextDelta(delta, stop)
