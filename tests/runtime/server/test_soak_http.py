"""Soak through the front door: two replicas behind sglang-router, one killed and restarted.

Two `radixflow serve` replicas on 127.0.0.1 with small KV pools (preemption under load), and
`sglang-router launch` in front of them as its own process, set up the way `--dp-size`
launches it (health checks every few seconds, a short circuit-breaker wait; load balanced
once the replicas' loads differ by a few requests, so both take part). SOAK_THREADS
client threads send the requests through the router: native `/generate` plain and streamed,
`/v1/chat/completions` plain, streamed, `n=3` and json_schema, all greedy; 20% of the streams
are dropped by the client mid-way. In the middle of the run replica 1 is SIGKILLed while it
has requests in flight and started again on its port; the router finds it by its health
checks, and the last phase runs once it is back, so the restarted replica serves again.

Every request ends with a complete answer or a clean error: a non-streamed request never fails
(the router retries what the dead replica had, and counts the retries), a stream fails only if
it was in flight on the killed replica, and fails cleanly (an error status, an error event, or
the connection closed before `[DONE]`). Every completed output equals the offline Engine's for
the same prompt. At the end no KV slot is leaked on either replica, and replica 0 (never
killed) has a resident memory (server and scheduler, VmRSS) within 5% of its size after the
warm-up. One line prints the figures.

Both are `-m slow`: a short soak (SOAK_HTTP_SHORT requests), and SOAK_HTTP_REQUESTS (2,000)
asking for at least 300 preemptions.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from conftest import Server, chat, die_with_parent, start_server
from radixflow.runtime.distributed import data_parallel

needs_router = pytest.mark.skipif(
    not data_parallel.importlib.util.find_spec("sglang_router"),
    reason="pip install sglang-router (test extra)",
)

SOAK_THREADS = int(os.environ.get("SOAK_THREADS", "32"))
SOAK_HTTP_REQUESTS = int(os.environ.get("SOAK_HTTP_REQUESTS", "2000"))
SOAK_HTTP_SHORT = int(os.environ.get("SOAK_HTTP_SHORT", "96"))
FULL_MIN_PREEMPTIONS = 300
DROP_SHARE = 0.2  # of the streams
RSS_GROWTH_LIMIT = 0.05
CALL_TIMEOUT_S = 600.0  # a request may wait behind many others on 2 shared cores
REPLICA = dict(
    num_threads=1,
    max_total_tokens=256,  # a few requests' worth: preemption under 16 concurrent ones
    # optimistic admission overcommits the pool, and does so again right after a preemption
    # (with the defaults the reserve falls back over 600 steps: 20 preemptions in 2,000
    # requests; with 0.1 and 10 steps and 320 slots, 149)
    schedule_conservativeness=0.05,
    new_token_ratio_decay_steps=1,
    chunked_prefill_size=128,
    max_preemptions=1000,  # preempted often, never failed for it
    log_level="warning",
    launch_timeout=600.0,
)

QUESTIONS = [
    "What is the capital of Spain?",
    "Name a prime number.",
    "Is the sea salty?",
    "How many legs does a spider have?",
    "What colour is the sky?",
    "Who wrote Hamlet?",
    "Count from one to ten.",
    "Describe a lighthouse.",
]
CONTEXT = (
    "Context: a small town by the sea has a harbour, a lighthouse, a bakery, a school and a "
    "library. The bakery opens at six, the library at nine, and the school at eight.\n"
)
PROMPTS = [f"{CONTEXT}Q: {q}\nA:" for q in QUESTIONS] + ["Once upon a time", "1, 2, 3, 4,"]
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 20}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
LENGTHS = (8, 24, 48)  # max new tokens; the longest ignores EOS (KV pressure)
KINDS = {"generate": 25, "generate_stream": 25, "chat": 15, "chat_stream": 20, "chat_n3": 8}
KINDS["chat_json"] = 7
STREAMED = ("generate_stream", "chat_stream")


@dataclass(frozen=True)
class Spec:
    """One soak request; a dropped stream is closed by the client after `drop_after` chunks."""

    kind: str
    prompt: int  # into PROMPTS (generate) or QUESTIONS (chat)
    length: int
    drop_after: int = 0

    @property
    def params(self) -> dict[str, Any]:
        if self.kind == "chat_json":
            return {"max_new_tokens": 40, "temperature": 0, "json_schema": json.dumps(SCHEMA)}
        return {"max_new_tokens": self.length, "temperature": 0, "ignore_eos": self.length == 48}

    @property
    def text(self) -> str:
        return PROMPTS[self.prompt] if self.kind.startswith("generate") else chat(self.question)

    @property
    def question(self) -> str:
        return QUESTIONS[self.prompt]

    def body(self) -> dict[str, Any]:
        params = self.params
        if self.kind.startswith("generate"):
            stream = self.kind == "generate_stream"
            return {"text": self.text, "sampling_params": params, "stream": stream}
        body: dict[str, Any] = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": self.question}],
            "max_tokens": params["max_new_tokens"],
            "temperature": 0,
            "stream": self.kind == "chat_stream",
        }
        if params.get("ignore_eos"):
            body["ignore_eos"] = True
        if self.kind == "chat_n3":
            body["n"] = 3
        if self.kind == "chat_json":
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": SCHEMA},
            }
        return body


def make_specs(count: int, seed: int) -> list[Spec]:
    rng = random.Random(seed)
    specs = []
    for _ in range(count):
        kind = rng.choices(list(KINDS), list(KINDS.values()))[0]
        prompts = len(PROMPTS) if kind.startswith("generate") else len(QUESTIONS)
        drop = rng.randint(1, 6) if kind in STREAMED and rng.random() < DROP_SHARE else 0
        specs.append(Spec(kind, rng.randrange(prompts), rng.choice(LENGTHS), drop))
    return specs


@dataclass
class Outcome:
    spec: Spec
    kind: str  # completed, dropped, clean_error, wrong
    texts: list[str]
    detail: str = ""


def run_one(http: httpx.Client, url: str, spec: Spec) -> Outcome:
    path = "/generate" if spec.kind.startswith("generate") else "/v1/chat/completions"
    try:
        if spec.kind in STREAMED:
            return read_stream(http, url + path, spec)
        reply = http.post(url + path, json=spec.body())
    except httpx.HTTPError as e:
        return Outcome(spec, "clean_error", [], f"connection: {e!r}")
    if reply.status_code != 200:
        clean = "error" in reply.json() if is_json(reply.text) else False
        return Outcome(spec, "clean_error" if clean else "wrong", [], reply.text[:200])
    data = reply.json()
    if spec.kind == "generate":
        finished = data["meta_info"]["finish_reason"]["type"] in ("stop", "length")
        return Outcome(spec, "completed" if finished else "wrong", [data["text"]], str(data)[:200])
    choices = data["choices"]
    texts = [c["message"]["content"] for c in choices]
    want = 3 if spec.kind == "chat_n3" else 1
    finished = all(c["finish_reason"] in ("stop", "length") for c in choices)
    ok = finished and len(texts) == want
    return Outcome(spec, "completed" if ok else "wrong", texts, str(data)[:200])


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def read_stream(http: httpx.Client, url: str, spec: Spec) -> Outcome:
    """Follow an SSE stream: cumulative text (native) or deltas (chat); drop it on cue."""
    text, finish, chunks = "", None, 0
    with http.stream("POST", url, json=spec.body()) as reply:
        if reply.status_code != 200:
            reply.read()
            kind = "clean_error" if is_json(reply.text) else "wrong"
            return Outcome(spec, kind, [], reply.text[:200])
        try:
            for line in reply.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    kind = "completed" if finish in ("stop", "length") else "wrong"
                    return Outcome(spec, kind, [text], f"finish {finish}")
                data = json.loads(line[6:])
                if "error" in data:
                    return Outcome(spec, "clean_error", [], str(data["error"])[:200])
                chunks += 1
                if spec.kind == "generate_stream":
                    if not data["text"].startswith(text):
                        return Outcome(spec, "wrong", [], "a chunk rewrote earlier text")
                    text = data["text"]
                    finish = (data["meta_info"]["finish_reason"] or {}).get("type")
                else:
                    for choice in data["choices"]:
                        text += choice["delta"].get("content") or ""
                        finish = choice.get("finish_reason") or finish
                if spec.drop_after and chunks == spec.drop_after:
                    return Outcome(spec, "dropped", [], f"closed after {chunks} chunks")
        except httpx.HTTPError as e:  # the replica died mid-stream: the router cut it
            return Outcome(spec, "clean_error", [], f"stream cut: {e!r}")
    return Outcome(spec, "clean_error", [], "the stream ended before [DONE]")


def run_phase(url: str, specs: list[Spec], threads: int = SOAK_THREADS) -> list[Outcome]:
    """Every spec through the router from `threads` clients; bounded: each spec once."""
    todo: queue.Queue[Spec] = queue.Queue()
    for spec in specs:
        todo.put(spec)
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(timeout=CALL_TIMEOUT_S) as http:
            while True:
                try:
                    spec = todo.get_nowait()
                except queue.Empty:
                    return
                outcome = run_one(http, url, spec)
                with lock:
                    outcomes.append(outcome)

    pool = [threading.Thread(target=client) for _ in range(min(threads, len(specs)))]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(CALL_TIMEOUT_S * 3)
    assert not any(thread.is_alive() for thread in pool), "a soak client hangs"
    assert len(outcomes) == len(specs)
    return outcomes


# ---- the cluster ----------------------------------------------------------------------------


class Cluster:
    """Two replicas and sglang-router launched by hand on loopback."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self.stack = stack
        self.replicas = [stack.enter_context(start_server(**REPLICA)) for _ in range(2)]
        port = data_parallel.free_port("127.0.0.1")
        self.metrics_url = f"http://127.0.0.1:{data_parallel.free_port('127.0.0.1')}/metrics"
        cmd = [*data_parallel.router_command(), "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--worker-urls", *[r.url for r in self.replicas], "--policy", "cache_aware"]
        # balance once loads differ by 4 requests: the default (64) lets the shared prefixes
        # send all 32 clients to one replica, and none to the restarted one's empty tree
        cmd += ["--balance-abs-threshold", "4"]
        cmd += ["--prometheus-host", "127.0.0.1"]
        cmd += ["--prometheus-port", self.metrics_url.split(":")[2].split("/")[0]]
        cmd += ["--health-check-interval-secs", str(data_parallel.HEALTH_CHECK_INTERVAL_S)]
        cmd += ["--cb-timeout-duration-secs", str(data_parallel.CIRCUIT_OPEN_S)]
        cmd += ["--log-level", "error"]
        self.router = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, preexec_fn=die_with_parent()
        )
        stack.callback(data_parallel.terminate, [self.router], 30.0)
        self.url = f"http://127.0.0.1:{port}"
        wait_for(lambda: self.healthy() == 2, 120, "the router with both replicas")

    def healthy(self) -> int:
        try:
            workers = httpx.get(f"{self.url}/workers", timeout=10).json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            return 0
        return sum(1 for w in workers if w["is_healthy"])

    def retries(self) -> int:
        text = httpx.get(self.metrics_url, timeout=10).text
        lines = [ln for ln in text.splitlines() if ln.startswith("smg_worker_retries_total")]
        return int(sum(float(ln.rsplit(" ", 1)[1]) for ln in lines))

    def restart(self, index: int) -> None:
        """A new replica on the killed one's HTTP port (the router knows it by its URL)."""
        port = int(self.replicas[index].url.rsplit(":", 1)[1])
        self.replicas[index] = self.stack.enter_context(
            start_server(port=port, zmq_port=0, **REPLICA)
        )


