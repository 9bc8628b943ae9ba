"""Stored responses of the OpenAI Responses door (responses_api.py): what `store: true` keeps so
that `GET /v1/responses/{id}` finds a response and `previous_response_id` continues its
conversation without the client re-sending it (torch-free, no I/O).

Bounded three ways, so clients cannot grow the server's memory: at most `max_entries`
responses and `max_bytes` of their JSON in all (the least recently used go first), and each
lives `ttl_s` seconds after it was stored. Lookups see an expired entry as gone.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_STORED_RESPONSES = 1024
MAX_STORED_BYTES = 64 << 20
STORED_TTL_S = 3600.0


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as answered
    context: list[dict[str, Any]]  # input items the model saw: earlier turns, then this input
    size: int  # bytes of JSON, counted against the store's budget
    expires: float  # on the store's clock

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """What a next turn continues: the context, then this response's output."""
        return self.context + self.response["output"]


class ResponseStore:
    """An LRU of stored responses by id, capped in entries and bytes, with a TTL. `clock` is
    monotonic seconds (a test passes its own)."""

    def __init__(
        self,
        max_entries: int = MAX_STORED_RESPONSES,
        max_bytes: int = MAX_STORED_BYTES,
        ttl_s: float = STORED_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert max_entries > 0 and max_bytes > 0 and ttl_s > 0, f"{max_entries=} {max_bytes=}"
        self.max_entries, self.max_bytes, self.ttl_s, self.clock = (
            max_entries,
            max_bytes,
            ttl_s,
            clock,
        )
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    def put(self, response: dict[str, Any], context: list[dict[str, Any]]) -> bool:
        """Store `response` (by its id) with its context, dropping expired entries and then the
        least recently used while over a cap; False (nothing stored) when it alone is larger
        than the byte cap."""
        size = len(json.dumps([response, context], ensure_ascii=False))
        if size > self.max_bytes:
            return False
        now = self.clock()
        for expired in [k for k, v in self.entries.items() if v.expires <= now]:
            self.delete(expired)
        self.delete(response["id"])
        stored = StoredResponse(response, context, size, now + self.ttl_s)
        self.entries[response["id"]] = stored
        self.bytes += size
        while len(self.entries) > self.max_entries or self.bytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response (now the most recently used), or None: never stored, deleted,
        evicted or expired."""
        stored = self.entries.get(response_id)
        if stored is None:
            return None
        if stored.expires <= self.clock():
            self.delete(response_id)
            return None
        self.entries.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        stored = self.entries.pop(response_id, None)
        if stored is not None:
            self.bytes -= stored.size
        return stored is not None
