"""RuntimeEndpoint over its two transports, against fake servers on loopback (no model): one
class whatever the address, both transports the same Transport, and the same answers, stream
items and errors through either door."""

from __future__ import annotations

import inspect
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import zmq

import radixflow as sgl
from conftest import finishes
from radixflow.backend import RuntimeEndpoint
from radixflow.http_transport import HttpTransport
from radixflow.runtime.protocol.codec import decode, encode
from radixflow.runtime.protocol.messages import (
    CLIENT_REQUESTS,
    Chunk,
    Generate,
    ModelInfo,
    Result,
    Status,
)
from radixflow.transport import Liveness, RuntimeEndpointError, Transport
from radixflow.zmq_transport import ZmqTransport

# What both fake servers answer: three tokens, streamed one per chunk.
TOKENS = [(5, "a", -0.1), (6, "b", -0.2), (7, "c", -0.3)]
ENTRIES = [[lp, tid, None] for tid, _, lp in TOKENS]
RESULT = {
    "text": "abc",
    "output_ids": [5, 6, 7],
    "meta_info": {
        "completion_tokens": 3,
        "finish_reason": {"type": "length", "length": 3},
        "output_token_logprobs": ENTRIES,
    },
}
MODEL_INFO = {"model": "fake", "model_path": "fake/model"}


def public_methods(cls: type) -> dict[str, str]:
    """Public method name -> its signature as written."""
    return {
        name: str(inspect.signature(member))
        for name, member in vars(cls).items()
        if callable(member) and not name.startswith("_")
    }


@pytest.mark.parametrize("transport", [ZmqTransport, HttpTransport])
def test_each_transport_is_exactly_the_transport_protocol(transport: type) -> None:
    assert public_methods(transport) == public_methods(Transport)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_one_endpoint_class_whatever_the_address() -> None:
    port = free_port()  # nothing listens there
    zmq_endpoint = RuntimeEndpoint(f"tcp://127.0.0.1:{port}", timeout=0.5)
    http_endpoint = RuntimeEndpoint(f"http://127.0.0.1:{port}", api_key="k", timeout=0.5)
    with zmq_endpoint, http_endpoint:
        assert type(zmq_endpoint) is RuntimeEndpoint and type(http_endpoint) is RuntimeEndpoint
        assert isinstance(zmq_endpoint.transport, ZmqTransport)
        assert isinstance(http_endpoint.transport, HttpTransport)
        assert isinstance(http_endpoint.transport, Transport)
        assert http_endpoint.api_key == "k" and http_endpoint.timeout == 0.5
        public = [
            {n for n in dir(e) if not n.startswith("_")} for e in (zmq_endpoint, http_endpoint)
        ]
        assert public[0] == public[1]
        for endpoint in (zmq_endpoint, http_endpoint):
            with pytest.raises(RuntimeEndpointError) as info:
                endpoint.model_info()
            assert info.value.code == "disconnected", endpoint.address
    assert sgl.RuntimeEndpoint is RuntimeEndpoint


# ---- fake servers -----------------------------------------------------------------------


def zmq_reply(msg: Any) -> list[Any]:
    """The fake ZeroMQ server's replies to one request (a ping gets none)."""
    if isinstance(msg, ModelInfo):
        return [Result(msg.rid, MODEL_INFO)]
    if not isinstance(msg, Generate):
        return []
    chunks = [
        Chunk(msg.rid, "abc"[: i + 1], [tid], {"output_token_logprobs": [ENTRIES[i]]})
        for i, (tid, _, _) in enumerate(TOKENS)
    ]
    return [*(chunks if msg.stream else []), Result(msg.rid, RESULT)]


