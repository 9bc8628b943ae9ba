"""The HTTP door against a live server over loopback (raw httpx): SGLang's native routes, errors
with their statuses while a stream runs, a fuzz of random bodies, dropped and stalled clients,
/metrics, the frontend's http:// RuntimeEndpoint, and SIGTERM (last: it stops the server)."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from fuzz_schema import Limits
from http_fuzz import Case, fuzz_case
from prometheus_client.parser import text_string_to_metric_families

import radixflow as sgl
from conftest import SUITE_CACHE, Server
from radixflow.backend import RuntimeEndpoint, RuntimeEndpointError
from radixflow.runtime.models.loader import resolve_model_dir

API_KEY = "http-secret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MESSAGE_BYTES = 1 << 20
HTTP_FUZZ_CASES = int(os.environ.get("HTTP_FUZZ_CASES", "1000"))
GREEDY = {"max_new_tokens": 6, "temperature": 0}
LONG = {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}


SERVER = dict(  # conftest's module-scoped `runtime`
    max_total_tokens=8192,
    # the fuzz compares one prompt's greedy reply before and after: the exact mode's results
    # do not depend on which requests share a step, the int8 mode's move with the rows of
    # each matmul (one-row integer path, tiles, a bf16 pass), as llama.cpp's and vLLM's do
    quantized_activations="fp32",
    self_check=True,
    api_key=API_KEY,
    max_message_bytes=MAX_MESSAGE_BYTES,
    num_threads=1,  # one torch thread: two oversubscribe a shared 2-core machine
    log_level="warning",
)


@pytest.fixture(scope="module")
def http(runtime: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=runtime.url, headers=AUTH, timeout=60) as client:
        yield client


def stats(http: httpx.Client) -> dict[str, Any]:
    return http.get("/server_info").json()["internal_states"][0]


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def wait_idle(http: httpx.Client, min_aborted: int = 0) -> dict[str, Any]:
    """Stats once nothing runs; asserts the KV is all free or in the tree (no leak)."""

    def idle() -> dict | None:
        s = stats(http)
        done = (
            s["running_requests"] == 0
            and s["waiting_requests"] == 0
            and s["server"]["requests_in_flight"] == 0
            and s.get("aborted_requests", 0) >= min_aborted
            and s["idle_check"] is not None
        )
        return s if done else None

    s = wait_for(idle, 60, "an idle server")
    assert s["idle_check"] == "ok", s["idle_check"]
    assert s["free_slots"] + s["tokens_in_tree"] == s["total_slots"], s
    return s


def sse_events(response: httpx.Response) -> list[Any]:
    """The data of every event; '[DONE]' stays a string."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ---- SGLang's native API -----------------------------------------------------------------


def test_ready_line_gives_both_doors(runtime: Server) -> None:
    assert runtime.url.startswith("http://127.0.0.1:")
    assert runtime.address.startswith("tcp://127.0.0.1:")
    assert runtime.url.rsplit(":", 1)[1] != runtime.address.rsplit(":", 1)[1]


def test_generate_single_equals_zeromq(runtime: Server, http: httpx.Client) -> None:
    body = {"text": "The capital of France is", "sampling_params": GREEDY}
    out = http.post("/generate", json=body).json()
    zmq = runtime.endpoint.generate(body["text"], GREEDY)
    assert out["text"] == zmq["text"] and out["output_ids"] == zmq["output_ids"]
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == len(out["output_ids"])
    assert meta["finish_reason"]["type"] in ("length", "stop") and "cached_tokens" in meta


def test_generate_batch_and_input_ids(http: httpx.Client) -> None:
    texts = ["One, two,", "Red, green,", "Monday, Tuesday,"]
    batch = http.post("/generate", json={"text": texts, "sampling_params": GREEDY}).json()
    singles = [
        http.post("/generate", json={"text": t, "sampling_params": GREEDY}).json() for t in texts
    ]
    assert [b["text"] for b in batch] == [s["text"] for s in singles]
    by_ids = http.post(
        "/generate",
        json={"input_ids": [batch[0]["output_ids"]], "sampling_params": {"max_new_tokens": 2}},
    ).json()
    assert isinstance(by_ids, list) and len(by_ids) == 1
    assert by_ids[0]["meta_info"]["prompt_tokens"] == len(batch[0]["output_ids"])


