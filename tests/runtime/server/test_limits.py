"""The server's limits, each at its boundary, against one real server on loopback with every
limit small: a 256-token context, max_new_tokens_limit 512, two running requests, 4 KiB frames
and a 600-slot KV pool. Documented in runtime/protocol/messages.py's docstring and ServerConfig."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack
import pytest
import zmq
from test_server import wait_for, wait_idle

from conftest import Server
from radixflow.backend import RuntimeEndpoint, RuntimeEndpointError
from radixflow.runtime.protocol import codec
from radixflow.runtime.protocol import messages as m

CONTEXT = 256
MAX_NEW_TOKENS_LIMIT = 512
MAX_RUNNING = 2
MAX_MESSAGE_BYTES = 4096
POOL = 600
GREEDY = {"max_new_tokens": 12, "temperature": 0}


SERVER = dict(  # conftest's module-scoped `runtime`
    context_length=CONTEXT,
    max_new_tokens_limit=MAX_NEW_TOKENS_LIMIT,
    max_running_requests=MAX_RUNNING,
    max_message_bytes=MAX_MESSAGE_BYTES,
    max_total_tokens=POOL,
    self_check=True,
    num_threads=1,
    log_level="warning",
    endpoint_timeout=120.0,
    grammar_backend="outlines",  # its compile workers and their time limit are under test
)


@pytest.fixture(scope="module")
def endpoint(runtime: Server) -> RuntimeEndpoint:
    return runtime.endpoint


def refused(call: Any, code: str = m.ERROR_INVALID_REQUEST) -> str:
    """The message of the error reply `call()` gets; fails unless its code is `code`."""
    with pytest.raises(RuntimeEndpointError) as info:
        call()
    assert info.value.code == code, info.value
    return str(info.value)


def ids(count: int) -> list[int]:
    return [(i * 37) % 5000 + 10 for i in range(count)]


def test_model_info_reports_the_limits(endpoint: RuntimeEndpoint) -> None:
    info = endpoint.model_info()
    assert info["context_length"] == CONTEXT
    assert info["max_new_tokens_limit"] == MAX_NEW_TOKENS_LIMIT
    assert info["max_message_bytes"] == MAX_MESSAGE_BYTES


def test_prompt_past_the_context_is_refused_by_every_request_type(
    endpoint: RuntimeEndpoint,
) -> None:
    """A prompt of context_length tokens or more: `invalid_request` naming both numbers, for
    generate (ids or text), score and cache_prefix; one token less is served."""
    message = refused(lambda: endpoint.generate(input_ids=ids(CONTEXT), sampling_params=GREEDY))
    assert f"{CONTEXT} tokens" in message and f"context length is {CONTEXT}" in message
    long_text = "word " * (CONTEXT + 10)  # more tokens than the context, fewer bytes than 4 KiB
    assert "context length" in refused(lambda: endpoint.generate(long_text, GREEDY))
    refused(lambda: endpoint.score(long_text, [" yes", " no"]))
    refused(lambda: endpoint.score("Is it?", [long_text]))
    refused(lambda: endpoint.cache_prefix(long_text))
    out = endpoint.generate(input_ids=ids(CONTEXT - 1), sampling_params=GREEDY)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 1}  # context full
    wait_idle(endpoint)


def test_max_new_tokens_past_the_limit_is_refused(endpoint: RuntimeEndpoint) -> None:
    params = {"max_new_tokens": MAX_NEW_TOKENS_LIMIT + 1, "temperature": 0}
    message = refused(lambda: endpoint.generate("Hello", params))
    assert f"exceeds the limit {MAX_NEW_TOKENS_LIMIT}" in message
    refused(lambda: endpoint.generate("Hello", {"max_new_tokens": -1}))


def test_max_new_tokens_past_the_context_stops_at_the_context(
    endpoint: RuntimeEndpoint, engine: Any
) -> None:
    """Not an error: generation ends with finish_reason {"type": "length", "length": n} once
    prompt + output fill the context (here 240 + 16 = 256)."""
    prompt = ids(CONTEXT - 16)
    params = {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}  # 540 slots fit
    out = endpoint.generate(input_ids=prompt, sampling_params=params)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 16}
    want = engine.generate(input_ids=prompt, sampling_params={**params, "max_new_tokens": 16})
    assert out["output_ids"] == want["output_ids"]
    wait_idle(endpoint)


def test_max_new_tokens_past_the_context_is_not_measured_against_the_pool(
    endpoint: RuntimeEndpoint,
) -> None:
    """The same request with max_new_tokens=500: it can never hold more than context_length
    (256) slots, which the 600-slot pool has, yet the scheduler refuses it for needing
    prompt + max_new_tokens = 740 slots. It must behave like max_new_tokens=300."""
    params = {"max_new_tokens": 500, "temperature": 0, "ignore_eos": True}
    out = endpoint.generate(input_ids=ids(CONTEXT - 16), sampling_params=params)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 16}
    wait_idle(endpoint)


def test_more_requests_than_max_running_queue_and_all_finish(
    endpoint: RuntimeEndpoint, engine: Any
) -> None:
    """Eight generates and a score of six prefill requests at once: at most two run, the rest
    wait in the queue, and every one finishes with the Engine's answer."""
    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(8)]
    want = engine.generate(prompts, GREEDY)
    seen = {"running": 0, "waiting": 0}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            stats = endpoint.stats()
            seen["running"] = max(seen["running"], stats.get("running_requests", 0))
            seen["waiting"] = max(seen["waiting"], stats.get("waiting_requests", 0))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(9) as pool:
            score = pool.submit(endpoint.score, "The sky is", [" blue", " red", " loud"], True)
            outs = list(pool.map(lambda p: endpoint.generate(p, GREEDY), prompts))
            choices = score.result()
    finally:
        done.set()
        watcher.join()
    assert [o["output_ids"] for o in outs] == [w["output_ids"] for w in want]
    assert [c["text"] for c in choices] == [" blue", " red", " loud"]
    assert all(c["unconditional_logprobs"] is not None for c in choices)
    assert seen["running"] <= MAX_RUNNING, seen
    assert seen["waiting"] >= 1, seen  # they did queue
    wait_idle(endpoint)