def wait_for(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout:.0f}s")


def stats(replica: Server) -> dict[str, Any]:
    return httpx.get(f"{replica.url}/server_info", timeout=30).json()["internal_states"][0]


def idle_stats(replica: Server) -> dict[str, Any]:
    def idle() -> dict[str, Any] | None:
        s = stats(replica)
        quiet = s["running_requests"] == s["waiting_requests"] == 0
        done = quiet and s["server"]["requests_in_flight"] == 0 and s["idle_check"] is not None
        return s if done else None

    return wait_for(idle, 120, f"replica {replica.url} idle")


def rss(replica: Server) -> int:
    """VmRSS (kB) of the replica's server and scheduler processes."""
    scheduler = httpx.get(f"{replica.url}/health", timeout=10).json()["scheduler_pid"]
    total = 0
    for pid in (replica.process.pid, scheduler):
        with open(f"/proc/{pid}/status") as f:
            total += next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
    return total


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with contextlib.ExitStack() as stack:
        yield Cluster(stack)


def references(engine: Any, specs: list[Spec]) -> dict[tuple[str, int, int], str]:
    """The offline Engine's greedy text for every (kind family, prompt, length) used, one
    batch per sampling parameters."""
    batches: dict[str, dict[tuple[str, int, int], Spec]] = {}
    for spec in specs:
        batches.setdefault(json.dumps(spec.params), {})[reference_key(spec)] = spec
    refs = {}
    for params, todo in batches.items():
        outs = engine.generate([s.text for s in todo.values()], json.loads(params))
        refs.update({key: out["text"] for key, out in zip(todo, outs)})
    return refs


