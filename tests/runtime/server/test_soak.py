"""Soak under KV pressure (slow; `python3 -m pytest -m slow tests/runtime/server/test_soak.py -s`).

SOAK_REQUESTS (default 2,000) generate requests from SOAK_THREADS (32) client threads against
one server whose 600-slot KV pool holds only a few requests (admission made optimistic with
schedule_conservativeness 0.3, prefill chunked at 256 tokens): mixed prompt and output lengths,
shared prefixes, streamed and not, regex-constrained, stop strings, seeded sampling; 20% are
aborted by rid, closed mid-stream or lose their client (endpoint closed) at random points.
Every request that was not aborted must end with a correct reply (greedy ones equal to the
offline Engine's), preemptions must happen, and at the end the idle leak check passes, the
tree holds only evictable tokens and the server's RSS (server + scheduler) is within 10% of
where it was after a warm-up.

The load comes in bursts of WAVE requests with an idle scheduler between them: after its first
preemption the scheduler turns cautious (new_token_ratio near 1, decaying over thousands of
steps, reset only at idle), so one unbroken run preempts about once; each burst starts
optimistic again, overcommits the pool and preempts. The leak check runs after every burst.
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import psutil
import pytest
from test_server import wait_idle

from conftest import Server
from radixflow.backend import RuntimeEndpoint, RuntimeEndpointError

pytestmark = pytest.mark.slow

SOAK_REQUESTS = int(os.environ.get("SOAK_REQUESTS", "2000"))
SOAK_THREADS = int(os.environ.get("SOAK_THREADS", "32"))
WARMUP_REQUESTS = max(64, SOAK_REQUESTS // 10)
ABORT_SHARE = 0.2
POOL = 600
CALL_TIMEOUT_S = 900.0  # a request may wait behind many others on 2 shared cores
RSS_GROWTH_LIMIT = 0.10
WAVE = 6 * SOAK_THREADS  # requests per burst; the scheduler idles between bursts

PREFIXES = [
    "You are a careful assistant. Answer in one short sentence.\n",
    "The following is a quiz about geography, history and science. Each answer is brief "
    "and exact, and the quiz master checks every answer twice before moving on.\n",
    "Context: a small town by the sea has a harbour, a lighthouse, a bakery, a school and "
    "a library. The bakery opens at six, the library at nine, and the school at eight. "
    "Fishing boats leave the harbour before dawn and return in the afternoon.\n",
]
QUESTIONS = [
    "What is the capital of Spain?",
    "Name a prime number.",
    "Is the sea salty?",
    "How many legs does a spider have?",
    "What colour is the sky?",
    "When does the bakery open?",
    "What is two plus three?",
    "Who wrote Hamlet?",
]
PROMPTS = [f"{p}Q: {q}\nA:" for p in PREFIXES for q in QUESTIONS] + [
    "Hello",
    "Once upon a time",
    "List three colors:",
    "1, 2, 3, 4,",
    " ".join(f"step {i} of the long procedure is done;" for i in range(40)),  # ~400 tokens
]
VARIANTS: dict[str, dict[str, Any]] = {
    "short": {"max_new_tokens": 4, "temperature": 0},
    "medium": {"max_new_tokens": 16, "temperature": 0},
    "long": {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True},
    "number": {"max_new_tokens": 8, "temperature": 0, "regex": "[0-9]{1,6}"},
    "yes_no": {"max_new_tokens": 12, "temperature": 0, "regex": "(yes|no)(, (yes|no)){0,3}"},
    "stop": {"max_new_tokens": 24, "temperature": 0, "stop": ["\n", "."]},
    "sampled": {"max_new_tokens": 16, "temperature": 0.8, "top_p": 0.9, "seed": 7},
}
WEIGHTS = {"short": 10, "medium": 20, "long": 30, "number": 10, "yes_no": 10, "stop": 10}
WEIGHTS["sampled"] = 10
ABORT_KINDS = ("abort", "close_stream", "close_client")


@dataclass(frozen=True)
class Spec:
    """One soak request and, for the 20%, how it is cut short."""

    rid: str
    prompt: int
    variant: str
    stream: bool
    abort: str | None = None  # one of ABORT_KINDS
    delay: float = 0.0  # seconds until the abort or the client's close
    after_chunks: int = 0  # close_stream: after this many chunks


def make_specs(count: int, seed: int, tag: str) -> list[Spec]:
    rng = random.Random(seed)
    names, weights = list(WEIGHTS), list(WEIGHTS.values())
    specs = []
    for i in range(count):
        stream = rng.random() < 0.5
        abort = rng.choice(ABORT_KINDS) if rng.random() < ABORT_SHARE else None
        if abort == "close_stream" and not stream:
            abort = "abort"
        specs.append(
            Spec(
                rid=f"{tag}-{i}",
                prompt=rng.randrange(len(PROMPTS)),
                variant=rng.choices(names, weights)[0],
                stream=stream,
                abort=abort,
                delay=rng.uniform(0.0, 3.0),
                after_chunks=rng.randint(1, 6),
            )
        )
    return specs


@dataclass
class Outcome:
    spec: Spec
    kind: str  # completed, aborted, failed
    reply: Any = None
    detail: str = ""


class Client:
    """One soak thread's connection; replaced after the soak closes it on purpose."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.endpoint = RuntimeEndpoint(address, timeout=CALL_TIMEOUT_S)
        self.closed_on_purpose = False

    def close_on_purpose(self) -> None:
        self.closed_on_purpose = True
        self.endpoint.close()

    def abort(self, rid: str) -> None:
        # Closed meanwhile (close_client): the server times that client out instead.
        with contextlib.suppress(RuntimeEndpointError):
            self.endpoint.abort(rid)

    def run(self, spec: Spec) -> Outcome:
        timer = None
        if spec.abort == "abort":
            timer = threading.Timer(spec.delay, self.abort, args=(spec.rid,))
        elif spec.abort == "close_client":
            timer = threading.Timer(spec.delay, self.close_on_purpose)
        if timer is not None:
            timer.start()
        try:
            return self._request(spec)
        except RuntimeEndpointError as e:
            kind = "aborted" if self.closed_on_purpose else "failed"
            return Outcome(spec, kind, detail=f"[{e.code}] {e}")
        finally:
            if timer is not None:
                timer.cancel()
                timer.join()
            if self.closed_on_purpose:
                self.endpoint = RuntimeEndpoint(self.address, timeout=CALL_TIMEOUT_S)
                self.closed_on_purpose = False

    def _request(self, spec: Spec) -> Outcome:
        prompt, params = PROMPTS[spec.prompt], VARIANTS[spec.variant]
        if not spec.stream:
            out = self.endpoint.generate(prompt, params, rid=spec.rid)
            return _classify(spec, out)
        previous = {"text": "", "output_ids": []}
        chunks = self.endpoint.generate_stream(prompt, params, rid=spec.rid)
        for count, chunk in enumerate(chunks, 1):
            if chunk["finished"]:
                return _classify(spec, chunk)
            if not chunk["text"].startswith(previous["text"]) or (
                chunk["output_ids"][: len(previous["output_ids"])] != previous["output_ids"]
            ):
                return Outcome(spec, "failed", chunk, "a chunk rewrote earlier output")
            previous = chunk
            if spec.abort == "close_stream" and count == spec.after_chunks:
                chunks.close()  # aborts the request on the server
                return Outcome(spec, "aborted", detail="stream closed")
        return Outcome(spec, "failed", detail="the stream ended without a final item")