def test_generate_logprobs_in_sglang_shape(http: httpx.Client) -> None:
    """What SGLang's select sends: a batch, input logprobs from logprob_start_len, texts."""
    prefix = "The sky is"
    first = http.post("/generate", json={"text": prefix, "sampling_params": {"max_new_tokens": 0}})
    prompt_len = first.json()["meta_info"]["prompt_tokens"]
    body = {
        "text": [prefix + c for c in (" blue", " green")],
        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        "return_logprob": True,
        "return_text_in_logprobs": True,
        "logprob_start_len": prompt_len - 2,
    }
    outs = http.post("/generate", json=body).json()
    blue, green = (o["meta_info"]["input_token_logprobs"] for o in outs)
    assert len(blue) == 3 and [e[2] for e in blue] == [" sky", " is", " blue"]
    assert all(isinstance(e[0], float) and isinstance(e[1], int) for e in blue)
    assert blue[-1][0] > green[-1][0]  # the sky is blue, not green
    top = http.post(
        "/generate",
        json={
            "text": prefix,
            "sampling_params": GREEDY,
            "top_logprobs_num": 3,
            "return_text_in_logprobs": True,
        },
    )
    meta = top.json()["meta_info"]
    assert len(meta["output_top_logprobs"]) == len(meta["output_token_logprobs"])
    assert all(len(pos) == 3 and isinstance(pos[0][2], str) for pos in meta["output_top_logprobs"])


def test_generate_stream_text_cumulative_logprobs_incremental(http: httpx.Client) -> None:
    """Text and ids grow; each event's logprob entries are its own tokens only (SGLang's
    form), `output_token_logprobs_length` counting all so far; together they are the
    unstreamed answer's."""
    body = {
        "text": "Count: 1, 2,",
        "sampling_params": {**GREEDY, "max_new_tokens": 8},
        "stream": True,
        "return_logprob": True,
    }
    with http.stream("POST", "/generate", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]" and len(events) >= 3
    chunks = events[:-1]
    for before, after in zip(chunks, chunks[1:]):
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
    last = chunks[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    streamed = [e for c in chunks for e in c["meta_info"].get("output_token_logprobs", [])]
    counted = 0
    for chunk in chunks:
        counted += len(chunk["meta_info"].get("output_token_logprobs", []))
        assert chunk["meta_info"].get("output_token_logprobs_length", counted) == counted
    plain = http.post("/generate", json={**body, "stream": False}).json()
    assert last["text"] == plain["text"] and last["output_ids"] == plain["output_ids"]
    assert [e[1] for e in streamed] == plain["output_ids"]
    logprobs = [e[0] for e in plain["meta_info"]["output_token_logprobs"]]
    assert [e[0] for e in streamed] == pytest.approx(logprobs, abs=1e-3)  # another run


def test_info_health_flush_and_aliases(runtime: Server, http: httpx.Client) -> None:
    # the server was started with "smollm2": the GGUF converted into the suite's cache
    smollm2 = str(resolve_model_dir("smollm2"))
    assert smollm2.startswith(str(SUITE_CACHE))
    for path in ("/get_model_info", "/model_info"):
        info = http.get(path).json()
        assert info["model_path"] == info["tokenizer_path"] == smollm2
        assert info["is_generation"] is True and info["context_length"] > 0
    for path in ("/get_server_info", "/server_info"):
        info = http.get(path).json()
        assert "api_key" not in info and info["max_total_tokens"] == 8192
        assert info["internal_states"][0]["total_slots"] > 0
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    flushed = http.post("/flush_cache")
    assert flushed.status_code == 200 and "flushed" in flushed.text.lower()
    assert http.get("/flush_cache").status_code == 200  # SGLang answers GET too
    join = http.post("/concate_and_append_request", json={"src_rids": ["a"], "dst_rid": "b"})
    assert join.status_code == 200


def test_abort_request_by_rid(http: httpx.Client) -> None:
    before = stats(http).get("aborted_requests", 0)
    body = {"text": "Count to a thousand:", "sampling_params": LONG, "rid": "abort-me"}
    result: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: result.update(http.post("/generate", json=body).json())
    )
    thread.start()
    wait_for(lambda: stats(http)["running_requests"] > 0, 60, "the request to run")
    aborted = http.post("/abort_request", json={"rid": "abort-me"})
    assert aborted.status_code == 200 and aborted.json()["aborted"] == ["abort-me"]
    thread.join(30)
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert http.post("/abort_request", json={"rid": "abort-me"}).json()["aborted"] == []
    wait_idle(http, before + 1)