@pytest.fixture
def zmq_server() -> Iterator[str]:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:*")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if router.poll(50):
                identity, frame = router.recv_multipart()
                for reply in zmq_reply(decode(frame, CLIENT_REQUESTS)):
                    router.send_multipart([identity, encode(reply)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield router.getsockopt(zmq.LAST_ENDPOINT).decode()
    stop.set()
    thread.join(5)
    ctx.destroy(linger=0)


class FakeSglang(BaseHTTPRequestHandler):
    """SGLang's /get_model_info and /generate (JSON, or SSE with cumulative chunks)."""

    def log_message(self, *args: Any) -> None:
        pass

    def send_json(self, data: Any) -> None:
        body = json.dumps(data).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        assert self.path == "/get_model_info", self.path
        self.send_json(MODEL_INFO)

    def do_POST(self) -> None:
        assert self.path == "/generate", self.path
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not body.get("stream"):
            return self.send_json(RESULT)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(len(TOKENS)):  # SGLang's stream: each event's own logprob entries
            meta = {"finish_reason": None, "output_token_logprobs": ENTRIES[i : i + 1],
                    "output_token_logprobs_length": i + 1}  # fmt: skip
            chunk = {"text": "abc"[: i + 1], "output_ids": [5, 6, 7][: i + 1], "meta_info": meta}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        final = {**RESULT, "meta_info": {**RESULT["meta_info"], "output_token_logprobs": []}}
        self.wfile.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())


@pytest.fixture
def http_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeSglang)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def stream_view(items: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What a program reads from stream items."""
    return [
        (i["text"], i["output_ids"], i["meta_info"].get("output_token_logprobs"), i["finished"])
        for i in items
    ]


def test_both_doors_give_the_same_answers_and_stream_items(
    zmq_server: str, http_server: str
) -> None:
    expected_stream = [
        ("a", [5], [ENTRIES[0]], False),
        ("ab", [5, 6], [ENTRIES[1]], False),
        ("abc", [5, 6, 7], [ENTRIES[2]], False),
        ("abc", [5, 6, 7], [], True),  # the final item: no logprobs left to send
    ]

    @sgl.function
    def prog(s: Any) -> None:
        s += "Q: " + sgl.gen("answer", max_tokens=3)

    for address in (zmq_server, http_server):
        with RuntimeEndpoint(address, timeout=10) as endpoint:
            assert endpoint.generate("Q:", {"max_new_tokens": 3}) == RESULT, address
            streamed = list(endpoint.generate_stream("Q:", return_logprob=True))
            assert stream_view(streamed) == expected_stream, address
            assert endpoint.get_model_name() == "fake/model"
            state = prog.run(backend=endpoint, stream=True)
            assert list(state.text_iter("answer")) == ["a", "b", "c"], address
            assert state.text() == "Q: abc"


# ---- timeouts ------------------------------------------------------------------------------


@pytest.fixture
def silent_servers() -> Iterator[tuple[str, str]]:
    """A ZeroMQ server that never reads, an HTTP port that accepts but never answers."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:*")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    yield (
        router.getsockopt(zmq.LAST_ENDPOINT).decode(),
        f"http://127.0.0.1:{listener.getsockname()[1]}",
    )
    listener.close()
    ctx.destroy(linger=0)


def test_both_doors_time_out_by_the_endpoints_current_timeout(
    silent_servers: tuple[str, str],
) -> None:
    for address in silent_servers:
        with RuntimeEndpoint(address, timeout=60) as endpoint:
            endpoint.timeout = 0.3  # changed after construction: every call uses it
            for call in (
                lambda: endpoint.generate("Hi"),
                lambda: next(endpoint.generate_stream("Hi")),
                lambda: endpoint.score("Hi", [" a", " b"]),
            ):
                start = time.monotonic()
                with pytest.raises(RuntimeEndpointError) as info:
                    call()
                assert info.value.code == "timeout", address
                assert time.monotonic() - start < 5, address


# ---- waiting without a timeout: the server's status is the liveness signal -----------------

FAST_LIVENESS = Liveness(interval_s=0.1, log_after_s=0.4, silence_s=1.0)


