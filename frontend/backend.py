"""RuntimeEndpoint (a client of a radixflow server) and Runtime (launches one). No torch here.

    runtime = Runtime(model_path="smollm2")          # starts `radixflow serve --port 0`
    out = runtime.endpoint.generate("Hello", {"max_new_tokens": 8, "temperature": 0})
    runtime.url                                      # http://127.0.0.1:P (SGLang, OpenAI /v1)
    runtime.shutdown()

`RuntimeEndpoint("tcp://...")` speaks radixflow's ZeroMQ protocol (below);
`RuntimeEndpoint("http://...")` speaks SGLang's HTTP API (`radixflow.http_endpoint`), with the
same methods, so a program runs against either door, or against an SGLang server.

One RuntimeEndpoint is shared by many program threads: a background I/O thread owns the
DEALER socket, callers hand it frames through a queue (and a wake-up pipe) and wait on a
per-request reply queue. The I/O thread pings the server while requests are in flight (the
server aborts requests of silent clients) and watches the connection: when it drops, every
waiting call fails at once with RuntimeEndpointError, and no call waits past its timeout.
The protocol is specified in `radixflow.runtime.protocol.messages`.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import math
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from typing import Any

import zmq
import zmq.utils.monitor

from radixflow.chat_template import template_for_model
from radixflow.http_endpoint import HttpEndpointMethods, HttpTransport
from radixflow.runtime.config import config_from_kwargs
from radixflow.runtime.protocol.messages import (
    CLIENT_REPLIES,
    ERROR_DISCONNECTED,
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
    decode,
    encode,
)

CONNECT_TIMEOUT_S = 10.0  # longest wait for the first connection before a call fails
READY_PREFIX = "radixflow ready on "
READY_ADDRESSES = re.compile(r"(https?://\S+)(?:.*?(tcp://\S+))?")  # --dp-size: HTTP only


class RuntimeEndpointError(RuntimeError):
    """A request failed: the server's error reply (`code` is its ERROR_* name), a timeout, an
    unreachable server or a dropped connection."""

    def __init__(self, message: str, code: str = "client") -> None:
        super().__init__(message)
        self.code = code


class _Waiter:
    """One request's reply queue: chunks, then one final reply (or a failure)."""

    def __init__(self) -> None:
        self.replies: queue.Queue[Any] = queue.Queue()


class _Connection:
    """The I/O thread: owns the DEALER socket, routes replies to waiters by rid."""

    def __init__(self, address: str, api_key: str) -> None:
        self.address, self.api_key = address, api_key
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
        self.outbox: collections.deque[bytes] = collections.deque()
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_write, False)
        self.waiters: dict[str, _Waiter] = {}
        self.lock = threading.Lock()
        self.connected = threading.Event()
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="radixflow-endpoint", daemon=True)
        self.thread.start()

    # ---- called from any thread -----------------------------------------------------------

    def submit(self, message: Any, timeout: float) -> _Waiter:
        """Register a waiter for message.rid and send it. Raises RuntimeEndpointError."""
        if not self.connected.wait(min(timeout, CONNECT_TIMEOUT_S)):
            raise RuntimeEndpointError(
                f"cannot reach a radixflow server at {self.address} (no connection after "
                f"{min(timeout, CONNECT_TIMEOUT_S):.0f}s)",
                ERROR_DISCONNECTED,
            )
        waiter = _Waiter()
        with self.lock:
            if self.closed:
                raise RuntimeEndpointError("the endpoint is closed")
            self.waiters[message.rid] = waiter
        self.send(message)
        return waiter

    def send(self, message: Any) -> None:
        """Queue a frame for the I/O thread (no reply expected or already registered)."""
        self.outbox.append(encode(message, self.api_key))
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
            ready = dict(poller.poll(int(PING_INTERVAL_S * 500)))
            if self.wake_read in ready:
                os.read(self.wake_read, 4096)
            while self.outbox:
                self.socket.send(self.outbox.popleft())
            if self.socket in ready:
                self._receive()
            if self.monitor in ready:
                self._on_monitor(zmq.utils.monitor.recv_monitor_message(self.monitor))
            if self.waiters and time.monotonic() - last_ping >= PING_INTERVAL_S:
                self.socket.send(encode(Ping(), self.api_key))
                last_ping = time.monotonic()

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
            with self.lock:
                waiter = self.waiters.get(reply.rid)
                if waiter is not None and not isinstance(reply, Chunk):
                    del self.waiters[reply.rid]
            if waiter is not None:
                waiter.replies.put(reply)

    def _on_monitor(self, event: dict[str, Any]) -> None:
        if event["event"] == zmq.EVENT_CONNECTED:
            self.connected.set()
        elif event["event"] == zmq.EVENT_DISCONNECTED:
            self.connected.clear()
            self._fail_all(f"lost the connection to the server at {self.address}", "disconnected")

    def _fail_all(self, message: str, code: str) -> None:
        with self.lock:
            waiters, self.waiters = self.waiters, {}
        for rid, waiter in waiters.items():
            waiter.replies.put(Error(rid, code, message))


