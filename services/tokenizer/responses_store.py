"""The Responses API's memory: finished responses kept for ``GET /v1/responses/{id}``
and ``previous_response_id``, bounded in number and age.

One ``ResponsesStore`` per HTTP app (so per frontend process: a response stored by one
frontend is unknown to the others, as in vLLM). Each entry holds the response body as
it was sent and the conversation it ended, as chat turns without its ``instructions``
(OpenAI does not carry instructions over to a continuation): the history it continued,
its input, its output. Entries leave oldest first when there are more than
``max_stored``, and after ``ttl_s`` seconds whether read or not; a lookup of either is
None, which the API answers with 404.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.tokenizer.input_processor import ChatTurn


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object, as the client got it
    conversation: tuple[ChatTurn, ...]  # history + input + output, no instructions


class ResponsesStore:
    """Stored responses by id; at most ``max_stored`` (0: nothing is kept), each for
    ``ttl_s`` seconds after it was put.

    Invariant: ``_entries`` is in insertion order, which is also expiry order (one TTL
    for all), so both evictions only ever look at its front.
    """

    def __init__(self, max_stored: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_stored < 0 or not ttl_s > 0:
            raise ValueError(f"max_stored must be >= 0 and ttl_s > 0, got {max_stored}, {ttl_s}")
        self.max_stored, self.ttl_s = max_stored, ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.max_stored == 0:
            return
        self._entries.pop(response_id, None)
        self._entries[response_id] = (self._clock() + self.ttl_s, entry)
        while len(self._entries) > self.max_stored:
            self._entries.popitem(last=False)
        self._expire()

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        found = self._entries.get(response_id)
        return None if found is None else found[1]

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._entries.pop(response_id, None) is not None

    def _expire(self) -> None:
        now = self._clock()
        while self._entries:
            expires, _ = next(iter(self._entries.values()))
            if expires > now:
                return
            self._entries.popitem(last=False)