def raw_exchange(address: str, frame: bytes) -> m.Error | m.Result:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send(frame)
        assert sock.poll(15000), "no reply"
        return codec.decode(sock.recv(), m.CLIENT_REPLIES)
    finally:
        sock.close()


def health_frame(size: int) -> bytes:
    """A valid health request of exactly `size` bytes (its rid pads it)."""
    body = {"v": m.PROTOCOL_VERSION, "t": "health", "rid": ""}
    overhead = len(msgpack.packb(body))
    for pad in range(size - overhead - 4, size - overhead + 1):  # str header of 1 to 3 bytes
        frame = msgpack.packb({**body, "rid": "r" * pad})
        if len(frame) == size:
            return frame
    raise AssertionError(f"no health frame of {size} bytes")


def test_frame_past_the_size_limit_is_refused_unread(runtime: Server) -> None:
    """A frame of max_message_bytes is served; one byte more gets `too_large` (refused before
    unpacking), and the server keeps serving."""
    at_limit = raw_exchange(runtime.address, health_frame(MAX_MESSAGE_BYTES))
    assert isinstance(at_limit, m.Result) and at_limit.data["ok"], at_limit
    past = raw_exchange(runtime.address, health_frame(MAX_MESSAGE_BYTES + 1))
    assert isinstance(past, m.Error) and past.code == m.ERROR_TOO_LARGE, past
    assert f"exceeds {MAX_MESSAGE_BYTES}" in past.message
    assert runtime.endpoint.health()["ok"]


def test_client_call_past_the_size_limit_fails_at_once(endpoint: RuntimeEndpoint) -> None:
    """Through RuntimeEndpoint the same refusal must reach the caller as `too_large`, not as a
    timeout: the server's error for an oversized frame carries rid "", so the client cannot
    match it to the waiting call, which hangs until its timeout (forever with math.inf)."""
    start = time.monotonic()
    message = refused(
        lambda: endpoint.generate("word " * MAX_MESSAGE_BYTES, GREEDY, timeout=8),
        m.ERROR_TOO_LARGE,
    )
    assert time.monotonic() - start < 5, message


@pytest.mark.slow  # 25 s: it waits out a grammar built to be slow
def test_slow_grammar_does_not_stall_other_constrained_requests(
    endpoint: RuntimeEndpoint, engine: Any
) -> None:
    """A grammar whose compilation takes minutes (a counted repetition of 100,000; a JSON
    schema with a large maxLength is another) must not hold up every later constrained
    request: today one compile worker serves them all, with no time limit. Last in this
    module: while this fails, the compile keeps the scheduler's grammar worker busy."""
    slow: dict[str, Any] = {}

    def compile_slow() -> None:
        try:
            slow["out"] = endpoint.generate("Say a", {"regex": "a{0,100000}"}, timeout=25)
        except RuntimeEndpointError as e:
            slow["code"] = e.code

    thread = threading.Thread(target=compile_slow)
    thread.start()
    try:
        wait_for(lambda: endpoint.stats()["waiting_requests"] == 1, 30, "the slow grammar queued")
        params = {"max_new_tokens": 8, "temperature": 0, "regex": "(yes|no)"}
        want = engine.generate("Is water wet? Answer:", params)
        start = time.monotonic()
        out = endpoint.generate("Is water wet? Answer:", params, timeout=20)
        assert out["text"] == want["text"] and time.monotonic() - start < 20
    finally:
        thread.join(30)
    assert slow, "the slow grammar's request never ended"