# ---- errors ------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Hi"}]
BAD_REQUESTS: list[tuple[str, str, Any, int]] = [
    # (method, path, body: JSON value, or bytes sent as they are, expected status)
    ("POST", "/generate", b"{not json", 400),
    ("POST", "/generate", b"\xff\xfe\x00", 400),
    ("POST", "/generate", [1, 2], 400),
    ("POST", "/generate", {"text": 5}, 400),
    ("POST", "/generate", {"text": "a", "input_ids": [1]}, 400),
    ("POST", "/generate", {"sampling_params": {}}, 400),
    ("POST", "/generate", {"input_ids": ["a"]}, 400),
    ("POST", "/generate", {"input_ids": [10**9]}, 400),
    ("POST", "/generate", {"text": ""}, 400),
    ("POST", "/generate", {"text": []}, 400),
    ("POST", "/generate", {"text": "a", "sampling_params": 3}, 400),
    ("POST", "/generate", {"text": "a", "sampling_params": {"temperature": -1}}, 400),
    ("POST", "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 10**9}}, 400),
    ("POST", "/generate", {"text": "a", "sampling_params": {"max_new_tokens": "8"}}, 400),
    ("POST", "/generate", {"text": "a", "sampling_params": {"top_p": 0}}, 400),
    ("POST", "/generate", {"text": "a", "sampling_params": {"stop": [1, 2]}}, 400),
    ("POST", "/generate", {"text": "a", "sampling_params": {"n": 0}}, 400),
    ("POST", "/generate", {"text": "a", "sampling_params": {"regex": "("}}, 400),
    ("POST", "/generate", {"text": "a", "sampling_params": {"json_schema": "{oops"}}, 400),
    ("POST", "/generate", {"text": "a", "stream": "yes"}, 400),
    ("POST", "/generate", {"text": "a", "logprob_start_len": 10**6}, 400),
    ("POST", "/generate", {"text": "a", "top_logprobs_num": 1000}, 400),
    ("POST", "/generate", {"text": "a", "return_hidden_states": True}, 400),
    ("POST", "/generate", {"text": "hi " * 9000}, 400),
    ("POST", "/generate", {"text": "x" * (MAX_MESSAGE_BYTES + 10)}, 413),
    ("GET", "/generate", None, 405),
    ("GET", "/no_such_route", None, 404),
    ("POST", "/abort_request", {"rid": 7}, 400),
    ("POST", CHAT, {"model": "gpt-9", "messages": MSGS}, 404),
    ("POST", CHAT, {"model": "smollm2"}, 400),
    ("POST", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("POST", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400),
    ("POST", CHAT, {"messages": MSGS, "max_tokens": -1}, 400),
    ("POST", CHAT, {"messages": MSGS, "n": 100}, 400),
    ("POST", CHAT, {"messages": MSGS, "response_format": {"type": "yaml"}}, 400),
    (
        "POST",
        CHAT,
        {
            "messages": MSGS,
            "response_format": {"type": "json_schema", "json_schema": {"schema": 3}},
        },
        400,
    ),
    ("POST", CHAT, {"messages": MSGS, "top_logprobs": 3}, 400),
    ("POST", CHAT, {"messages": MSGS, "temperature": "hot"}, 400),
    ("POST", CHAT, {"messages": MSGS, "stream_options": {"include_usage": "yes"}}, 400),
    ("POST", "/v1/completions", {"prompt": 5}, 400),
    ("POST", "/v1/completions", {"prompt": "a", "logprobs": 10}, 400),
    ("POST", "/v1/completions", {"prompt": "a", "echo": True, "stream": True}, 400),
    ("GET", "/v1/models/gpt-9", None, 404),
]


def send(http: httpx.Client, method: str, path: str, body: Any, **kw: Any) -> httpx.Response:
    if isinstance(body, bytes):
        return http.request(method, path, content=body, **kw)
    return http.request(method, path, json=body, **kw)


def test_bad_requests_get_their_status_while_a_stream_completes(http: httpx.Client) -> None:
    assert len(BAD_REQUESTS) >= 30
    done: dict[str, Any] = {}

    def stream() -> None:
        body = {
            "text": "Count to a hundred:",
            "stream": True,
            "sampling_params": {**LONG, "max_new_tokens": 40},
        }
        with http.stream("POST", "/generate", json=body) as response:
            done["events"] = sse_events(response)

    thread = threading.Thread(target=stream)
    thread.start()
    wrong = []
    for method, path, body, status in BAD_REQUESTS:
        response = send(http, method, path, body)
        message = response.json().get("error", {}).get("message")
        if response.status_code != status or not message:
            wrong.append((method, path, str(body)[:60], response.status_code, response.text[:80]))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for path in ("/generate", "/metrics", "/v1/models", "/server_info"):  # not /health*
            response = httpx.get(str(http.base_url).rstrip("/") + path, headers=headers)
            if response.status_code != 401:
                wrong.append(("GET", path, headers, response.status_code, response.text[:80]))
    thread.join(120)
    assert not wrong, wrong
    events = done["events"]
    assert events[-1] == "[DONE]" and events[-2]["meta_info"]["completion_tokens"] == 40
    wait_idle(http)


def test_fuzz_bodies_get_the_statuses_the_docs_give_and_leave_the_server_clean(
    runtime: Server, http: httpx.Client
) -> None:
    """1,000 seeded bodies (http_fuzz: valid ones and every kind of wrong one) to /generate
    and the two /v1 routes: each gets a status its own oracle allows (from the docs, not the
    server's code) and an error body on a refusal; after them the server answers a greedy
    request as before and holds no KV. FUZZ_SEED=n explores other bodies."""
    info = http.get("/get_model_info").json()
    limits = Limits(info["vocab_size"], info["context_length"], info["max_new_tokens_limit"])
    served = http.get("/v1/models").json()["data"][0]["id"]
    rng = random.Random(int(os.environ.get("FUZZ_SEED", "35")))
    cases = [fuzz_case(rng, limits, served, MAX_MESSAGE_BYTES) for _ in range(HTTP_FUZZ_CASES)]
    before = http.post("/generate", json={"text": "The sky is", "sampling_params": GREEDY})

    def one(case: Case) -> tuple[Case, int, str]:
        headers = {} if case.content_type is None else {"Content-Type": case.content_type}
        response = http.post(case.path, content=case.content, headers=headers)
        return case, response.status_code, response.text

    start = time.monotonic()
    with ThreadPoolExecutor(16) as pool:  # valid ones share the scheduler's steps
        answers = list(pool.map(one, cases))
    elapsed = time.monotonic() - start
    wrong = [
        (case.path, case.content_type, str(case.body)[:160], status, text[:160])
        for case, status, text in answers
        if status not in case.statuses or (status != 200 and "error" not in json.loads(text))
    ]
    counts = Counter(status for _, status, _ in answers)
    print(f"\nHTTP fuzz: {len(cases)} bodies in {elapsed:.1f}s, statuses {dict(counts)}")
    assert not wrong, f"{len(wrong)} answers the docs do not allow: {wrong[:20]}"
    assert counts[200] > 150 and counts[400] > 400 and counts[404] and counts[413]
    after = http.post("/generate", json={"text": "The sky is", "sampling_params": GREEDY})
    assert after.json()["output_ids"] == before.json()["output_ids"]
    wait_idle(http)


# ---- disconnects, slow clients, metrics --------------------------------------------------


def test_dropped_stream_frees_its_kv(http: httpx.Client) -> None:
    before = stats(http).get("aborted_requests", 0)
    body = {"text": "Count to a thousand:", "sampling_params": LONG, "stream": True}
    with http.stream("POST", "/generate", json=body) as response:
        for n, _ in enumerate(response.iter_lines()):
            if n >= 6:
                break  # leaving the block closes the connection mid-stream
    started = time.monotonic()
    wait_idle(http, before + 1)
    assert time.monotonic() - started < 10


def test_stalled_client_does_not_block_others(runtime: Server, http: httpx.Client) -> None:
    """A client that never reads its stream: the others are served meanwhile."""
    host, port = runtime.url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps(
        {
            "text": "Count to a thousand:",
            "stream": True,
            "sampling_params": {**LONG, "max_new_tokens": 300},
        }
    ).encode()
    head = (
        f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    stalled = socket.create_connection((host, int(port)))
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    stalled.sendall(head + body)
    wait_for(lambda: stats(http)["running_requests"] > 0, 60, "the stalled stream to run")
    started = time.monotonic()
    out = http.post("/generate", json={"text": "Hello", "sampling_params": GREEDY}).json()
    assert out["meta_info"]["completion_tokens"] > 0 and time.monotonic() - started < 30
    stalled.close()
    wait_idle(http)


def metric_values(http: httpx.Client) -> dict[tuple[str, tuple], float]:
    response = http.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def test_metrics_parse_and_move(http: httpx.Client) -> None:
    before = metric_values(http)
    length = ("radixflow:num_requests_total", (("outcome", "length"),))
    prompt = "Metrics are moving along"
    out = http.post(
        "/generate",
        json={"text": prompt, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}},
    ).json()
    after = metric_values(http)
    assert after[length] == before.get(length, 0) + 1
    tokens = ("radixflow:generation_tokens_total", (("outcome", "length"),))
    assert after[tokens] == before.get(tokens, 0) + 3
    key = ("radixflow:prompt_tokens_total", ())
    assert after[key] == before[key] + out["meta_info"]["prompt_tokens"]
    ttft = ("radixflow:time_to_first_token_seconds_count", ())
    assert after[ttft] == before.get(ttft, 0) + 1
    e2e = ("radixflow:e2e_request_latency_seconds_count", ())
    assert after[e2e] == before.get(e2e, 0) + 1
    slots = [after[("radixflow:kv_slots", (("state", s),))] for s in ("used", "evictable", "free")]
    assert sum(slots) == 8192 and all(v >= 0 for v in slots)
    for name in (
        "radixflow:cached_tokens_total",
        "radixflow:preemptions_total",
        "radixflow:num_running_reqs",
        "radixflow:num_queue_reqs",
    ):
        assert (name, ()) in after


# ---- the frontend over http:// -----------------------------------------------------------


def test_frontend_runtime_endpoint_over_http(runtime: Server) -> None:
    with pytest.raises(RuntimeEndpointError) as info:
        RuntimeEndpoint(runtime.url).model_info()
    assert info.value.code == "unauthorized"
    endpoint = RuntimeEndpoint(runtime.url, api_key=API_KEY)
    assert endpoint.get_model_name() == runtime.endpoint.get_model_name()
    assert endpoint.get_server_info()["internal_states"][0]["total_slots"] > 0

    @sgl.function
    def pick(s: Any) -> None:
        s += "The sky is " + sgl.select("colour", choices=["blue", "green"])
        s += ". It is " + sgl.gen("rest", max_tokens=5, temperature=0)

    over_http = pick.run(backend=endpoint)
    over_zmq = pick.run(backend=runtime.endpoint)
    assert over_http["colour"] == over_zmq["colour"] == "blue"
    assert over_http["rest"] == over_zmq["rest"]
    streamed = list(endpoint.generate_stream("Hello", GREEDY))
    assert (
        streamed[-1]["finished"]
        and streamed[-1]["text"] == endpoint.generate("Hello", GREEDY)["text"]
    )
    assert endpoint.flush_cache() is True
    endpoint.close()


# ---- SIGTERM (last: it stops the module's server) ----------------------------------------


@pytest.mark.slow  # 30 s; the default suite drains HTTP streams in test_drain.py
def test_sigterm_gives_every_http_client_a_final_answer(
    runtime: Server, http: httpx.Client
) -> None:
    answers: list[Any] = []

    def plain() -> None:
        response = http.post("/generate", json={"text": "Count:", "sampling_params": LONG})
        answers.append(("plain", response.status_code, response.json()))

    def stream() -> None:
        body = {"text": "Count:", "sampling_params": LONG, "stream": True}
        with http.stream("POST", "/generate", json=body) as response:
            answers.append(("stream", response.status_code, sse_events(response)))

    threads = [threading.Thread(target=f) for f in (plain, plain, stream, stream)]
    for thread in threads:
        thread.start()
    wait_for(lambda: stats(http)["running_requests"] >= 4, 60, "four requests running")
    runtime.process.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(30)
    assert runtime.process.wait(30) == 0
    assert len(answers) == 4
    for kind, status, data in answers:
        if kind == "plain":
            assert status == 503 and "shutting down" in data["error"]["message"]
        else:
            assert status == 200 and data[-1] == "[DONE]"
            assert "shutting down" in data[-2]["error"]["message"]