def reference_key(spec: Spec) -> tuple[str, int, int]:
    family = "json" if spec.kind == "chat_json" else spec.kind.split("_")[0]
    return family, spec.prompt, 0 if family == "json" else spec.length


# ---- the soak -------------------------------------------------------------------------------


def served_after_restart(cluster: Cluster, attempts: int = 8) -> int:
    """Requests the restarted replica (1) has served; when the run sent it none (the
    cache-aware policy keeps a prompt where the router's tree matched it, and every soak prompt
    was seen by the survivor), up to `attempts` prompts no replica has seen, one at a time: the
    policy sends those to the replica with the smallest tree, the restarted one."""
    served = lambda: stats(cluster.replicas[1])["server"].get("request_generate", 0)  # noqa: E731
    with httpx.Client(timeout=CALL_TIMEOUT_S) as http:
        for attempt in range(attempts):
            if served():
                break
            body = {
                "text": f"Unseen prompt {attempt} {random.random()}: count to three.",
                "sampling_params": {"max_new_tokens": 2, "temperature": 0},
            }
            assert http.post(cluster.url + "/generate", json=body).status_code == 200
    return served()


def soak(cluster: Cluster, engine: Any, count: int) -> dict[str, Any]:
    warmup, main, last = (
        make_specs(n, seed) for seed, n in enumerate((count // 4, count // 2, count // 4))
    )
    refs = references(engine, warmup + main + last)
    survivor, victim = cluster.replicas
    before = [stats(r) for r in cluster.replicas]
    retries_before = cluster.retries()
    start = time.monotonic()
    outcomes = run_phase(cluster.url, warmup)
    idle_stats(survivor)
    rss_before = rss(survivor)
    phase: list[Outcome] = []
    clients = threading.Thread(target=lambda: phase.extend(run_phase(cluster.url, main)))
    clients.start()
    in_flight = lambda: stats(victim)["server"]["requests_in_flight"]  # noqa: E731
    wait_for(lambda: in_flight() >= 4, 300, "requests in flight on replica 1")
    killed = {**stats(victim), "in_flight": in_flight()}
    victim.process.send_signal(signal.SIGKILL)
    victim.process.wait()
    cluster.restart(1)  # from this thread: a child dies with the thread that started it
    clients.join(CALL_TIMEOUT_S * 3)
    assert not clients.is_alive() and len(phase) == len(main), "the clients did not finish"
    outcomes += phase
    wait_for(lambda: cluster.healthy() == 2, 120, "the router taking the restarted replica back")
    outcomes += run_phase(cluster.url, last)
    elapsed = time.monotonic() - start
    after = [idle_stats(r) for r in cluster.replicas]
    figures = {
        "requests": len(outcomes),
        "elapsed_s": round(elapsed),
        **Counter(o.kind for o in outcomes),
        "retried": cluster.retries() - retries_before,
        "in_flight_at_kill": killed["in_flight"],
        "preemptions": after[0]["preemptions"]
        - before[0]["preemptions"]
        + killed["preemptions"]
        - before[1]["preemptions"]
        + after[1]["preemptions"],
        "slots_leaked": [s["total_slots"] - s["free_slots"] - s["evictable_tokens"] for s in after],
        "idle_checks": [s["idle_check"] for s in after],
        "restarted_served": served_after_restart(cluster),
        "rss_growth": rss(survivor) / rss_before - 1,
    }
    wrong = [o for o in outcomes if o.kind == "wrong"]
    unequal = [
        (o.spec, text, refs[reference_key(o.spec)])
        for o in outcomes
        if o.kind == "completed"
        for text in o.texts
        if text != refs[reference_key(o.spec)]
    ]
    figures["outputs_equal"] = not unequal
    print(
        f"\nsoak through sglang-router: {figures['requests']} requests from {SOAK_THREADS} "
        f"threads in {elapsed:.0f}s, {figures.get('completed', 0)} completed, "
        f"{figures.get('clean_error', 0)} clean errors, {figures.get('dropped', 0)} dropped by "
        f"the client, {len(wrong)} wrong; {figures['retried']} retried by the router; "
        f"{figures['in_flight_at_kill']} in flight on the killed replica; "
        f"{figures['preemptions']} preemptions; KV slots leaked {figures['slots_leaked']}; "
        f"memory growth {figures['rss_growth']:+.1%}; outputs equal {not unequal}"
    )
    assert not wrong, [(o.spec, o.detail) for o in wrong[:10]]
    assert not unequal, unequal[:5]
    errors = [o for o in outcomes if o.kind == "clean_error"]
    assert all(o.spec.kind in STREAMED for o in errors), [(o.spec, o.detail) for o in errors]
    assert len(errors) <= killed["in_flight"], [(o.spec, o.detail) for o in errors]
    assert figures["retried"] > 0
    assert figures["slots_leaked"] == [0, 0] and figures["idle_checks"] == ["ok", "ok"]
    assert figures["restarted_served"] > 0
    assert figures["rss_growth"] < RSS_GROWTH_LIMIT, f"RSS grew {figures['rss_growth']:.1%}"
    return figures


@needs_router
@pytest.mark.slow  # a minute of the default suite's budget; the router's paths run in test_router
def test_soak_through_the_router_with_a_killed_replica(cluster: Cluster, engine: Any) -> None:
    figures = soak(cluster, engine, SOAK_HTTP_SHORT)
    assert figures["preemptions"] > 0


@needs_router
@pytest.mark.slow
def test_soak_through_the_router_full(cluster: Cluster, engine: Any) -> None:
    figures = soak(cluster, engine, SOAK_HTTP_REQUESTS)
    assert figures["preemptions"] >= FULL_MIN_PREEMPTIONS
