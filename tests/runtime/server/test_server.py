"""The runtime server against real processes on loopback: one server for the module (API key
on, self-check on, small pool), the session's offline Engine as the reference."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack
import psutil
import pytest
import zmq

from conftest import Server
from radixflow.backend import RuntimeEndpoint, RuntimeEndpointError
from radixflow.runtime.protocol import codec
from radixflow.runtime.protocol import messages as m
from radixflow.runtime.server.jobs import visible_text

API_KEY = "test-secret"
MAX_MESSAGE_BYTES = 1 << 20
GREEDY = {"max_new_tokens": 8, "temperature": 0}
LONG = {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}
WORDS = "alpha beta gamma delta river stone cloud music paper light seven blue".split()


def prompts(count: int) -> list[str]:
    return [
        " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(3 + i % 9)) for i in range(count)
    ]


SERVER = dict(  # conftest's module-scoped `runtime`
    max_total_tokens=8192,
    kv_cache_dtype="fp32",  # logprobs held to the session engine's exact pool
    quantized_activations="fp32",  # and its exact matmuls
    self_check=True,
    api_key=API_KEY,
    max_message_bytes=MAX_MESSAGE_BYTES,
    num_threads=1,  # one torch thread: two oversubscribe a shared 2-core machine
    log_level="warning",
)


@pytest.fixture(scope="module")
def endpoint(runtime: Server) -> RuntimeEndpoint:
    return runtime.endpoint


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def wait_idle(endpoint: RuntimeEndpoint, min_aborted: int = 0, timeout: float = 30) -> dict:
    """Stats once nothing runs; asserts the KV is all free or in the tree (no leak)."""

    def idle() -> dict | None:
        s = endpoint.stats()
        done = (
            s["running_requests"] == 0
            and s["waiting_requests"] == 0
            and s["server"]["requests_in_flight"] == 0
            and s["aborted_requests"] >= min_aborted
            and s["idle_check"] is not None
        )
        return s if done else None

    s = wait_for(idle, timeout, "an idle scheduler")
    assert s["idle_check"] == "ok", s["idle_check"]
    assert s["protected_tokens"] == 0 and s["evictable_tokens"] == s["tokens_in_tree"]
    assert s["free_slots"] == s["total_slots"] - s["evictable_tokens"], s
    return s


def collect_stream(endpoint: RuntimeEndpoint, prompt: str, params: dict, **kwargs: Any) -> dict:
    """Stream to the end, checking the chunk contract; returns the final item."""
    previous = {"text": "", "output_ids": []}
    for chunk in endpoint.generate_stream(prompt, params, **kwargs):
        if chunk["finished"]:
            return chunk
        assert chunk["text"].startswith(previous["text"])
        assert chunk["output_ids"][: len(previous["output_ids"])] == previous["output_ids"]
        previous = chunk
    raise AssertionError("the stream ended without a final item")


# ---- correctness under concurrency ---------------------------------------------------------


def test_200_requests_from_8_threads_match_the_engine(endpoint, engine) -> None:
    texts = prompts(25)
    expected = engine.generate(texts, GREEDY)

    def run(i: int) -> tuple[int, dict]:
        prompt = texts[i % len(texts)]
        if i % 2:
            return i, endpoint.generate(prompt, GREEDY)
        return i, collect_stream(endpoint, prompt, GREEDY)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(200)))
    assert len(results) == 200
    for i, out in results:
        want = expected[i % len(texts)]
        assert out["text"] == want["text"], (i, out["text"], want["text"])
        assert out["output_ids"] == want["output_ids"]
        assert out["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    stats = wait_idle(endpoint)
    assert stats["cached_tokens"] > 0  # the repeated prompts hit the radix cache


def test_stats_read_after_a_reply_count_that_request(endpoint) -> None:
    # The scheduler's stats reach the server ahead of the final reply they describe.
    for i, prompt in enumerate(prompts(12)):
        before = endpoint.stats()
        out = endpoint.generate(f"{i} {prompt}", {"max_new_tokens": 1, "temperature": 0})
        after = endpoint.stats()
        meta = out["meta_info"]
        assert after["prompt_tokens"] - before["prompt_tokens"] == meta["prompt_tokens"], i
        assert after["cached_tokens"] - before["cached_tokens"] == meta["cached_tokens"], i


def test_logprobs_and_score_match_the_engine(runtime, endpoint, engine) -> None:
    prompt = "The capital of France is"
    kwargs = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
    want = engine.generate(prompt, GREEDY, **kwargs)
    got = endpoint.generate(prompt, GREEDY, **kwargs)
    for key in ("output_token_logprobs", "input_token_logprobs"):
        assert [t for _, t, _ in got["meta_info"][key]] == [t for _, t, _ in want["meta_info"][key]]
        pairs = zip(got["meta_info"][key], want["meta_info"][key])
        assert all(a[0] == b[0] or abs(a[0] - b[0]) < 1e-3 for a, b in pairs)
    streamed = collect_stream(endpoint, prompt, GREEDY, return_logprob=True)
    assert len(streamed["meta_info"]["output_token_logprobs"]) <= 1  # only the last chunk's

    continuations = [" Paris", " the city of London", " Berlin."]
    choices = endpoint.score(prompt, continuations, unconditional=True)
    tok = engine.tokenizer
    prefix_ids = tok.encode(prompt, add_special_tokens=False)
    cont_ids = [tok.encode(text, add_special_tokens=False) for text in continuations]
    prefill = {"sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
    after_prefix = engine.generate(
        input_ids=[prefix_ids + ids for ids in cont_ids],
        logprob_start_len=len(prefix_ids),
        **prefill,
    )
    alone = engine.generate(input_ids=cont_ids, logprob_start_len=0, **prefill)
    for i, choice in enumerate(choices):
        assert choice["text"] == continuations[i] and choice["token_ids"] == cont_ids[i]
        ref = [lp for lp, _, _ in after_prefix[i]["meta_info"]["input_token_logprobs"]]
        assert choice["logprobs"] == pytest.approx(ref, abs=1e-3)
        ref = [lp for lp, _, _ in alone[i]["meta_info"]["input_token_logprobs"][1:]]
        assert choice["unconditional_logprobs"][0] == 0.0  # no context for the first token
        assert choice["unconditional_logprobs"][1:] == pytest.approx(ref, abs=1e-3)
    info = endpoint.model_info()
    assert info["context_length"] > 0 and info["chat_template"] and info["eos_token_ids"]
    assert runtime.get_tokenizer().encode(prompt) == tok.encode(prompt)
    assert runtime.generate(prompt, GREEDY)["output_ids"] == want["output_ids"]
    wait_idle(endpoint)


def test_streamed_text_never_shows_a_stop_string(endpoint, engine) -> None:
    prompt, params = (
        "Count: 1, 2, 3, 4, 5,",
        {"max_new_tokens": 12, "temperature": 0, "stop": [", 8"]},
    )
    want = engine.generate(prompt, params)
    chunks = list(endpoint.generate_stream(prompt, params))
    assert chunks[-1]["text"] == want["text"] and chunks[-1]["output_ids"] == want["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": ", 8"}
    assert all(want["text"].startswith(c["text"]) for c in chunks)
    assert visible_text(" 6, 7, ", (", 8",)) == " 6, 7" and visible_text("a, 8b", (", 8",)) == "a"


# ---- bad input -----------------------------------------------------------------------------


def frame(api_key: str | None = API_KEY, **body: Any) -> list[bytes]:
    body = {"v": m.PROTOCOL_VERSION, "t": "generate", "rid": "bad", **body}
    if api_key is not None:
        body["key"] = api_key
    return [msgpack.packb(body)]


def generate_frame(**fields: Any) -> list[bytes]:
    return frame(**{"text": "Hello", "sampling_params": {"max_new_tokens": 4}, **fields})


BAD_INPUTS: list[tuple[str, list[bytes], set[str]]] = [
    ("duplicate rid", generate_frame(rid="the-stream"), {m.ERROR_DUPLICATE_RID}),
    ("malformed msgpack", [b"\xc1\xc1"], {m.ERROR_BAD_MESSAGE}),
    ("truncated msgpack", [generate_frame()[0][:-3]], {m.ERROR_BAD_MESSAGE}),
    ("frame is a list", [msgpack.packb([1, 2, 3])], {m.ERROR_BAD_MESSAGE}),
    ("frame is a string", [msgpack.packb("generate")], {m.ERROR_BAD_MESSAGE}),
    ("two frames", generate_frame() * 2, {m.ERROR_BAD_MESSAGE}),
    ("nesting bomb", [b"\x91" * 100_000 + b"\xc0"], {m.ERROR_BAD_MESSAGE}),
    ("missing version", [msgpack.packb({"t": "health", "rid": "bad"})], {m.ERROR_BAD_VERSION}),
    ("wrong version", frame(v=2, t="health"), {m.ERROR_BAD_VERSION}),
    ("unknown type", frame(t="explode"), {m.ERROR_UNKNOWN_TYPE}),
    ("ipc-only type", frame(t="shutdown"), {m.ERROR_UNKNOWN_TYPE}),
    (
        "missing rid",
        [msgpack.packb({"v": 1, "t": "health", "key": API_KEY})],
        {m.ERROR_BAD_MESSAGE},
    ),
    ("text is an int", generate_frame(text=42), {m.ERROR_BAD_MESSAGE}),
    ("unknown field", generate_frame(temperature=0.5), {m.ERROR_BAD_MESSAGE}),
    ("sampling_params a list", generate_frame(sampling_params=[1]), {m.ERROR_BAD_MESSAGE}),
    ("bool for an int", generate_frame(top_logprobs_num=True), {m.ERROR_BAD_MESSAGE}),
    ("text and input_ids", generate_frame(input_ids=[1, 2]), {m.ERROR_INVALID_REQUEST}),
    ("empty prompt", generate_frame(text=""), {m.ERROR_INVALID_REQUEST}),
    (
        "token id past vocab",
        generate_frame(text=None, input_ids=[10**9]),
        {m.ERROR_INVALID_REQUEST},
    ),
    (
        "prompt past context",
        generate_frame(text=None, input_ids=[1] * 9000),
        {m.ERROR_INVALID_REQUEST},
    ),
    (
        "temperature 1e9",
        generate_frame(sampling_params={"temperature": 1e9}),
        {m.ERROR_INVALID_REQUEST},
    ),
    ("top_p negative", generate_frame(sampling_params={"top_p": -1}), {m.ERROR_INVALID_REQUEST}),
    (
        "max_new_tokens 1e9",
        generate_frame(sampling_params={"max_new_tokens": 10**9}),
        {m.ERROR_INVALID_REQUEST},
    ),
    (
        "unknown sampling param",
        generate_frame(sampling_params={"temprature": 0}),
        {m.ERROR_INVALID_REQUEST},
    ),
    ("n > 1", generate_frame(sampling_params={"n": 4}), {m.ERROR_INVALID_REQUEST}),
    ("logprob_start_len too big", generate_frame(logprob_start_len=999), {m.ERROR_INVALID_REQUEST}),
    ("top_logprobs_num huge", generate_frame(top_logprobs_num=10**6), {m.ERROR_INVALID_REQUEST}),
    (
        "invalid regex",
        generate_frame(sampling_params={"regex": "([a-z", "max_new_tokens": 4}),
        {m.ERROR_FAILED, m.ERROR_INVALID_REQUEST},
    ),
    (
        "score without continuations",
        frame(t="score", prefix="x", continuations=[]),
        {m.ERROR_INVALID_REQUEST},
    ),
    ("oversized frame", generate_frame(text="x" * (MAX_MESSAGE_BYTES + 10)), {m.ERROR_TOO_LARGE}),
    ("wrong api key", generate_frame(api_key="guess"), {m.ERROR_UNAUTHORIZED}),
    ("no api key", frame(api_key=None, t="health"), {m.ERROR_UNAUTHORIZED}),
]


def raw_reply(address: str, frames: list[bytes], timeout_ms: int = 15000) -> m.Error:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart(frames)
        assert sock.poll(timeout_ms), "no reply"
        return codec.decode(sock.recv(), m.CLIENT_REPLIES)
    finally:
        sock.close()


def test_bad_input_gets_errors_while_a_stream_completes(runtime, endpoint, engine) -> None:
    assert len(BAD_INPUTS) >= 15
    prompt, params = (
        "Once upon a time",
        {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True},
    )
    want = engine.generate(prompt, {**params, "max_new_tokens": 12})  # greedy: a prefix of it
    started, result = threading.Event(), {}

    def stream() -> None:
        for chunk in endpoint.generate_stream(prompt, params, rid="the-stream"):
            started.set()
            result.update(chunk)

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(60)
    for name, frames, codes in BAD_INPUTS:
        reply = raw_reply(runtime.address, frames)
        assert isinstance(reply, m.Error), (name, reply)
        assert reply.code in codes, (name, reply)
        assert reply.rid in ("bad", "the-stream", ""), (name, reply)
    thread.join(120)
    assert result["finished"] and result["output_ids"][:12] == want["output_ids"]
    assert result["text"] == engine.tokenizer.decode(result["output_ids"])
    assert endpoint.health()["ok"]
    wait_idle(endpoint)


# ---- aborts and vanished clients ----------------------------------------------------------


def test_abort_mid_stream_queued_and_closed_iterator_free_the_kv(endpoint) -> None:
    before = endpoint.stats()["aborted_requests"]
    stream = endpoint.generate_stream("Tell me a story.", LONG, rid="abort-me")
    assert [len(next(stream)["output_ids"]) for _ in range(3)] == [1, 2, 3]
    with RuntimeEndpoint(endpoint.address, api_key=API_KEY) as other:
        assert other.abort("abort-me") is True
    last = list(stream)[-1]
    assert last["finished"] and last["meta_info"]["finish_reason"]["type"] == "abort"
    assert endpoint.abort("abort-me") is False  # idempotent

    # a long prompt is still waiting or chunking when its abort arrives
    out: dict = {}
    ids = [(i * 37) % 5000 + 10 for i in range(3000)]
    thread = threading.Thread(
        target=lambda: out.update(
            endpoint.generate(input_ids=ids, sampling_params=GREEDY, rid="chunky")
        )
    )
    thread.start()
    wait_for(lambda: endpoint.abort("chunky"), 30, "the chunked request to arrive")
    thread.join(60)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["completion_tokens"] == 0

    closed = endpoint.generate_stream("Another story.", LONG)
    next(closed), next(closed)
    closed.close()  # sends the abort

    with pytest.raises(RuntimeEndpointError) as info:  # a timed-out call aborts its request
        endpoint.generate("Yet another story.", LONG, timeout=0.5)
    assert info.value.code == m.ERROR_TIMEOUT
    wait_idle(endpoint, min_aborted=before + 4)


CLIENT_SCRIPT = """
import sys
from radixflow.backend import RuntimeEndpoint
endpoint = RuntimeEndpoint(sys.argv[1], api_key=sys.argv[2])
params = {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}
for chunk in endpoint.generate_stream("A very long story:", params):
    print(len(chunk["output_ids"]), flush=True)