class RuntimeEndpoint:
    """A thread-safe client of one radixflow server. Calls block until their reply; they raise
    RuntimeEndpointError on an error reply, after `timeout` seconds without the reply (the
    whole call, or each chunk when streaming; `math.inf` waits for good; a timed-out
    generation is aborted on the server), or at once when the server is unreachable or goes
    away (a dropped connection, a server killed)."""

    def __new__(cls, address: str = "tcp://127.0.0.1:30001", *args: Any, **kwargs: Any) -> Any:
        if cls is RuntimeEndpoint and address.startswith(("http://", "https://")):
            return super().__new__(HttpRuntimeEndpoint)
        return super().__new__(cls)

    def __init__(
        self,
        address: str = "tcp://127.0.0.1:30001",
        api_key: str | None = None,
        timeout: float = 60.0,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self._connection = _Connection(address, api_key or "")
        weakref.finalize(self, self._connection.close)  # an endpoint never closed stops anyway
        self._model_info: dict[str, Any] | None = None

    # ---- generation -----------------------------------------------------------------------

    def generate(
        self,
        text: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        *,
        input_ids: list[int] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        timeout: float | None = None,
        rid: str | None = None,
    ) -> dict[str, Any]:
        """-> {"text", "output_ids", "meta_info"} once the request finished."""
        msg = Generate(
            rid or _new_rid(),
            text=text,
            input_ids=input_ids,
            sampling_params=dict(sampling_params or {}),
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
        )
        return self._call(msg, timeout, abort_on_timeout=True)

    def generate_stream(
        self,
        text: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        *,
        input_ids: list[int] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        timeout: float | None = None,
        rid: str | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Yields {"text" (cumulative), "output_ids" (cumulative), "meta_info" (logprobs only
        for the new tokens), "finished"}; the last item has finished=True and the final text.
        Closing the iterator early aborts the request."""
        msg = Generate(
            rid or _new_rid(),
            text=text,
            input_ids=input_ids,
            sampling_params=dict(sampling_params or {}),
            stream=True,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
        )
        return self._stream(msg, self._timeout(timeout))

    def _stream(self, msg: Generate, timeout: float) -> Iterator[dict[str, Any]]:
        waiter = self._connection.submit(msg, timeout)
        output_ids: list[int] = []
        num_logprobs = 0
        finished = False
        try:
            while True:
                reply = self._next(waiter, msg.rid, timeout)
                if isinstance(reply, Chunk):
                    output_ids += reply.new_ids
                    num_logprobs += len(reply.meta_info.get("output_token_logprobs", ()))
                    yield {
                        "text": reply.text,
                        "output_ids": list(output_ids),
                        "meta_info": reply.meta_info,
                        "finished": False,
                    }
                    continue
                finished = True
                data = _result(reply)
                meta = dict(data["meta_info"])
                if "output_token_logprobs" in meta:
                    meta["output_token_logprobs"] = meta["output_token_logprobs"][num_logprobs:]
                yield {**data, "meta_info": meta, "finished": True}
                return
        finally:
            if not finished:
                self._connection.forget(msg.rid)
                self._send_abort(msg.rid)

    def score(
        self, prefix: str, continuations: list[str], unconditional: bool = False
    ) -> list[dict[str, Any]]:
        """Logprobs of each continuation's tokens after `prefix` (one batch on the server):
        [{"text", "token_ids", "logprobs", "unconditional_logprobs" (or None)}]."""
        msg = Score(_new_rid(), prefix, list(continuations), unconditional)
        return self._call(msg, None, abort_on_timeout=True)["choices"]

    def cache_prefix(self, text: str) -> dict[str, Any]:
        """Prefill `text` into the radix cache; returns its meta_info."""
        return self._call(CachePrefix(_new_rid(), text), None, abort_on_timeout=True)["meta_info"]

    # ---- control --------------------------------------------------------------------------

    def abort(self, rid: str) -> bool:
        """Abort request `rid` (idempotent); True when it was still in flight."""
        return self._call(Abort(_new_rid(), rid), None)["aborted"]

    def flush_cache(self) -> bool:
        """Drop the radix cache; False while requests run (nothing is dropped then)."""
        return self._call(FlushCache(_new_rid()), None)["flushed"]

    def model_info(self) -> dict[str, Any]:
        if self._model_info is None:
            self._model_info = self._call(ModelInfo(_new_rid()), None)
        return dict(self._model_info)

    def stats(self) -> dict[str, Any]:
        return self._call(Stats(_new_rid()), None)

    def health(self) -> dict[str, Any]:
        return self._call(Health(_new_rid()), None)

    def get_server_info(self) -> dict[str, Any]:
        return {**self.model_info(), **self.stats()}

    def close(self) -> None:
        self._connection.close()

    # ---- SGLang's endpoint methods (both doors) -------------------------------------------

    def get_model_name(self) -> str:
        return self.model_info()["model_path"]

    def get_chat_template(self) -> Any:

        return template_for_model(self.model_info())

    def concatenate_and_append(self, src_rids: list[str], dst_rid: str) -> None:
        """SGLang's fork join: the radix cache already holds every branch; nothing to do."""

    def start_profile(self) -> None:
        raise RuntimeEndpointError("profiling is not implemented by radixflow", "unsupported")

    stop_profile = start_profile

    def __enter__(self) -> RuntimeEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- plumbing -------------------------------------------------------------------------

    def _timeout(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    def _call(self, msg: Any, timeout: float | None, abort_on_timeout: bool = False) -> Any:
        timeout = self._timeout(timeout)
        waiter = self._connection.submit(msg, timeout)
        try:
            return _result(self._next(waiter, msg.rid, timeout))
        except RuntimeEndpointError as e:
            if e.code == ERROR_TIMEOUT and abort_on_timeout:
                self._send_abort(msg.rid)
            raise

    def _next(self, waiter: _Waiter, rid: str, timeout: float) -> Any:
        try:
            return waiter.replies.get(timeout=None if math.isinf(timeout) else timeout)
        except queue.Empty:
            self._connection.forget(rid)
            raise RuntimeEndpointError(
                f"no reply from the server at {self.address} within {timeout:.1f}s",
                ERROR_TIMEOUT,
            ) from None

    def _send_abort(self, rid: str) -> None:
        if not self._connection.closed and self._connection.connected.is_set():
            self._connection.send(Abort(_new_rid(), rid))  # its reply is dropped


class HttpRuntimeEndpoint(HttpEndpointMethods, RuntimeEndpoint):
    """RuntimeEndpoint("http://host:port"): SGLang's HTTP API, the same methods and errors."""

    def __init__(
        self,
        address: str = "http://127.0.0.1:30000",
        api_key: str | None = None,
        timeout: float = 60.0,
    ) -> None:
        self.address, self.timeout, self.api_key = address, timeout, api_key
        self.http = HttpTransport(address, api_key or "", timeout, RuntimeEndpointError)
        self._model_info = None


def _result(reply: Any) -> Any:
    if isinstance(reply, Error):
        raise RuntimeEndpointError(f"[{reply.code}] {reply.message}", reply.code)
    return reply.data


def _new_rid() -> str:
    return uuid.uuid4().hex


class Runtime:
    """Launch `python -m radixflow.runtime serve` as a subprocess and connect to it.

    `.endpoint` is a ZeroMQ RuntimeEndpoint; `.url` the HTTP base URL (SGLang's native API,
    OpenAI's at `.url + "/v1"`), `.address` the ZeroMQ one. With `dp_size > 1` the server is
    sglang-router over replicas, which speaks HTTP only: `.address` is None and `.endpoint`
    an HTTP one on `.url`.

    `server_config_kwargs` are ServerConfig fields (max_total_tokens=8192, ...). The server is
    shut down by `shutdown()`, at interpreter exit, or as a context manager."""

    def __init__(
        self,
        model_path: str = "smollm2",
        port: int = 0,
        log_level: str = "error",
        launch_timeout: float = 300.0,
        **server_config_kwargs: Any,
    ) -> None:
        config_from_kwargs(model=model_path, port=port, **server_config_kwargs)  # check names
        cmd = [sys.executable, "-m", "radixflow.runtime", "serve", "--model", model_path]
        cmd += ["--port", str(port), "--log-level", log_level]
        cmd += _flags(server_config_kwargs)
        self.process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        atexit.register(self.shutdown)
        self.url, self.address = self._wait_ready(launch_timeout)  # HTTP, ZeroMQ
        api_key = server_config_kwargs.get("api_key")
        self.endpoint = RuntimeEndpoint(self.address or self.url, api_key=api_key)

    def _wait_ready(self, launch_timeout: float) -> tuple[str, str | None]:
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=_pump_lines, args=(self.process, lines), daemon=True).start()
        deadline = time.monotonic() + launch_timeout
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            found = READY_ADDRESSES.search(line) if line.startswith(READY_PREFIX) else None
            if found:
                return found.group(1), found.group(2)
        self.shutdown()
        raise RuntimeError(
            f"the radixflow server did not start within {launch_timeout:.0f}s "
            f"(exit code {self.process.returncode}; see its log on stderr)"
        )

    def generate(
        self, prompt: str, sampling_params: dict[str, Any] | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        return self.endpoint.generate(prompt, sampling_params, **kwargs)

    def get_tokenizer(self) -> Any:
        from transformers import AutoTokenizer  # noqa: PLC0415 (optional: the frontend stays torch-free; only when a tokenizer is asked for)

        return AutoTokenizer.from_pretrained(self.endpoint.model_info()["model_path"])

    def shutdown(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 30 s); idempotent."""
        endpoint = getattr(self, "endpoint", None)
        if endpoint is not None:
            endpoint.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _flags(kwargs: dict[str, Any]) -> list[str]:
    flags = []
    for name, value in kwargs.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def _pump_lines(process: subprocess.Popen[bytes], lines: queue.Queue[str]) -> None:
    """Read the server's stdout for good (so it never blocks on a full pipe)."""
    assert process.stdout is not None
    for raw in process.stdout:
        lines.put(raw.decode(errors="replace"))