def _classify(spec: Spec, out: dict[str, Any]) -> Outcome:
    reason = out["meta_info"]["finish_reason"]
    return Outcome(spec, "aborted" if reason["type"] == "abort" else "completed", out)


def run_soak(address: str, specs: list[Spec], threads: int) -> list[Outcome]:
    todo: queue.Queue[Spec] = queue.Queue()
    for spec in specs:
        todo.put(spec)
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def worker() -> None:
        client = Client(address)
        try:
            while True:
                try:
                    spec = todo.get_nowait()
                except queue.Empty:
                    return
                outcome = client.run(spec)
                with lock:
                    outcomes.append(outcome)
        finally:
            client.endpoint.close()

    pool = [threading.Thread(target=worker, name=f"soak-{i}") for i in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(CALL_TIMEOUT_S * 4)
    assert not any(thread.is_alive() for thread in pool), "a soak client hangs"
    assert len(outcomes) == len(specs)
    return outcomes


def references(engine: Any, specs: list[Spec]) -> dict[tuple[int, str], dict[str, Any]]:
    """The offline Engine's reply for every greedy (prompt, variant) the specs use."""
    wanted: dict[str, set[int]] = {}
    for spec in specs:
        if VARIANTS[spec.variant]["temperature"] == 0:
            wanted.setdefault(spec.variant, set()).add(spec.prompt)
    refs = {}
    for variant, prompts in wanted.items():
        order = sorted(prompts)
        outs = engine.generate([PROMPTS[i] for i in order], VARIANTS[variant])
        refs.update({(i, variant): out for i, out in zip(order, outs)})
    return refs


def check(outcome: Outcome, refs: dict[tuple[int, str], dict[str, Any]]) -> str | None:
    """Why a completed reply is wrong, or None."""
    spec, out = outcome.spec, outcome.reply
    params = VARIANTS[spec.variant]
    meta = out["meta_info"]
    if meta["finish_reason"]["type"] not in ("stop", "length"):
        return f"finish_reason {meta['finish_reason']}"
    if meta["completion_tokens"] > params["max_new_tokens"]:
        return f"{meta['completion_tokens']} tokens"
    want = refs.get((spec.prompt, spec.variant))
    if want is None:  # sampled: no reference, only the contract
        return None
    if out["output_ids"] != want["output_ids"] or out["text"] != want["text"]:
        return f"{out['text']!r} != Engine's {want['text']!r}"
    if meta["finish_reason"] != want["meta_info"]["finish_reason"]:
        return f"finish_reason {meta['finish_reason']} != {want['meta_info']['finish_reason']}"
    return None


def server_rss(runtime: Server) -> int:
    """Resident bytes of the server process and its children (the scheduler)."""
    server = psutil.Process(runtime.process.pid)
    return sum(p.memory_info().rss for p in [server, *server.children(recursive=True)])


SERVER = dict(  # conftest's module-scoped `runtime`
    max_total_tokens=POOL,
    schedule_conservativeness=0.3,
    chunked_prefill_size=256,
    self_check=True,
    num_threads=1,
    log_level="warning",
    endpoint_timeout=CALL_TIMEOUT_S,
)


def test_soak_under_kv_pressure_with_aborts(runtime: Server, engine: Any) -> None:
    endpoint = runtime.endpoint
    warmup = make_specs(WARMUP_REQUESTS, seed=1, tag="warm")
    specs = make_specs(SOAK_REQUESTS, seed=2, tag="soak")
    refs = references(engine, warmup + specs)

    run_soak(runtime.address, warmup, SOAK_THREADS)
    before = wait_idle(endpoint, timeout=120)
    rss_before = server_rss(runtime)

    start, outcomes = time.monotonic(), []
    for first in range(0, len(specs), WAVE):
        outcomes += run_soak(runtime.address, specs[first : first + WAVE], SOAK_THREADS)
        after = wait_idle(endpoint, timeout=120)  # closed clients are timed out meanwhile
    elapsed = time.monotonic() - start
    rss_after = server_rss(runtime)

    kinds = Counter(o.kind for o in outcomes)
    wrong = [(o.spec, why) for o in outcomes if o.kind == "completed" if (why := check(o, refs))]
    failed = [(o.spec, o.detail) for o in outcomes if o.kind == "failed"]
    unplanned = [o.spec for o in outcomes if o.kind == "aborted" and o.spec.abort is None]
    preemptions = after["preemptions"] - before["preemptions"]
    preempted = sum(
        1 for o in outcomes if o.reply and o.reply["meta_info"].get("num_preemptions", 0) > 0
    )
    leaked = after["total_slots"] - after["free_slots"] - after["evictable_tokens"]
    growth = rss_after / rss_before - 1
    print(
        f"\nsoak: {len(specs)} requests from {SOAK_THREADS} threads in bursts of {WAVE}, "
        f"{elapsed:.0f}s: "
        f"{kinds['completed']} completed, {kinds['aborted']} aborted "
        f"({sum(1 for s in specs if s.abort)} planned), {kinds['failed']} failed; "
        f"{preemptions} preemptions ({preempted} requests preempted); slots leaked {leaked}; "
        f"RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB ({growth:+.1%}); "
        f"aborted on the server {after['aborted_requests'] - before['aborted_requests']}"
    )
    assert not failed, failed[:10]
    assert not unplanned, unplanned[:10]  # aborted only when the soak aborted it
    assert not wrong, wrong[:10]
    assert kinds["completed"] >= 0.7 * len(specs)
    assert preemptions > 0 and preempted > 0
    assert leaked == 0
    assert after["protected_tokens"] == 0 and after["evictable_tokens"] == after["tokens_in_tree"]
    assert growth <= RSS_GROWTH_LIMIT, f"RSS grew {growth:.1%}"
