"""Server-sent events as the HTTP APIs stream them: one JSON object per event."""

from __future__ import annotations

import json
from typing import Any

DONE = "data: [DONE]\n\n"  # OpenAI's end of a stream


def sse(data: Any, event: str | None = None) -> str:
    """One event: ``data`` as compact JSON, under an ``event:`` name if given (the
    Responses and Anthropic APIs name their events; OpenAI's chat does not)."""
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
