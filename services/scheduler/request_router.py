"""Which frontend owns which request: the scheduler process's routing table.

Frontends choose their own request ids; the scheduler core needs ids unique across
frontends. Each request gets an internal id ``<frontend identity hex>/<request id>``,
and outputs go back to the owning frontend under the id it chose. Only the owner may
abort a request (an abort names ids, which are looked up in the sender's scope only).
"""

from __future__ import annotations

from collections import defaultdict

from shared.protocol import EngineOutput


def internal_id(identity: bytes, request_id: str) -> str:
    return f"{identity.hex()}/{request_id}"


class RequestRouter:
    def __init__(self) -> None:
        # internal id -> (frontend identity, the frontend's request id)
        self._owner: dict[str, tuple[bytes, str]] = {}
        self._by_frontend: dict[bytes, set[str]] = defaultdict(set)

    def __len__(self) -> int:
        return len(self._owner)

    def add(self, identity: bytes, request_id: str) -> str:
        iid = internal_id(identity, request_id)
        self._owner[iid] = (identity, request_id)
        self._by_frontend[identity].add(iid)
        return iid

    def owns(self, identity: bytes, request_id: str) -> bool:
        return internal_id(identity, request_id) in self._owner

    def requests_of(self, identity: bytes) -> list[str]:
        return sorted(self._by_frontend.get(identity, ()))

    def all_requests(self) -> list[str]:
        return list(self._owner)

    def owner(self, iid: str) -> tuple[bytes, str] | None:
        return self._owner.get(iid)

    def forget(self, iid: str) -> None:
        entry = self._owner.pop(iid, None)
        if entry is not None:
            ids = self._by_frontend[entry[0]]
            ids.discard(iid)
            if not ids:
                del self._by_frontend[entry[0]]

    def route(self, outputs: list[EngineOutput], finished: set[str]) -> dict[bytes, list[EngineOutput]]:
        """Group outputs by owning frontend, renamed to the frontend's ids.

        ``finished`` holds the internal ids whose every sample has ended: they are
        forgotten after routing.
        """
        by_frontend: dict[bytes, list[EngineOutput]] = defaultdict(list)
        for out in outputs:
            entry = self._owner.get(out.request_id)
            if entry is None:
                continue
            out.request_id = entry[1]
            by_frontend[entry[0]].append(out)
        for iid in finished:
            self.forget(iid)
        return by_frontend
