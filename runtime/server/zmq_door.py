"""The ZeroMQ door of the server: radixflow's own protocol (runtime/protocol/messages.py) on a
ROUTER.

Frames are decoded into the same typed requests the HTTP door builds and handed to
`Server.handle` with the client's identity (bytes) as the reply address. A client with
requests in flight pings; one silent for CLIENT_TIMEOUT_S (crashed, killed) has its requests
aborted, so their KV is freed.
"""

from __future__ import annotations

import hmac
import logging
import time
from typing import Any

import zmq

from radixflow.runtime.protocol.codec import decode_with_key, encode
from radixflow.runtime.protocol.messages import (
    CLIENT_REQUESTS,
    CLIENT_TIMEOUT_S,
    ERROR_BAD_MESSAGE,
    ERROR_INVALID_REQUEST,
    ERROR_UNAUTHORIZED,
    Error,
    Ping,
    ProtocolError,
)
from radixflow.runtime.protocol.transport import client_router

log = logging.getLogger("radixflow.server")

MAX_FRAMES_PER_POLL = 512
CLIENT_CHECK_INTERVAL_S = 0.5


class ZmqDoor:
    def __init__(self, server: Any) -> None:
        self.server = server
        self.router: zmq.Socket | None = None
        self.last_seen: dict[bytes, float] = {}  # client identity -> last frame time
        self.last_check = 0.0

    def bind(self, ctx: zmq.Context, host: str, port: int) -> str:
        """Bind the ROUTER; returns its tcp:// address."""
        self.router, address = client_router(ctx, host, port)
        return address

    def pending(self) -> bool:
        """Frames waiting (ZMQ_EVENTS: the FD alone is edge-triggered)."""
        assert self.router is not None
        return bool(self.router.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def drain(self) -> None:
        assert self.router is not None
        for _ in range(MAX_FRAMES_PER_POLL):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.on_frames(frames[0], frames[1:])

    def on_frames(self, identity: bytes, parts: list[bytes]) -> None:
        server = self.server
        self.last_seen[identity] = time.monotonic()
        if len(parts) != 1:
            self.send(identity, Error("", ERROR_BAD_MESSAGE, f"{len(parts)} frames, expected 1"))
            return
        try:
            msg, key = decode_with_key(parts[0], CLIENT_REQUESTS, server.config.max_message_bytes)
        except ProtocolError as e:
            server.counters[f"error_{e.code}"] += 1
            log.info("protocol error from %s: %s", identity.hex(), e)
            self.send(identity, Error(e.rid, e.code, str(e)))
            return
        api_key = server.config.api_key
        if api_key and not hmac.compare_digest(key, api_key):
            server.counters[f"error_{ERROR_UNAUTHORIZED}"] += 1
            if not isinstance(msg, Ping):
                rid = getattr(msg, "rid", "")
                self.send(identity, Error(rid, ERROR_UNAUTHORIZED, "missing or wrong API key"))
            return
        if not isinstance(msg, Ping):
            server.counters[f"request_{msg.TAG}"] += 1
        name = getattr(msg, "model", None)
        if name is not None and name not in self.names():
            server.counters[f"error_{ERROR_INVALID_REQUEST}"] += 1
            served = server.model_info.get("model", "default")
            message = f"unknown model '{name}': this server serves '{served}'"
            self.send(identity, Error(msg.rid, ERROR_INVALID_REQUEST, message))
            return
        server.handle(identity, msg)

    def names(self) -> set[str]:
        """What a request's `model` may name here: the served name, the path, "default"."""
        info = self.server.model_info
        return {"", "default", info.get("model", "default"), info.get("model_path", "default")}

    def send(self, identity: bytes, reply: Any) -> None:
        assert self.router is not None
        try:
            self.router.send_multipart([identity, encode(reply)], zmq.NOBLOCK)
        except zmq.Again:
            log.warning("reply to %s dropped: its queue is full", identity.hex())

    def check_clients(self) -> None:
        """Abort the requests of clients silent for CLIENT_TIMEOUT_S (crashed, killed). Their
        final replies still go out: a client that was only frozen (SIGSTOP, a debugger) gets
        them when it resumes."""
        now = time.monotonic()
        if now - self.last_check < CLIENT_CHECK_INTERVAL_S:
            return
        self.last_check = now
        waiting = {job.identity for job in self.server.jobs.values()}
        for identity in list(self.last_seen):
            if identity not in waiting:
                del self.last_seen[identity]
            elif now - self.last_seen[identity] > CLIENT_TIMEOUT_S:
                del self.last_seen[identity]
                log.warning("client %s went silent; aborting its requests", identity.hex())
                self.server.counters["clients_timed_out"] += 1
                self.server.abort_identity(identity, "client disconnected")

    def close(self) -> None:
        if self.router is not None:
            self.router.close(linger=2000)  # deliver the final replies
