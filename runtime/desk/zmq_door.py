"""The desk's ZeroMQ front door: radixflow's own protocol (runtime/protocol/messages.py) on a
ROUTER, each request sent on to the ZeroMQ door of the model its `model` field names (none:
the first), which is loaded first if it is not, through the desk's own accounting
(`Desk.acquire` / `Desk.release`, as the HTTP door does): a model is not unloaded while a
request on it runs here. Every reply frame (stream chunks included) goes back to the client
it answers.

Each client gets a DEALER of its own towards each model it uses (a `Link`), so a model's
server sees every client apart, as if it were connected directly: its rids, its aborts, its
pings (passed on), its silence (a client that stops pinging has its requests aborted by the
model's server after CLIENT_TIMEOUT_S). The API key is checked here, as the single server's
door checks it, and passed on. `status` is answered here from the desk's own table (a
request waiting for its model to load is in flight); `abort` follows its target to its model.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from radixflow.runtime.config import ServerConfig
from radixflow.runtime.desk.children import Child
from radixflow.runtime.desk.desk import Desk, Slot
from radixflow.runtime.protocol.codec import decode, decode_with_key, encode
from radixflow.runtime.protocol.messages import (
    CLIENT_REPLIES,
    CLIENT_REQUESTS,
    CLIENT_TIMEOUT_S,
    ERROR_BAD_MESSAGE,
    ERROR_DUPLICATE_RID,
    ERROR_FAILED,
    ERROR_INVALID_REQUEST,
    ERROR_SHUTDOWN,
    ERROR_UNAUTHORIZED,
    ERROR_UNAVAILABLE,
    Abort,
    Chunk,
    Error,
    Ping,
    ProtocolError,
    Result,
    Status,
)
from radixflow.runtime.protocol.transport import client_router
from radixflow.runtime.server.http_request import HttpError

log = logging.getLogger("radixflow.desk")
SWEEP_EVERY_S = 0.5
PASSED_CODES = (ERROR_SHUTDOWN, ERROR_UNAVAILABLE)  # an HttpError code kept as the error's


class Link:
    """One client's DEALER towards one loaded model's ZeroMQ door; its replies go back."""

    def __init__(self, door: DeskZmqDoor, identity: bytes, slot: Slot, child: Child) -> None:
        self.identity, self.slot, self.child = identity, slot, child
        self.socket = door.ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 100_000)
        self.socket.connect(child.zmq)
        self.pump = asyncio.create_task(self.relay(door))

    async def relay(self, door: DeskZmqDoor) -> None:
        while True:
            frame = await self.socket.recv()
            try:
                door.on_reply(self, frame)
            except Exception:  # one bad frame must not stop the link
                log.exception("relaying a reply of %s", self.slot.name)

    def send(self, frame: bytes) -> None:
        settle(self.socket.send(frame))

    def close(self) -> None:
        self.pump.cancel()
        self.socket.close(linger=0)


@dataclass(eq=False)
class Flight:
    """A request of a client in flight at the desk: waiting for its model (`link` None), then
    sent on, until its final reply."""

    slot: Slot
    since: float
    link: Link | None = None
    aborts: list[str] = field(default_factory=list)  # abort rids that came while it waited
    task: asyncio.Task[None] | None = None


class DeskZmqDoor:
    def __init__(self, desk: Desk, config: ServerConfig) -> None:
        self.desk, self.config = desk, config
        self.ctx = zmq.asyncio.Context()
        self.router: Any = None
        self.links: dict[tuple[bytes, str], Link] = {}  # (client identity, model) -> link
        self.flights: dict[tuple[bytes, str], Flight] = {}  # (client identity, rid) -> flight
        self.last_seen: dict[bytes, float] = {}
        self.tasks: list[asyncio.Task[None]] = []

    def start(self, host: str, port: int) -> str:
        """Bind the ROUTER and serve it; returns its tcp:// address."""
        self.router, address = client_router(self.ctx, host, port)
        self.tasks = [asyncio.create_task(self.serve()), asyncio.create_task(self.sweep())]
        return address

    def stop(self) -> None:
        """After the desk drained: the final replies were relayed; close everything."""
        for task in self.tasks:
            task.cancel()
        for flight in self.flights.values():
            if flight.task is not None:
                flight.task.cancel()
        for link in self.links.values():
            link.close()
        if self.router is not None:
            self.router.close(linger=1000)
        self.ctx.term()

    async def serve(self) -> None:
        assert self.router is not None
        while True:
            frames = await self.router.recv_multipart()
            try:
                self.on_frames(frames[0], frames[1:])
            except Exception:
                log.exception("a ZeroMQ request from %s", frames[0].hex())

    # ---- client -> model -----------------------------------------------------------------

    def on_frames(self, identity: bytes, parts: list[bytes]) -> None:
        self.last_seen[identity] = time.monotonic()
        if len(parts) != 1:
            self.send(identity, Error("", ERROR_BAD_MESSAGE, f"{len(parts)} frames, expected 1"))
            return
        try:
            msg, key = decode_with_key(parts[0], CLIENT_REQUESTS, self.config.max_message_bytes)
        except ProtocolError as e:
            log.info("protocol error from %s: %s", identity.hex(), e)
            self.send(identity, Error(e.rid, e.code, str(e)))
            return
        api_key = self.config.api_key
        if api_key and not hmac.compare_digest(key, api_key):
            if not isinstance(msg, Ping):
                rid = getattr(msg, "rid", "")
                self.send(identity, Error(rid, ERROR_UNAUTHORIZED, "missing or wrong API key"))
            return
        if isinstance(msg, Ping):  # the client is alive: so say to each model it uses
            for (client, _), link in self.links.items():
                if client == identity:
                    link.send(parts[0])
        elif isinstance(msg, Status):
            self.send(identity, self.status(identity, msg))
        elif isinstance(msg, Abort):
            self.abort(identity, msg, parts[0])
        else:
            self.request(identity, msg)

    def request(self, identity: bytes, msg: Any) -> None:
        slot = self.desk.find(msg.model)
        if slot is None:
            names = ", ".join(self.desk.slots)
            message = f"unknown model '{msg.model}': this desk serves {names}"
            self.send(identity, Error(msg.rid, ERROR_INVALID_REQUEST, message))
            return
        if (identity, msg.rid) in self.flights:
            message = f"request id {msg.rid!r} is already in flight"
            self.send(identity, Error(msg.rid, ERROR_DUPLICATE_RID, message))
            return
        flight = Flight(slot, time.monotonic())
        self.flights[(identity, msg.rid)] = flight
        flight.task = asyncio.create_task(self.forward(identity, msg, flight))

    async def forward(self, identity: bytes, msg: Any, flight: Flight) -> None:
        """Load the model if need be (counted in on it), then send the request on."""
        try:
            child = await self.desk.acquire(flight.slot)
        except HttpError as e:
            del self.flights[(identity, msg.rid)]
            code = e.code if e.code in PASSED_CODES else ERROR_FAILED
            if e.status == 503 and code == ERROR_FAILED:
                code = ERROR_UNAVAILABLE
            self.send(identity, Error(msg.rid, code, str(e)))
            for rid in flight.aborts:
                self.send(identity, Result(rid, {"aborted": False}))
            return
        link = self.link(identity, flight.slot, child)
        flight.link = link
        key = self.config.api_key
        link.send(encode(dataclasses.replace(msg, model=flight.slot.name), key))
        for rid in flight.aborts:  # after the request, on the same socket: in order
            link.send(encode(Abort(rid, msg.rid), key))

    def link(self, identity: bytes, slot: Slot, child: Child) -> Link:
        """The client's link to `child`, made on first use (or after the model reloaded)."""
        link = self.links.get((identity, slot.name))
        if link is None or link.child is not child:
            if link is not None:
                link.close()
            link = self.links[(identity, slot.name)] = Link(self, identity, slot, child)
        return link

    def abort(self, identity: bytes, msg: Abort, frame: bytes) -> None:
        """An abort goes where its target went; one that waits for its model's load goes
        right after it; an unknown target is not an error (as the single server)."""
        flight = self.flights.get((identity, msg.target_rid))
        if flight is None:
            self.send(identity, Result(msg.rid, {"aborted": False}))
        elif flight.link is None:
            flight.aborts.append(msg.rid)
        else:
            flight.link.send(frame)

    def status(self, identity: bytes, msg: Status) -> Result:
        """Where the client's requests stand at the desk: in flight (waiting for their model
        or sent to it, until their final reply) or unknown."""
        now = time.monotonic()
        states: dict[str, Any] = {}
        for rid in msg.target_rids:
            flight = self.flights.get((identity, rid))
            known = {"state": "in_flight", "seconds": now - flight.since} if flight else None
            states[rid] = known or {"state": "unknown"}
        running = sum(1 for f in self.flights.values() if f.link is not None)
        status = "shutting_down" if self.desk.draining else "ok"
        return Result(msg.rid, {"requests": states, "running_requests": running,
                                "waiting_requests": len(self.flights) - running,
                                "status": status})  # fmt: skip

    # ---- model -> client -----------------------------------------------------------------

    def on_reply(self, link: Link, frame: bytes) -> None:
        """Pass a reply on as it is; a final one counts its request out of its model."""
        try:
            reply = decode(frame, CLIENT_REPLIES, self.config.max_message_bytes)
        except ProtocolError as e:
            log.error("a bad reply from %s's server: %s", link.slot.name, e)
            return
        self.send_frame(link.identity, frame)
        if isinstance(reply, Chunk):
            return
        flight = self.flights.get((link.identity, reply.rid))
        if flight is not None and flight.link is link:
            del self.flights[(link.identity, reply.rid)]
            self.desk.release(flight.slot)

    def send(self, identity: bytes, reply: Any) -> None:
        self.send_frame(identity, encode(reply))

    def send_frame(self, identity: bytes, frame: bytes) -> None:
        assert self.router is not None
        settle(self.router.send_multipart([identity, frame], zmq.NOBLOCK))

    # ---- background ----------------------------------------------------------------------

    async def sweep(self) -> None:
        """Forever: fail the requests of a model whose server died; close links nobody uses
        (their client silent past CLIENT_TIMEOUT_S, or their model's server gone)."""
        while True:
            await asyncio.sleep(SWEEP_EVERY_S)
            for (identity, rid), flight in list(self.flights.items()):
                link = flight.link
                if link is not None and not link.child.alive():
                    del self.flights[(identity, rid)]
                    message = f"the server of model '{link.slot.name}' exited"
                    self.send(identity, Error(rid, ERROR_UNAVAILABLE, message))
                    self.desk.release(flight.slot)
            busy = {f.link for f in self.flights.values()}
            now = time.monotonic()
            for key, link in list(self.links.items()):
                silent = now - self.last_seen.get(link.identity, 0.0) > CLIENT_TIMEOUT_S
                if link not in busy and (silent or not link.child.alive()):
                    del self.links[key]
                    link.close()
            users = {identity for identity, _ in self.links} | {i for i, _ in self.flights}
            for identity in [i for i in self.last_seen if i not in users]:
                if now - self.last_seen[identity] > CLIENT_TIMEOUT_S:
                    del self.last_seen[identity]


def settle(sent: Any) -> None:
    """A send's future: its failure (a full queue) is logged, never raised."""

    def done(future: asyncio.Future[Any]) -> None:
        if not future.cancelled() and future.exception() is not None:
            log.warning("a ZeroMQ frame was dropped: %s", future.exception())

    with contextlib.suppress(AttributeError):
        sent.add_done_callback(done)