@pytest.fixture
def slow_zmq_server() -> Iterator[tuple[str, dict[str, Any]]]:
    """A ZeroMQ server that holds each generate for `behaviour["hold_s"]` (one chunk first when
    streamed) and answers status for it as the real server does, or as "unknown" when
    `behaviour["lost"]`; it stops answering anything when `behaviour["hung"]`."""
    behaviour: dict[str, Any] = {"hold_s": 1.5, "lost": False, "hung": False, "asked": 0}
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:*")
    stop = threading.Event()
    held: dict[str, tuple[bytes, float]] = {}

    def answer(identity: bytes, msg: Any) -> list[Any]:
        if isinstance(msg, Generate):
            held[msg.rid] = (identity, time.monotonic())
            return [Chunk(msg.rid, "a", [5], {})] if msg.stream else []
        if isinstance(msg, Status):
            behaviour["asked"] += 1
            state = {"state": "unknown"} if behaviour["lost"] else {"state": "in_flight"}
            states = {rid: {**state, "seconds": 1.0, "completion_tokens": 1} for rid in held}
            data = {"requests": states, "running_requests": 1, "waiting_requests": 2}
            return [Result(msg.rid, {**data, "status": "ok"})]
        return []

    def serve() -> None:
        while not stop.is_set():
            if router.poll(20) and not behaviour["hung"]:
                identity, frame = router.recv_multipart()
                for reply in answer(identity, decode(frame, CLIENT_REQUESTS)):
                    router.send_multipart([identity, encode(reply)])
            for rid, (identity, since) in list(held.items()):
                if time.monotonic() - since >= behaviour["hold_s"] and not behaviour["lost"]:
                    del held[rid]
                    router.send_multipart([identity, encode(Result(rid, RESULT))])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield router.getsockopt(zmq.LAST_ENDPOINT).decode(), behaviour
    stop.set()
    thread.join(5)
    ctx.destroy(linger=0)


def test_no_timeout_waits_while_the_server_reports_the_request_and_says_why(
    slow_zmq_server: tuple[str, dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    """The default (no timeout): a generation longer than any status interval completes, the
    status queries are what kept it alive, and the long wait is logged with the server's view."""
    address, behaviour = slow_zmq_server
    caplog.set_level(logging.INFO, logger="radixflow")
    with RuntimeEndpoint(address, liveness=FAST_LIVENESS) as endpoint:
        assert endpoint.timeout is None
        assert endpoint.generate("Hi", {"max_new_tokens": 3}) == RESULT
        items = list(endpoint.generate_stream("Hi"))
        assert items[-1]["finished"] and items[-1]["output_ids"] == [5, 6, 7]
    assert behaviour["asked"] >= 10  # every 0.1 s over two 1.5 s waits
    lines = [r.getMessage() for r in caplog.records if "waiting for request" in r.getMessage()]
    assert len(lines) >= 4, lines  # each call waited past log_after_s several times
    assert all("in flight" in line and "queues 2" in line for line in lines), lines
    assert any("1 tokens so far" in line for line in lines), lines

    with RuntimeEndpoint(address, timeout=0.5, liveness=FAST_LIVENESS) as endpoint:
        start = time.monotonic()  # an explicit timeout still applies
        with pytest.raises(RuntimeEndpointError) as info:
            endpoint.generate("Hi")
        assert info.value.code == "timeout" and time.monotonic() - start < 1.4


def test_no_timeout_fails_a_request_the_server_lost_or_a_server_that_stops_answering(
    slow_zmq_server: tuple[str, dict[str, Any]],
) -> None:
    address, behaviour = slow_zmq_server
    behaviour["lost"] = True  # the server answers, but no longer knows the request
    with RuntimeEndpoint(address, liveness=FAST_LIVENESS) as endpoint:
        for call in (lambda: endpoint.generate("Hi"), lambda: list(endpoint.generate_stream("Hi"))):
            start = time.monotonic()
            with pytest.raises(RuntimeEndpointError) as info:
                finishes(call, 5)  # without the status check: a hang, failed here
            assert info.value.code == "failed" and "no longer knows" in str(info.value)
            assert time.monotonic() - start < 1.0
    behaviour.update(lost=False, hung=True)  # connected, but nothing answers
    with RuntimeEndpoint(address, liveness=FAST_LIVENESS) as endpoint:
        start = time.monotonic()
        with pytest.raises(RuntimeEndpointError) as info:
            finishes(lambda: endpoint.generate("Hi"), 5)
        assert info.value.code == "timeout" and "stopped answering" in str(info.value)
        assert 1.0 < time.monotonic() - start < 3.0
