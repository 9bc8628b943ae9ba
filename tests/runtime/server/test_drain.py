"""SIGTERM drains the server: new requests are refused (HTTP 503 with Retry-After, a ZeroMQ
error reply), /health answers 503 "draining", the requests in flight finish, and the process
exits 0 with its scheduler; past --shutdown-timeout the leftovers get an error reply instead.
Each test starts its own server, since it stops it."""

from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import psutil
import pytest

from radixflow.backend import RuntimeEndpoint, RuntimeEndpointError
from radixflow.runtime.config import ServerConfig
from radixflow.runtime.protocol import messages as m
from radixflow.runtime.protocol.messages import Generate
from radixflow.runtime.server import reports
from radixflow.runtime.server.server import RequestError, Server

READY = re.compile(r"^radixflow ready on (http://\S+) \(HTTP\) and (tcp://\S+) \(ZeroMQ\)")
MAX_NEW_TOKENS = 128


def read_lines(proc: subprocess.Popen[str], lines: queue.Queue[str]) -> None:
    for line in proc.stdout or ():
        lines.put(line)


def start_server(*flags: str) -> tuple[subprocess.Popen[str], str, str]:
    """`radixflow serve` on free loopback ports; returns the process, its HTTP url and its
    ZeroMQ address."""
    cmd = [sys.executable, "-m", "radixflow.runtime", "serve", "--model-path", "smollm2"]
    cmd += ["--port", "0", "--num-threads", "1", "--log-level", "warning", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=read_lines, args=(proc, lines), daemon=True).start()
    try:
        while True:
            found = READY.match(lines.get(timeout=120))
            if found:
                return proc, found.group(1), found.group(2)
    except queue.Empty:
        proc.kill()
        raise AssertionError("the server printed no ready line in 120 s") from None


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


class Stream(threading.Thread):
    """One streaming /generate; `events` collects each `data:` payload ('[DONE]' as is)."""

    def __init__(self, url: str, prompt: str, max_new_tokens: int) -> None:
        super().__init__(daemon=True)
        params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
        self.url, self.body = url, {"text": prompt, "sampling_params": params, "stream": True}
        self.events: list[Any] = []
        self.status = 0

    def run(self) -> None:
        with httpx.stream("POST", f"{self.url}/generate", json=self.body, timeout=60) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    self.events.append(data if data == "[DONE]" else json.loads(data))


def start_streams(url: str, count: int, max_new_tokens: int) -> list[Stream]:
    streams = [Stream(url, f"Story {i}: once upon a time", max_new_tokens) for i in range(count)]
    for stream in streams:
        stream.start()
    wait_for(lambda: all(len(s.events) >= 3 for s in streams), 120, "a few chunks each")
    return streams


def health(url: str) -> httpx.Response:
    return httpx.get(f"{url}/health", timeout=10)


def server_processes(proc: subprocess.Popen[str]) -> list[psutil.Process]:
    return [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]


def assert_all_gone(processes: list[psutil.Process]) -> None:
    left = [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, left


def test_sigterm_drains_streams_then_exits_zero() -> None:
    proc, url, address = start_server("--max-total-tokens", "4096")
    try:
        processes = server_processes(proc)
        assert health(url).json()["scheduler_pid"] in [p.pid for p in processes]
        streams = start_streams(url, 4, MAX_NEW_TOKENS)
        proc.send_signal(signal.SIGTERM)
        draining = wait_for(lambda: health(url).status_code == 503 and health(url), 10, "503")
        assert draining.json()["status"] == "draining" and not draining.json()["ok"]
        refused = httpx.post(f"{url}/generate", json=streams[0].body | {"stream": False})
        assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"]["code"] == m.ERROR_SHUTDOWN
        endpoint = RuntimeEndpoint(address)
        try:
            endpoint.generate("Hello", {"max_new_tokens": 1})
            raise AssertionError("the ZeroMQ door admitted a request while draining")
        except RuntimeEndpointError as e:
            assert e.code == m.ERROR_SHUTDOWN
        finally:
            endpoint.close()
        assert any(s.is_alive() for s in streams)  # the refusals came while they still ran
        for stream in streams:
            stream.join(60)
        assert proc.wait(30) == 0
        for stream in streams:
            assert stream.status == 200 and stream.events[-1] == "[DONE]"
            final = stream.events[-2]
            assert final["meta_info"]["finish_reason"]["type"] == "length", final
            assert len(final["output_ids"]) == MAX_NEW_TOKENS
        assert_all_gone(processes)
    finally:
        proc.kill()


def test_shutdown_timeout_aborts_what_is_left_and_exits_zero() -> None:
    proc, url, _ = start_server("--max-total-tokens", "8192", "--shutdown-timeout", "1")
    try:
        processes = server_processes(proc)
        streams = start_streams(url, 3, 2000)
        plain: list[httpx.Response] = []
        body = streams[0].body | {"stream": False}
        post = threading.Thread(
            target=lambda: plain.append(httpx.post(f"{url}/generate", json=body, timeout=60))
        )
        post.start()
        wait_for(lambda: health(url).json()["requests_in_flight"] == 4, 30, "4 in flight")
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        # 1 s of drain plus stopping the scheduler (seconds on a loaded machine); far less than
        # the 30 s default drain or the time the 2000-token requests would take to finish
        assert time.monotonic() - started < 20, "the drain outlived --shutdown-timeout"
        for thread in (*streams, post):
            thread.join(10)
        for stream in streams:
            assert stream.events[-1] == "[DONE]"
            assert stream.events[-2]["error"]["code"] == m.ERROR_SHUTDOWN, stream.events[-2]
        (response,) = plain
        assert response.status_code == 503
        assert response.json()["error"]["code"] == m.ERROR_SHUTDOWN
        assert_all_gone(processes)
    finally:
        proc.kill()


def test_a_second_signal_ends_the_drain_at_once() -> None:
    server = Server(ServerConfig(shutdown_timeout=30))
    try:
        server.request_stop()
        assert 29 < server.drain_deadline - time.monotonic() <= 30
        assert reports.health_data(server)["status"] == "draining"
        with pytest.raises(RequestError) as refused:
            server.submit_generates([(None, Generate("r1", text="Hi"))])
        assert refused.value.code == m.ERROR_SHUTDOWN
        server.request_stop()
        assert server.drain_deadline <= time.monotonic()
    finally:
        server.close()
