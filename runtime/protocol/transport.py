"""Typed ZeroMQ sockets: PUSH/PULL queues of messages between the server and the scheduler,
and the address helpers both ends share (torch-free).

A queue carries one family of messages from `runtime/protocol/messages.py`; receiving anything else
raises ProtocolError. The server binds both ipc endpoints inside a private temp dir (removed
by `remove_ipc_dir` at shutdown) and the scheduler process connects, so a restarted scheduler
reconnects to the same addresses.
"""

from __future__ import annotations

import ipaddress
import shutil
import tempfile
from dataclasses import dataclass
from typing import Generic, TypeVar

import zmq

from radixflow.runtime.protocol.codec import decode, encode

M = TypeVar("M")
LOOPBACK_NAMES = ("localhost",)


class TransportError(RuntimeError):
    """A message could not be handed to the peer (no peer connected, queue full)."""


@dataclass(frozen=True)
class IpcAddresses:
    """The two ipc endpoints between server and scheduler, inside `directory`."""

    directory: str

    @property
    def to_scheduler(self) -> str:
        return f"ipc://{self.directory}/to_scheduler"

    @property
    def from_scheduler(self) -> str:
        return f"ipc://{self.directory}/from_scheduler"


def make_ipc_dir() -> IpcAddresses:
    """A fresh private dir (mode 0700) for the ipc sockets."""
    return IpcAddresses(tempfile.mkdtemp(prefix="radixflow-"))


def remove_ipc_dir(addresses: IpcAddresses) -> None:
    shutil.rmtree(addresses.directory, ignore_errors=True)


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: treat as public


class PushQueue(Generic[M]):
    """Sends messages; `put` never blocks (unbounded queue, like SGLang's HWM 0)."""

    def __init__(self, ctx: zmq.Context, address: str, bind: bool) -> None:
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.LINGER, 1000)
        (self.socket.bind if bind else self.socket.connect)(address)

    def put(self, message: M) -> None:
        """Raises TransportError when no peer is connected to take it."""
        try:
            self.socket.send(encode(message), zmq.NOBLOCK)
        except zmq.Again as e:
            raise TransportError(f"no peer takes {type(message).__name__}") from e

    def close(self) -> None:
        self.socket.close()


class PullQueue(Generic[M]):
    """Receives messages of `family`; `drain` returns everything waiting."""

    def __init__(
        self, ctx: zmq.Context, address: str, bind: bool, family: tuple[type[M], ...]
    ) -> None:
        self.family = family
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.LINGER, 0)
        (self.socket.bind if bind else self.socket.connect)(address)

    def get(self, timeout_ms: int) -> M | None:
        """The next message, waiting at most `timeout_ms` (None when nothing came)."""
        if not self.socket.poll(timeout_ms):
            return None
        return decode(self.socket.recv(), self.family)

    def drain(self, timeout_ms: int = 0) -> list[M]:
        """Everything queued; waits up to `timeout_ms` for the first message."""
        first = self.get(timeout_ms)
        if first is None:
            return []
        out = [first]
        while True:
            try:
                frame = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            out.append(decode(frame, self.family))

    def close(self) -> None:
        self.socket.close()


def client_router(ctx: zmq.Context, host: str, port: int) -> tuple[zmq.Socket, str]:
    """The server's client-facing ROUTER socket, bound; returns it and its tcp address.

    Vanished clients are found by the protocol's pings (ROUTER_NOTIFY is a draft option that
    stock libzmq builds lack); ZMTP heartbeats drop dead TCP connections."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10000)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.LINGER, 2000)
    literal = f"[{host}]" if ":" in host else host
    if port == 0:
        port = sock.bind_to_random_port(f"tcp://{literal}")
    else:
        sock.bind(f"tcp://{literal}:{port}")
    return sock, f"tcp://{literal}:{port}"