"""


def test_killed_client_process_gets_its_request_aborted(endpoint) -> None:
    before = endpoint.stats()
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT_SCRIPT, endpoint.address, API_KEY], stdout=subprocess.PIPE
    )
    try:
        assert client.stdout.readline().strip() == b"1"
        assert endpoint.stats()["server"]["requests_in_flight"] == 1
    finally:
        client.kill()
        client.wait()
    stats = wait_idle(
        endpoint, min_aborted=before["aborted_requests"] + 1, timeout=m.CLIENT_TIMEOUT_S + 20
    )
    timed_out = stats["server"].get("clients_timed_out", 0)
    assert timed_out == before["server"].get("clients_timed_out", 0) + 1


# ---- failures and lifecycle ---------------------------------------------------------------


def test_unreachable_server_raises_quickly() -> None:
    # a port bound by a plain socket and closed: free at once (a ZMQ socket's close is
    # finished by its I/O thread later, so a dial could still reach its listener and see a
    # server lost, not one never reached)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    start = time.monotonic()
    with RuntimeEndpoint(f"tcp://127.0.0.1:{port}", timeout=2.0) as dead:
        with pytest.raises(RuntimeEndpointError, match="cannot reach"):
            dead.health()
    assert time.monotonic() - start < 5


def test_public_bind_without_api_key_refuses_to_start() -> None:
    cmd = [sys.executable, "-m", "radixflow.runtime", "serve", "--host", "0.0.0.0", "--port", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "requires --api-key" in done.stderr
    assert "ready" not in done.stdout


def test_killed_scheduler_fails_requests_fast_then_restarts(endpoint) -> None:
    old_pid = endpoint.health()["scheduler_pid"]
    before = endpoint.generate("Hello", GREEDY)
    started, failure = threading.Event(), {}

    def stream() -> None:
        try:
            for _ in endpoint.generate_stream("Count to a thousand:", LONG):
                started.set()
        except RuntimeEndpointError as e:
            failure.update(code=e.code, at=time.monotonic())

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(60)
    killed_at = time.monotonic()
    os.kill(old_pid, signal.SIGKILL)
    thread.join(10)
    assert failure["code"] == m.ERROR_UNAVAILABLE
    assert failure["at"] - killed_at < 5
    health = endpoint.health()
    assert not health["ok"] and health["status"] == "restarting"
    assert "exited" in health["last_error"]
    start = time.monotonic()
    with pytest.raises(RuntimeEndpointError) as info:
        endpoint.generate("Hello", GREEDY)
    assert info.value.code == m.ERROR_UNAVAILABLE and time.monotonic() - start < 5

    health = wait_for(lambda: (h := endpoint.health())["ok"] and h, 180, "the restart")
    assert health["scheduler_restarts"] == 1 and health["scheduler_pid"] != old_pid
    assert not psutil.pid_exists(old_pid)
    assert endpoint.generate("Hello", GREEDY)["output_ids"] == before["output_ids"]
    wait_idle(endpoint)


# slow: 14 s; the drain on SIGTERM is in the default suite in tests/runtime/server/test_drain.py
@pytest.mark.slow
def test_sigterm_answers_every_client_and_leaves_nothing_behind() -> None:
    # no drain time: what is in flight at SIGTERM is failed at once (test_drain has the drain)
    rt = Server(max_total_tokens=4096, num_threads=1, log_level="warning", shutdown_timeout=0)
    try:
        scheduler = psutil.Process(rt.endpoint.health()["scheduler_pid"])
        cmdline = scheduler.cmdline()
        ipc_dir = cmdline[cmdline.index("--ipc-dir") + 1]
        assert os.path.isdir(ipc_dir)
        children = psutil.Process(rt.process.pid).children(recursive=True)
        assert scheduler in children
        outcomes: list[Any] = [None] * 4
        params = {**LONG, "max_new_tokens": 500}  # all four fit the pool at once

        def client(i: int) -> None:
            try:
                if i % 2:
                    outcomes[i] = rt.endpoint.generate(f"Story {i}:", params)
                else:
                    outcomes[i] = collect_stream(rt.endpoint, f"Story {i}:", params)
            except RuntimeEndpointError as e:
                outcomes[i] = e.code

        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        wait_for(lambda: rt.endpoint.stats().get("running_requests") == 4, 60, "4 running")
        rt.process.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        assert outcomes == [m.ERROR_SHUTDOWN] * 4
        assert rt.process.wait(30) == 0
        assert not os.path.exists(ipc_dir)
        assert not any(psutil.pid_exists(c.pid) and c.status() != "zombie" for c in children)
    finally:
        rt.shutdown()
