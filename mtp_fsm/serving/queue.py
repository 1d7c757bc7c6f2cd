"""RequestQueue: the FCFS line of requests submitted but not yet admitted to the engine."""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator

from ..engine.plan import NewRequest
from ..errors import DuplicateRequestError


class RequestQueue:
    """First come, first served; a queued request can be withdrawn (client abort) in O(1).

    Request ids are unique within the queue: a second submit with a queued id is a
    client bug, rejected before it can shadow the first request.
    """

    def __init__(self) -> None:
        self._items: OrderedDict[str, NewRequest] = OrderedDict()

    def submit(self, request: NewRequest) -> None:
        rid = request.request_id
        if rid in self._items:
            position = list(self._items).index(rid)
            raise DuplicateRequestError(
                rid, f"already queued at position {position}; request ids must be unique", state="queued"
            )
        self._items[rid] = request

    def abort(self, request_id: str) -> NewRequest | None:
        """Withdraw a queued request; None when it is not queued (admitted, finished, unknown)."""
        return self._items.pop(request_id, None)

    def peek(self) -> NewRequest | None:
        return next(iter(self._items.values()), None)

    def pop(self) -> NewRequest:
        if not self._items:
            raise IndexError("pop from an empty request queue")
        return self._items.popitem(last=False)[1]

    def position(self, request_id: str) -> int | None:
        """0-based place in line, or None when not queued (linear: for diagnostics only)."""
        for i, rid in enumerate(self._items):
            if rid == request_id:
                return i
        return None

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._items

    def __iter__(self) -> Iterator[NewRequest]:
        return iter(list(self._items.values()))

    def __repr__(self) -> str:
        return f"RequestQueue({list(self._items)!r})"
