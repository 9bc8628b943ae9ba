"""Where the server's replies to one HTTP request wait for its handler (runtime/server/http_api.py):
a Sink per request, its chunks merged while the handler is busy."""

from __future__ import annotations

import asyncio
from typing import Any

from radixflow.runtime.protocol.messages import Chunk


class Sink:
    """The reply identity of one request from an HTTP handler (http_api.py's docstring): at
    most one pending chunk, the later ones merged into it, and the final reply."""

    def __init__(self, rid: str, wake: asyncio.Event) -> None:
        self.rid = rid
        self.wake = wake  # shared by the sinks of one handler
        self.chunk: Chunk | None = None
        self.final: Any = None

    def deliver(self, reply: Any) -> None:
        if isinstance(reply, Chunk):
            self.chunk = reply if self.chunk is None else merge_chunks(self.chunk, reply)
        elif self.final is None:
            self.final = reply
        self.wake.set()

    def take_chunk(self) -> Chunk | None:
        chunk, self.chunk = self.chunk, None
        return chunk


def merge_chunks(old: Chunk, new: Chunk) -> Chunk:
    """Two consecutive chunks as one: the newer text and meta, the ids and logprobs of both."""
    meta = dict(new.meta_info)
    for key in ("output_token_logprobs", "output_top_logprobs"):
        if key in meta:
            meta[key] = list(old.meta_info.get(key, [])) + list(meta[key])
    return Chunk(new.rid, new.text, old.new_ids + new.new_ids, meta)
