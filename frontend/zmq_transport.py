"""The ZeroMQ transport (`RuntimeEndpoint("tcp://...")`): radixflow's own wire protocol,
specified in `radixflow.runtime.protocol.messages`. No torch here.

One transport is shared by many program threads: a background I/O thread owns the DEALER
socket, callers hand it frames through a queue (and a wake-up pipe) and wait on a
per-request reply queue. The I/O thread pings the server while requests are in flight (the
server aborts requests of silent clients) and watches the connection: when it drops, every
waiting call fails at once with RuntimeEndpointError, and no call waits past its timeout.
Calls the scheduler serves (generate, score, cache_prefix, flush) are also watched through the
server's `status` message (`Liveness`): a request the server no longer knows, or a server that
stops answering, fails the call even without a timeout, and a long wait is logged with why.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import os
import queue
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import zmq
import zmq.utils.monitor

from radixflow.runtime.protocol.codec import decode, encode
from radixflow.runtime.protocol.messages import (
    CLIENT_REPLIES,
    ERROR_DISCONNECTED,
    ERROR_FAILED,
    ERROR_INVALID_REQUEST,
    ERROR_TIMEOUT,
    PING_INTERVAL_S,
    Abort,
    CachePrefix,
    Chunk,
    Error,
    FlushCache,
    Generate,
    Health,
    ModelInfo,
    Ping,
    ProtocolError,
    Score,
    Stats,
    Status,
)
from radixflow.transport import (
    DEFAULT_LIVENESS,
    GenerateRequest,
    Liveness,
    RuntimeEndpointError,
)

CONNECT_TIMEOUT_S = 10.0  # longest wait for the first connection before a call fails
log = logging.getLogger("radixflow")


class ZmqTransport:
    """`Transport` over a DEALER socket: each call is one message and its reply (see
    `Transport` for what blocks and raises). `model` names the model of a server of several
    (the desk) in every request; None: the server's own (a desk's first)."""

    def __init__(
        self,
        address: str,
        api_key: str,
        liveness: Liveness = DEFAULT_LIVENESS,
        model: str | None = None,
    ) -> None:
        self.address, self.model = address, model
        self.connection = Connection(address, api_key, liveness)

    def generate(
        self, request: GenerateRequest, timeout: float
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """One result; a list of n for sampling n > 1, sent as n requests back to back (the
        protocol's way): the scheduler prefills their prompt once, for the first admitted, and
        the others find it in the radix tree (or wait a step for it)."""
        samples = _samples(request)
        if len(samples) == 1:
            msg = _generate_message(request, stream=False, model=self.model)
            return self._call(msg, timeout, abort=True)
        msgs = [_generate_message(s, stream=False, model=self.model) for s in samples]
        waiters = [self.connection.submit(msg, timeout, watch=True) for msg in msgs]
        done = 0
        try:
            results = []
            for msg, waiter in zip(msgs, waiters):
                results.append(_result(self._next(waiter, msg.rid, timeout)))
                done += 1
            return results
        finally:
            for msg in msgs[done:]:  # a sample failed or timed out: drop the others
                self.connection.forget(msg.rid)
                self._send_abort(msg.rid)

    def generate_stream(self, request: GenerateRequest, timeout: float) -> Iterator[dict[str, Any]]:
        msg = _generate_message(request, stream=True, model=self.model)
        waiter = self.connection.submit(msg, timeout, watch=True)
        output_ids: list[int] = []
        num_logprobs = 0
        finished = False
        try:
            reply = self._next(waiter, msg.rid, timeout)
            while isinstance(reply, Chunk):
                output_ids += reply.new_ids
                num_logprobs += len(reply.meta_info.get("output_token_logprobs", ()))
                yield {
                    "text": reply.text,
                    "output_ids": list(output_ids),
                    "meta_info": reply.meta_info,
                    "finished": False,
                }
                reply = self._next(waiter, msg.rid, timeout)
            finished = True
            yield _last_chunk(_result(reply), num_logprobs)
        finally:
            if not finished:
                self.connection.forget(msg.rid)
                self._send_abort(msg.rid)

    def score(
        self, prefix: str, continuations: list[str], unconditional: bool, timeout: float
    ) -> list[dict[str, Any]]:
        msg = Score(_new_rid(), prefix, continuations, unconditional, model=self.model)
        return self._call(msg, timeout, abort=True)["choices"]

    def cache_prefix(self, text: str, timeout: float) -> dict[str, Any]:
        return self._call(CachePrefix(_new_rid(), text, self.model), timeout, abort=True)[
            "meta_info"
        ]

    def concatenate_and_append(self, src_rids: list[str], dst_rid: str, timeout: float) -> None:
        """Nothing to do: the radix cache already holds every branch."""

    def abort(self, rid: str, timeout: float) -> bool:
        return self._call(Abort(_new_rid(), rid), timeout)["aborted"]

    def flush_cache(self, timeout: float) -> bool:
        return self._call(FlushCache(_new_rid(), self.model), timeout, watch=True)["flushed"]

    def model_info(self, timeout: float) -> dict[str, Any]:
        return self._call(ModelInfo(_new_rid(), self.model), timeout)

    def stats(self, timeout: float) -> dict[str, Any]:
        return self._call(Stats(_new_rid(), self.model), timeout)

    def health(self, timeout: float) -> dict[str, Any]:
        return self._call(Health(_new_rid(), self.model), timeout)

    def server_info(self, timeout: float) -> dict[str, Any]:
        """The model info and the stats in one dict."""
        return {**self.model_info(timeout), **self.stats(timeout)}

    def close(self) -> None:
        self.connection.close()

    def _call(self, msg: Any, timeout: float, abort: bool = False, watch: bool = False) -> Any:
        """Send msg, wait for its one reply; a timed-out call is aborted when `abort`. The
        scheduler's work (`abort` or `watch`) is watched by status queries."""
        waiter = self.connection.submit(msg, timeout, watch=abort or watch)
        try:
            return _result(self._next(waiter, msg.rid, timeout))
        except RuntimeEndpointError as e:
            if e.code == ERROR_TIMEOUT and abort:
                self._send_abort(msg.rid)
            raise

    def _next(self, waiter: Waiter, rid: str, timeout: float) -> Any:
        try:
            return waiter.replies.get(timeout=None if math.isinf(timeout) else timeout)
        except queue.Empty:
            self.connection.forget(rid)
            raise RuntimeEndpointError(
                f"no reply from the server at {self.address} within {timeout:.1f}s",
                ERROR_TIMEOUT,
            ) from None

    def _send_abort(self, rid: str) -> None:
        if not self.connection.closed and self.connection.connected.is_set():
            self.connection.send(Abort(_new_rid(), rid))  # its reply is dropped


def _samples(request: GenerateRequest) -> list[GenerateRequest]:
    """The n requests of sampling n (seeds counted up, as the server's doors do for n)."""
    params = request.sampling_params
    num = params.get("n", 1)
    if num == 1:
        return [request]
    if type(num) is not int or not 1 <= num <= 64:
        raise RuntimeEndpointError(f"invalid sampling parameter n={num!r}", ERROR_INVALID_REQUEST)
    samples = []
    for j in range(num):
        one = {**params, "n": 1}
        if type(one.get("seed")) is int:
            one["seed"] += j  # n equal seeds would give n equal samples
        rid = None if request.rid is None else f"{request.rid}-{j}"
        samples.append(dataclasses.replace(request, sampling_params=one, rid=rid))
    return samples


def _generate_message(request: GenerateRequest, stream: bool, model: str | None) -> Generate:
    return Generate(
        request.rid or _new_rid(),
        text=request.text,
        input_ids=request.input_ids,
        sampling_params=dict(request.sampling_params),
        stream=stream,
        return_logprob=request.return_logprob,
        logprob_start_len=request.logprob_start_len,
        top_logprobs_num=request.top_logprobs_num,
        lora_path=request.lora_path,
        image_data=list(request.image_data) if request.image_data else None,
        model=model,
    )


def _last_chunk(data: dict[str, Any], num_logprobs: int) -> dict[str, Any]:
    """A stream's final item from the full result: logprobs of the tokens not yet sent."""
    meta = dict(data["meta_info"])
    for key in ("output_token_logprobs", "output_top_logprobs"):
        if meta.get(key) is not None:
            meta[key] = meta[key][num_logprobs:]
    return {**data, "meta_info": meta, "finished": True}


def _result(reply: Any) -> Any:
    if isinstance(reply, Error):
        raise RuntimeEndpointError(f"[{reply.code}] {reply.message}", reply.code)
    return reply.data


def _new_rid() -> str:
    return uuid.uuid4().hex


class Waiter:
    """One request's reply queue: chunks, then one final reply (or a failure). A watched one
    is named in status queries once its frame went out (`sent`, set by the I/O thread)."""

    def __init__(self, watch: bool) -> None:
        self.replies: queue.Queue[Any] = queue.Queue()
        self.watch, self.sent = watch, False
        self.since = self.logged = time.monotonic()


class Connection:
    """The I/O thread: owns the DEALER socket, routes replies to waiters by rid."""

    def __init__(self, address: str, api_key: str, liveness: Liveness) -> None:
        self.address, self.api_key, self.liveness = address, api_key, liveness
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)  # the I/O thread must never block in send
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        self.socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10000)
        events = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
        self.monitor = self.socket.get_monitor_socket(events)
        self.socket.connect(address)
        self.outbox: collections.deque[tuple[bytes, str]] = collections.deque()  # frame, rid
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_write, False)
        self.waiters: dict[str, Waiter] = {}
        self.lock = threading.Lock()
        self.connected = threading.Event()
        self.closed = False
        self.status_rid = ""  # the status query waiting for its answer, if any
        self.status_at = 0.0  # when it went out, or when the last one was answered
        self.thread = threading.Thread(target=self._run, name="radixflow-endpoint", daemon=True)
        self.thread.start()

    # ---- called from any thread -----------------------------------------------------------

    def submit(self, message: Any, timeout: float, watch: bool = False) -> Waiter:
        """Register a waiter for message.rid and send it; a `watch`ed one is followed by status
        queries. Raises RuntimeEndpointError."""
        if not self.connected.wait(min(timeout, CONNECT_TIMEOUT_S)):
            raise RuntimeEndpointError(
                f"cannot reach a radixflow server at {self.address} (no connection after "
                f"{min(timeout, CONNECT_TIMEOUT_S):.0f}s)",
                ERROR_DISCONNECTED,
            )
        waiter = Waiter(watch)
        with self.lock:
            if self.closed:
                raise RuntimeEndpointError("the endpoint is closed")
            self.waiters[message.rid] = waiter
        self.send(message)
        return waiter

    def send(self, message: Any) -> None:
        """Queue a frame for the I/O thread (no reply expected or already registered)."""
        self.outbox.append((encode(message, self.api_key), getattr(message, "rid", "")))
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # the pipe is full of wake-ups already
            os.write(self.wake_write, b"x")

    def forget(self, rid: str) -> None:
        with self.lock:
            self.waiters.pop(rid, None)

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        self._wake()
        self.thread.join(5.0)
        self._fail_all("the endpoint is closed", "client")
        self.ctx.destroy(linger=0)
        os.close(self.wake_read)
        os.close(self.wake_write)

    # ---- the I/O thread -------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        poller.register(self.wake_read, zmq.POLLIN)
        last_ping = 0.0
        while not self.closed:
            wait_s = min(PING_INTERVAL_S / 2, self.liveness.interval_s)
            ready = dict(poller.poll(int(wait_s * 1000)))
            if self.wake_read in ready:
                os.read(self.wake_read, 4096)
            while self.outbox:
                frame, rid = self.outbox.popleft()
                self.socket.send(frame)
                with self.lock:
                    if rid in self.waiters:
                        self.waiters[rid].sent = True
            if self.socket in ready:
                self._receive()
            if self.monitor in ready:
                self._on_monitor(zmq.utils.monitor.recv_monitor_message(self.monitor))
            if self.waiters and time.monotonic() - last_ping >= PING_INTERVAL_S:
                self.socket.send(encode(Ping(), self.api_key))
                last_ping = time.monotonic()
            if self.waiters and self.connected.is_set():
                self._watch(time.monotonic())

    def _receive(self) -> None:
        while True:
            try:
                frame = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = decode(frame, CLIENT_REPLIES)
            except ProtocolError as e:
                reply = Error(e.rid, e.code, f"unreadable reply from the server: {e}")
            if self.status_rid and reply.rid == self.status_rid:
                self._on_status(reply)
                continue
            with self.lock:
                waiter = self.waiters.get(reply.rid)
                if waiter is not None and not isinstance(reply, Chunk):
                    del self.waiters[reply.rid]
            if waiter is not None:
                waiter.replies.put(reply)

    def _watch(self, now: float) -> None:
        """Ask where the watched requests stand every `interval_s`; fail them when the server
        leaves a question unanswered for `silence_s`."""
        if self.status_rid:
            if now - self.status_at > self.liveness.silence_s:
                self.status_rid = ""
                message = (
                    f"the server at {self.address} stopped answering: no reply to a status "
                    f"query in {self.liveness.silence_s:.0f}s"
                )
                self._fail_all(message, ERROR_TIMEOUT, watched_only=True)
            return
        if now - self.status_at < self.liveness.interval_s:
            return
        with self.lock:
            rids = [
                rid
                for rid, w in self.waiters.items()
                if w.watch and w.sent and now - w.since >= self.liveness.interval_s
            ]
        if rids:
            self.status_rid, self.status_at = _new_rid(), now
            self.socket.send(encode(Status(self.status_rid, rids), self.api_key))

    def _on_status(self, reply: Any) -> None:
        """A status answer (received after every reply the server sent before it): a request
        still waited on that the server no longer knows is lost; a long wait is logged."""
        self.status_rid, now = "", time.monotonic()
        self.status_at = now
        if isinstance(reply, Error):  # a server without `status` (older): only the timeout
            log.warning("the server at %s cannot report request status: %s", self.address, reply)
            self.liveness = Liveness(interval_s=math.inf)
            return
        data = reply.data
        for rid, state in data.get("requests", {}).items():
            with self.lock:
                waiter = self.waiters.get(rid)
                if waiter is not None and state.get("state") != "in_flight":
                    del self.waiters[rid]
            if waiter is None:
                continue
            if state.get("state") != "in_flight":
                message = f"the server at {self.address} no longer knows request {rid} (lost)"
                waiter.replies.put(Error(rid, ERROR_FAILED, message))
            elif now - waiter.logged >= self.liveness.log_after_s:
                waiter.logged = now
                log.info("%s", waiting_line(rid, now - waiter.since, state, data))

    def _on_monitor(self, event: dict[str, Any]) -> None:
        if event["event"] == zmq.EVENT_CONNECTED:
            self.connected.set()
        elif event["event"] == zmq.EVENT_DISCONNECTED:
            self.connected.clear()
            self._fail_all(f"lost the connection to the server at {self.address}", "disconnected")

    def _fail_all(self, message: str, code: str, watched_only: bool = False) -> None:
        with self.lock:
            waiters = {r: w for r, w in self.waiters.items() if w.watch or not watched_only}
            for rid in waiters:
                del self.waiters[rid]
        for rid, waiter in waiters.items():
            waiter.replies.put(Error(rid, code, message))


def waiting_line(rid: str, waited: float, state: dict[str, Any], data: dict[str, Any]) -> str:
    """Why a call still waits, from the server's status answer."""
    tokens = state.get("completion_tokens")
    progress = "" if tokens is None else f", {tokens} tokens so far"
    return (
        f"waiting for request {rid} for {waited:.0f}s: the server reports it in flight for "
        f"{state.get('seconds', 0):.0f}s{progress}; its scheduler runs "
        f"{data.get('running_requests', 0)} requests and queues {data.get('waiting_requests', 0)}"
        f" (server status: {data.get('status')})"
    )
