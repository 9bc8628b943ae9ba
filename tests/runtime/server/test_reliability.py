"""Reliability of the server under bad input and faults, with real processes on loopback.

Protocol fuzzing (hypothesis, 2,000+ generated frames through a raw DEALER socket while a
correct client keeps checking greedy answers against the offline Engine; each answer checked
against the test's own reading of the wire spec, never the server's decoder), process faults (the
scheduler SIGKILLed mid-load, a client frozen mid-stream, the server SIGKILLed under programs
and clients) and program-level faults in the DSL. One server for the module (self-check on, a
small pool, one torch thread); the tests that kill the server start their own.
tests/runtime/server/test_server.py has the single-fault versions (one killed stream, one killed
client process, hand-written bad frames); these extend them instead of repeating them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import msgpack
import psutil
import pytest
import zmq
from fuzz_schema import BAD, EITHER, Limits, is_int, sampling_verdict
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from test_server import wait_for, wait_idle

import radixflow as sgl
from conftest import Server, finishes
from radixflow.backend import RuntimeEndpoint, RuntimeEndpointError
from radixflow.runtime.protocol import codec
from radixflow.runtime.protocol import messages as m
from radixflow.runtime.protocol.sampling import SamplingParams

MAX_MESSAGE_BYTES = 1 << 16
GREEDY = {"max_new_tokens": 8, "temperature": 0}
LONG = {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True}
GOOD_PROMPTS = ["The capital of France is", "List three colors:", "1, 2, 3,", "Hello, my name"]
FUZZ_CASES = int(os.environ.get("FUZZ_CASES", "1000"))  # FUZZ_CASES=5000 for a deeper run
RESTART_S = 180  # a scheduler restart reloads the model; the 2 cores may be shared


SERVER = dict(  # conftest's module-scoped `runtime`
    max_total_tokens=4096,
    self_check=True,
    max_message_bytes=MAX_MESSAGE_BYTES,
    num_threads=1,  # one torch thread: two oversubscribe a shared 2-core machine
    log_level="warning",
    endpoint_timeout=120.0,
)


@pytest.fixture
def endpoint(runtime: Server) -> RuntimeEndpoint:
    """The module server's endpoint, once its scheduler is up (an earlier failure may have
    restarted it)."""
    wait_for(lambda: runtime.endpoint.health()["ok"], RESTART_S, "a ready scheduler")
    return runtime.endpoint


# ---- protocol fuzzing ---------------------------------------------------------------------

RID = "<rid>"  # replaced by a fresh rid when the frame is built
TEMPLATES: list[dict[str, Any]] = [
    {"t": "generate", "rid": RID, "text": "Hi", "sampling_params": {"max_new_tokens": 2}},
    {
        "t": "generate",
        "rid": RID,
        "input_ids": [1, 2, 3],
        "sampling_params": {
            "max_new_tokens": 2,
            "temperature": 0.7,
            "seed": 1,
            "min_new_tokens": 1,
        },
        "stream": True,
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
    },
    {"t": "score", "rid": RID, "prefix": "The sky is", "continuations": [" blue", " red"]},
    {"t": "cache_prefix", "rid": RID, "text": "A cached prefix"},
    {"t": "abort", "rid": RID, "target_rid": "no-such-request"},
    {"t": "flush_cache", "rid": RID},
    {"t": "model_info", "rid": RID},
    {"t": "stats", "rid": RID},
    {"t": "health", "rid": RID},
    {"t": "status", "rid": RID, "target_rids": ["no-such-request", RID]},
    {"t": "ping"},
]
FIELD_NAMES = sorted({name for t in TEMPLATES for name in t} | {"v", "key", "unconditional"})
SAMPLING_NAMES = [f.name for f in dataclasses.fields(SamplingParams)] + ["max_tokens"]
# Grammars only from a cheap set: compiling an arbitrary one can take minutes (test_limits).
GRAMMAR_VALUES = st.sampled_from(["(", "[0-9]", "yes|no", "", "(?=a)a", 7, ["yes", "no"], "{"])
EDGE_NUMBERS = st.sampled_from(
    [-1, 0, 1, 49152, 2**31, 2**63 - 1, 2**64 - 1, -(2**63), 1e-300, 1e300, math.inf, math.nan]
)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | EDGE_NUMBERS
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12)
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=6) | st.binary(max_size=3), inner, max_size=4)
    ),
    max_leaves=6,
)
KEYS = st.sampled_from(FIELD_NAMES) | st.text(max_size=8) | st.binary(max_size=4)


@dataclass
class FrameSpec:
    """One fuzz case: how to build its frame(s) once a fresh rid is known."""

    kind: str
    body: Any = None  # a map (rid placeholder inside) or raw bytes
    cut: float = 1.0  # truncate the packed frame to this fraction
    extra: int = 0  # oversized: bytes past the limit
    parts: list[bytes] = field(default_factory=list)


def _corrupt(template: dict[str, Any], op: str, name: str, value: Any) -> dict[str, Any]:
    body = {"v": m.PROTOCOL_VERSION, **template}
    if op == "replace":
        body[name] = value
    elif op == "delete":
        body.pop(name, None)
    elif op == "add":
        body[f"x_{name}"] = value
    else:  # one sampling parameter, the semantic layer behind the wire format
        params = dict(body.get("sampling_params", {"max_new_tokens": 2}))
        params[name] = value
        body["sampling_params"] = params
    return body


def _sampling_edit() -> st.SearchStrategy[tuple[str, Any]]:
    grammar_names = ("regex", "json_schema", "choices")
    names = st.sampled_from([n for n in SAMPLING_NAMES if n not in grammar_names])
    return st.one_of(
        st.tuples(st.sampled_from(grammar_names), GRAMMAR_VALUES),
        st.tuples(names, EDGE_NUMBERS),
        st.tuples(names, EDGE_NUMBERS.map(lambda value: [value])),
        st.tuples(names | st.text(max_size=6), VALUES),
    )


VALID = st.sampled_from(TEMPLATES).map(lambda t: FrameSpec("valid", {"v": 1, **t}))
SAMPLING_EDITED = st.builds(
    lambda t, edit: FrameSpec("sampling", _corrupt(t, "sampling", *edit)),
    st.sampled_from(TEMPLATES[:2]),
    _sampling_edit(),
)
CORRUPTED = st.one_of(
    st.builds(
        lambda t, op, name, value: FrameSpec("corrupted", _corrupt(t, op, name, value)),
        st.sampled_from(TEMPLATES),
        st.sampled_from(["replace", "replace", "delete", "add"]),
        KEYS,
        VALUES,
    ),
    SAMPLING_EDITED,  # twice: the semantic layer is where frames reach the model
    SAMPLING_EDITED,
)
RANDOM_MAP = st.builds(
    lambda envelope, body: FrameSpec("random_map", {**envelope, **body}),
    st.fixed_dictionaries(
        {},
        optional={
            "v": st.just(1) | VALUES,
            "t": st.sampled_from([t["t"] for t in TEMPLATES] + ["shutdown", "chunk"]) | VALUES,
            "rid": st.just(RID) | VALUES,
        },
    ),
    st.dictionaries(KEYS, VALUES, max_size=6),
)
FRAMES = st.one_of(
    st.binary(max_size=300).map(lambda b: FrameSpec("random_bytes", b)),
    st.builds(
        lambda t, cut: FrameSpec("truncated", {"v": 1, **t}, cut=cut),
        st.sampled_from(TEMPLATES),
        st.floats(0.0, 0.999),
    ),
    st.builds(
        lambda t, extra: FrameSpec("oversized", {"v": 1, **t}, extra=extra),
        st.sampled_from(TEMPLATES[:4]),
        st.integers(1, 4096),
    ),
    RANDOM_MAP,
    RANDOM_MAP,
    CORRUPTED,
    CORRUPTED,
    CORRUPTED,
    VALID,
    st.lists(st.binary(max_size=16), min_size=2, max_size=3).map(
        lambda parts: FrameSpec("multipart", parts=parts)
    ),
)


def _with_rid(value: Any, rid: str) -> Any:
    if value == RID and isinstance(value, str):
        return rid
    if isinstance(value, dict):
        return {k: _with_rid(v, rid) for k, v in value.items()}
    return value


def build_frames(spec: FrameSpec, rid: str) -> list[bytes]:
    if spec.kind == "multipart":
        return spec.parts
    if spec.kind == "random_bytes":
        return [spec.body]
    frame = msgpack.packb(_with_rid(spec.body, rid), use_bin_type=True)
    if spec.kind == "truncated":
        return [frame[: int(len(frame) * spec.cut)]]
    if spec.kind == "oversized":  # pad a string field so the frame passes the limit
        body = _with_rid(spec.body, rid)
        key = "text" if "text" in body else "prefix" if "prefix" in body else "pad"
        pad = MAX_MESSAGE_BYTES + spec.extra - len(frame) + len(str(body.get(key, "")))
        frame = msgpack.packb({**body, key: "x" * max(pad, 1)}, use_bin_type=True)
        assert len(frame) > MAX_MESSAGE_BYTES, len(frame)
    return [frame]


@dataclass
class Expectation:
    """What the server owes one fuzz frame: one final reply with one of its rids, an error
    whose code is in `error_codes` or, when `may_succeed`, a result; a valid ping gets nothing."""

    rids: tuple[str, ...]  # the rid its replies may carry
    error_codes: set[str] = field(default_factory=set)
    may_succeed: bool = False
    silent: bool = False
    dispatched: bool = False  # served by the scheduler: the reply may come later


# The oracle: the client requests of the spec (runtime/protocol/messages.py's docstring), read
# as a reader of that document would, without the server's decoder. Each field: its type check
# and whether it is required.
def _str(v: Any) -> bool:
    return isinstance(v, str)


def _optional(check: Any) -> Any:
    return lambda v: v is None or check(v)


def _int_list(v: Any) -> bool:
    return isinstance(v, list) and all(is_int(x) for x in v)


def _str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _bool(v: Any) -> bool:
    return isinstance(v, bool)


RID_FIELD = {"rid": (_str, True)}
SPEC_FIELDS: dict[str, dict[str, tuple[Any, bool]]] = {
    "generate": {
        **RID_FIELD,
        "text": (_optional(_str), False),
        "input_ids": (_optional(_int_list), False),
        "sampling_params": (lambda v: isinstance(v, dict), False),
        "stream": (_bool, False),
        "return_logprob": (_bool, False),
        "logprob_start_len": (is_int, False),
        "top_logprobs_num": (is_int, False),
    },
    "score": {
        **RID_FIELD,
        "prefix": (_str, True),
        "continuations": (_str_list, True),
        "unconditional": (_bool, False),
    },
    "cache_prefix": {**RID_FIELD, "text": (_str, True)},
    "abort": {**RID_FIELD, "target_rid": (_str, True)},
    "status": {**RID_FIELD, "target_rids": (_str_list, True)},
    **{tag: dict(RID_FIELD) for tag in ("flush_cache", "model_info", "stats", "health")},
    "ping": {},
}
DISPATCHED = ("generate", "score", "cache_prefix", "flush_cache")  # served by the scheduler
MAX_RID_CHARS, MAX_TOP_LOGPROBS = 256, 64  # the spec's bounds
CANNOT_BUILD = {m.ERROR_INVALID_REQUEST, m.ERROR_FAILED}  # a grammar: refused, or failed


class NotMsgpack(Exception):
    """The frame is not one msgpack map of the spec's kind."""


def _no_ext(code: int, data: bytes) -> Any:
    raise NotMsgpack(f"ext type {code}")


def _string_keys(value: Any) -> bool:
    """Whether every map inside `value` has string keys only."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _string_keys(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_string_keys(v) for v in value)
    return True


def _unpack(frame: bytes) -> Any:
    try:
        return msgpack.unpackb(frame, raw=False, strict_map_key=False, ext_hook=_no_ext)
    except (ValueError, TypeError, NotMsgpack, msgpack.StackError):
        raise NotMsgpack("not one msgpack value") from None


def _field_codes(tag: str, fields: dict[Any, Any]) -> set[str]:
    """bad_message when a field is unknown, missing or of the wrong type."""
    spec = SPEC_FIELDS[tag]
    if set(fields) - set(spec):
        return {m.ERROR_BAD_MESSAGE}
    for name, (check, required) in spec.items():
        if (name not in fields and required) or (name in fields and not check(fields[name])):
            return {m.ERROR_BAD_MESSAGE}
    return set()


def _value_codes(tag: str, fields: dict[str, Any], limits: Limits) -> tuple[set[str], set[str]]:
    """(codes a request that must be refused may get, codes one the spec leaves open may get)
    for a well-typed request."""
    bad: set[str] = set()
    open_: set[str] = set()
    rid = fields.get("rid", "")
    if tag in DISPATCHED and not 1 <= len(rid) <= MAX_RID_CHARS:
        bad.add(m.ERROR_INVALID_REQUEST)
    elif tag not in DISPATCHED and tag != "ping" and not 1 <= len(rid) <= MAX_RID_CHARS:
        open_.add(m.ERROR_INVALID_REQUEST)
    if tag == "generate":
        _generate_codes(fields, limits, bad, open_)
    elif tag == "score":
        conts = fields["continuations"]
        if not conts or not all(conts):
            bad.add(m.ERROR_INVALID_REQUEST)
    elif tag == "cache_prefix" and not fields["text"]:
        bad.add(m.ERROR_INVALID_REQUEST)
    return bad, open_


def _generate_codes(fields: dict[str, Any], limits: Limits, bad: set, open_: set) -> None:
    text, ids = fields.get("text"), fields.get("input_ids")
    if (text is None) == (ids is None) or text == "" or ids == []:
        bad.add(m.ERROR_INVALID_REQUEST)
    elif ids is not None and not all(0 <= t < limits.vocab_size for t in ids):
        bad.add(m.ERROR_INVALID_REQUEST)
    params = fields.get("sampling_params", {})
    grammar = {k: params[k] for k in ("regex", "json_schema", "ebnf") if k in params}
    others = {k: v for k, v in params.items() if k not in grammar}
    verdict = sampling_verdict(others, limits, strict_names=True)
    grammar_verdict = sampling_verdict(grammar, limits, strict_names=True)
    if verdict == BAD or params.get("n", 1) != 1:  # the spec: n must be 1 here
        bad.add(m.ERROR_INVALID_REQUEST)
    if grammar_verdict == BAD:
        bad.update(CANNOT_BUILD)
    if EITHER in (verdict, grammar_verdict):
        open_.update(CANNOT_BUILD)
    start = fields.get("logprob_start_len", -1)
    if start < -1 or start >= limits.context_length:
        bad.add(m.ERROR_INVALID_REQUEST)
    elif start > 0:
        open_.add(m.ERROR_INVALID_REQUEST)  # past the prompt's end is refused
    if not 0 <= fields.get("top_logprobs_num", 0) <= MAX_TOP_LOGPROBS:
        bad.add(m.ERROR_INVALID_REQUEST)


def expect(parts: list[bytes], limits: Limits) -> Expectation:
    """The oracle: what the spec says the server owes these frames."""
    if len(parts) != 1:
        return Expectation(("",), {m.ERROR_BAD_MESSAGE})
    frame = parts[0]
    try:
        body = _unpack(frame)
    except NotMsgpack:
        body = None
    rid = body.get("rid") if isinstance(body, dict) and isinstance(body.get("rid"), str) else ""
    if len(frame) > MAX_MESSAGE_BYTES:  # refused unread, or its rid found in the first bytes
        return Expectation(("", rid), {m.ERROR_TOO_LARGE})
    if not isinstance(body, dict):
        return Expectation(("",), {m.ERROR_BAD_MESSAGE})
    version, tag = body.get("v"), body.get("t")
    codes = set()
    if not (is_int(version) and version == m.PROTOCOL_VERSION):
        codes.add(m.ERROR_BAD_VERSION)
    if not (isinstance(tag, str) and tag in SPEC_FIELDS):
        codes.add(m.ERROR_UNKNOWN_TYPE)
    if not isinstance(body.get("key", ""), str) or not all(isinstance(k, str) for k in body):
        codes.add(m.ERROR_BAD_MESSAGE)
    if codes or not _string_keys(body):  # nested non-string keys: a bad frame, or bad values
        rids = (rid,) if codes else ("", rid)
        return Expectation(rids, codes or {m.ERROR_BAD_MESSAGE, m.ERROR_INVALID_REQUEST})
    fields = {k: v for k, v in body.items() if k not in ("v", "t", "key")}
    codes = _field_codes(tag, fields)
    if codes:
        return Expectation((rid,), codes)
    if tag == "ping":
        return Expectation(("",), silent=True)
    bad, open_ = _value_codes(tag, fields, limits)
    dispatched = tag in DISPATCHED
    if bad:
        return Expectation((rid,), bad | open_, dispatched=dispatched)
    return Expectation((rid,), open_, may_succeed=True, dispatched=dispatched)


class RawClient:
    """A bare DEALER socket that sends any frames and reads decoded replies."""

    def __init__(self, address: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)

    def send(self, parts: list[bytes]) -> None:
        self.socket.send_multipart(parts)

    def recv(self, timeout_s: float) -> Any:
        """The next reply, or None after `timeout_s`."""
        if not self.socket.poll(int(timeout_s * 1000)):
            return None
        return codec.decode(self.socket.recv(), m.CLIENT_REPLIES)

    def close(self) -> None:
        self.socket.close()


class Fuzzer:
    """Sends one fuzz case, then a health request as a fence: the server handles one client's
    frames in order, so every immediate reply to the case arrives before the fence's."""

    ABORT_AFTER_S = 2.0  # a fuzzed request that came out valid and long is aborted
    REPLY_TIMEOUT_S = 60.0

    def __init__(self, raw: RawClient, limits: Limits) -> None:
        self.raw, self.limits = raw, limits
        self.cases = 0
        self.kinds: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.recent: deque[FrameSpec] = deque(maxlen=4)  # a crash may show a case late

    def run(self, spec: FrameSpec) -> None:
        self.cases += 1
        self.kinds[spec.kind] += 1
        rid, fence = f"fz{self.cases}", f"fence{self.cases}"
        parts = build_frames(spec, rid)
        want = expect(parts, self.limits)
        self.raw.send(parts)
        self.raw.send([codec.encode(m.Health(fence))])
        replies, fenced, aborted = [], False, False
        start = time.monotonic()
        while not fenced or (want.dispatched and not _final(replies)):
            waited = time.monotonic() - start
            assert waited < self.REPLY_TIMEOUT_S, f"case {self.cases}: {spec!r:.300} unanswered"
            if fenced and not aborted and waited > self.ABORT_AFTER_S:
                self.raw.send([codec.encode(m.Abort(f"abort-{rid}", want.rids[0]))])
                aborted = True
            reply = self.raw.recv(0.2)
            if reply is None:
                continue
            if reply.rid == fence:
                fenced = True
            elif reply.rid != f"abort-{rid}":
                replies.append(reply)
        self._check(spec, want, replies)
        self.recent.append(spec)

    def _check(self, spec: FrameSpec, want: Expectation, replies: list[Any]) -> None:
        finals = [r for r in replies if not isinstance(r, m.Chunk)]
        where = f"{spec.kind} case {self.cases}: {spec.body!r:.300} -> {replies!r:.300}"
        if want.silent:
            assert not replies, where
            self.outcomes["silent"] += 1
            return
        assert len(finals) == 1 and replies[-1] is finals[0], where
        reply = finals[0]
        assert all(r.rid in want.rids for r in replies), where
        if isinstance(reply, m.Error):
            assert reply.code not in (m.ERROR_UNAVAILABLE, m.ERROR_INTERNAL), (
                f"the server or scheduler broke on {where}, or on one of the cases before it: "
                f"{list(self.recent)!r:.2000}"
            )
            assert reply.code in want.error_codes, f"{where}: the spec allows {want}"
            self.outcomes[f"error_{reply.code}"] += 1
            return
        assert want.may_succeed, f"{where}: the spec allows {want}"
        self.outcomes[f"{type(reply).__name__.lower()}"] += 1


def _final(replies: list[Any]) -> bool:
    return any(not isinstance(r, m.Chunk) for r in replies)


def good_client(
    address: str, references: dict[str, list[int]], stop: threading.Event, log: list[Any]
) -> None:
    """Greedy requests, streamed and not, until `stop`; logs True per correct answer."""
    with RuntimeEndpoint(address, timeout=120) as client:
        i = 0
        while not stop.is_set():
            prompt = GOOD_PROMPTS[i % len(GOOD_PROMPTS)]
            try:
                if i % 2:
                    ids = client.generate(prompt, GREEDY)["output_ids"]
                else:
                    ids = list(client.generate_stream(prompt, GREEDY))[-1]["output_ids"]
            except RuntimeEndpointError as e:
                log.append((prompt, e))
            else:
                log.append(ids == references[prompt] or (prompt, ids))
            i += 1


def fuzz_settings() -> settings:
    """Deterministic by default (the same frames each run); FUZZ_SEED=n explores others."""
    return settings(
        max_examples=FUZZ_CASES,
        deadline=None,
        database=None,
        derandomize="FUZZ_SEED" not in os.environ,
        phases=[Phase.generate],  # shrinking against a live server costs minutes
        suppress_health_check=list(HealthCheck),
    )


def test_fuzzed_frames_get_errors_and_a_correct_client_keeps_working(
    runtime: Server, endpoint: RuntimeEndpoint, engine: Any
) -> None:
    references = {
        p: r["output_ids"] for p, r in zip(GOOD_PROMPTS, engine.generate(GOOD_PROMPTS, GREEDY))
    }
    before = endpoint.health()
    stop, log = threading.Event(), []
    client = threading.Thread(target=good_client, args=(runtime.address, references, stop, log))
    client.start()
    info = endpoint.model_info()
    limits = Limits(info["vocab_size"], info["context_length"], info["max_new_tokens_limit"])
    raw = RawClient(runtime.address)
    fuzzer = Fuzzer(raw, limits)

    @fuzz_settings()
    @given(FRAMES)
    def one_case(spec: FrameSpec) -> None:
        fuzzer.run(spec)

    if "FUZZ_SEED" in os.environ:
        one_case = seed(int(os.environ["FUZZ_SEED"]))(one_case)
    start = time.monotonic()
    try:
        one_case()
    finally:
        elapsed = time.monotonic() - start
        stop.set()
        client.join(120)
        print(
            f"\nfuzz: {fuzzer.cases} cases in {elapsed:.1f}s; kinds {dict(fuzzer.kinds)}; "
            f"outcomes {dict(fuzzer.outcomes)}; good client {len(log)} answers"
        )
    assert fuzzer.cases >= min(900, FUZZ_CASES)
    assert not client.is_alive()
    assert len(log) >= 3 and all(entry is True for entry in log), [e for e in log if e is not True]
    assert runtime.process.poll() is None, "the server died"
    health = endpoint.health()
    assert health["ok"] and health["scheduler_restarts"] == before["scheduler_restarts"], health
    assert health["scheduler_pid"] == before["scheduler_pid"]
    assert raw.socket.poll(500) == 0, "a reply nobody asked for"  # exactly one final per rid
    raw.close()
    stats = wait_idle(endpoint)
    assert stats["server"].get(f"error_{m.ERROR_INTERNAL}", 0) == 0, stats["server"]


# Regression tests for frames the fuzzer found fatal: each killed a process.

SAMPLING_CRASHES = [
    pytest.param({"temperature": 1.0, "top_k": 2**64 - 1}, id="top_k past int64"),
    pytest.param({"min_new_tokens": 1, "stop_token_ids": [49152]}, id="stop id past vocab"),
    pytest.param({"min_new_tokens": 1, "stop_token_ids": [2**64 - 1]}, id="stop id past int64"),
    pytest.param({"temperature": 1.0, "top_p": 1e-300}, id="top_p rounds to 0"),
    pytest.param({"temperature": 1.0, "repetition_penalty": 1e-300}, id="penalty overflows"),
]


@pytest.mark.parametrize("params", SAMPLING_CRASHES)
def test_sampling_edge_values_do_not_kill_the_scheduler(
    endpoint: RuntimeEndpoint, params: dict[str, Any]
) -> None:
    """A request the scheduler cannot run must cost that request, not every request in flight:
    it is refused (invalid_request) or served; the scheduler never restarts."""
    pid = endpoint.health()["scheduler_pid"]
    try:
        out = endpoint.generate("Hi", {"max_new_tokens": 2, **params}, timeout=60)
    except RuntimeEndpointError as e:
        assert e.code == m.ERROR_INVALID_REQUEST, f"[{e.code}] {e}"
    else:
        assert out["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    health = endpoint.health()
    assert health["scheduler_pid"] == pid, f"the scheduler died: {health['last_error']}"


def test_mixed_str_and_bytes_keys_get_an_error_not_a_dead_server(
    runtime: Server, endpoint: RuntimeEndpoint
) -> None:
    """strict_map_key lets bytes keys through; sorting unknown str and bytes field names
    raised TypeError out of decode and killed the server loop."""
    raw = RawClient(runtime.address)
    try:
        body = {"v": 1, "t": "health", "rid": "mixed", b"bytes-key": 1, "str-key": 2}
        raw.send([msgpack.packb(body, use_bin_type=True)])
        reply = raw.recv(10)
    finally:
        raw.close()
    assert isinstance(reply, m.Error) and reply.code == m.ERROR_BAD_MESSAGE, reply
    assert reply.rid == "mixed"
    assert runtime.process.poll() is None and endpoint.health()["ok"]


# ---- process faults -----------------------------------------------------------------------


@dataclass
class Outcome:
    """What one client thread saw: its error code and when, or its result."""

    code: str | None = None
    at: float = 0.0
    result: Any = None
    streaming: threading.Event = field(default_factory=threading.Event)


def run_client(endpoint: RuntimeEndpoint, outcome: Outcome, stream: bool, **request: Any) -> None:
    """One long request, streamed or blocking; records the error it ends with."""
    request = {"text": "Story:", "sampling_params": LONG, **request}
    try:
        if not stream:
            outcome.result = endpoint.generate(**request)
            return
        for chunk in endpoint.generate_stream(**request):
            outcome.streaming.set()
            outcome.result = chunk
    except RuntimeEndpointError as e:
        outcome.code, outcome.at = e.code, time.monotonic()


def start_clients(endpoint: RuntimeEndpoint, requests: list[dict[str, Any]]) -> list[Any]:
    """Threads running `run_client` for each request (with its `stream` flag)."""
    started = []
    for request in requests:
        outcome = Outcome()
        thread = threading.Thread(target=run_client, args=(endpoint, outcome), kwargs=request)
        thread.start()
        started.append((thread, outcome))
    return started


def test_scheduler_sigkill_under_load_fails_every_client_within_5s(
    endpoint: RuntimeEndpoint, engine: Any
) -> None:
    """Extends test_server's one-stream version (test_killed_scheduler_fails_requests_fast_then_
    restarts): eight clients (streams, blocking calls, running and queued, a long prompt being
    chunked) all get `unavailable` within 5 s of the SIGKILL; after the restart the answers
    match the Engine again and the new scheduler is idle and clean."""
    old = endpoint.health()
    long_prompt = [(i * 37) % 5000 + 10 for i in range(3000)]  # prefilled 512 tokens a step
    requests = [{"stream": i % 2 == 0, "text": f"Story {i}:"} for i in range(7)]
    requests.append({"stream": False, "text": None, "input_ids": long_prompt})
    clients = start_clients(endpoint, requests)
    assert clients[0][1].streaming.wait(120), "the first stream never started"
    wait_for(
        lambda: endpoint.stats()["server"]["requests_in_flight"] == 8, 60, "8 requests in flight"
    )
    killed_at = time.monotonic()
    os.kill(old["scheduler_pid"], signal.SIGKILL)
    for thread, _ in clients:
        thread.join(10)
    assert not any(thread.is_alive() for thread, _ in clients), "a client still waits after 10 s"
    outcomes = [outcome for _, outcome in clients]
    assert [o.code for o in outcomes] == [m.ERROR_UNAVAILABLE] * 8, [o.result for o in outcomes]
    last = max(o.at for o in outcomes) - killed_at
    print(f"\nscheduler SIGKILL -> last of {len(outcomes)} clients' errors: {last:.2f}s")
    assert last < 5

    health = wait_for(lambda: (h := endpoint.health())["ok"] and h, RESTART_S, "the restart")
    assert health["scheduler_restarts"] == old["scheduler_restarts"] + 1
    assert not psutil.pid_exists(old["scheduler_pid"])
    want = [r["output_ids"] for r in engine.generate(GOOD_PROMPTS, GREEDY)]
    after = finishes(
        lambda: [endpoint.generate(p, GREEDY)["output_ids"] for p in GOOD_PROMPTS], 120
    )
    assert after == want
    wait_idle(endpoint)


FROZEN_CLIENT = """
import sys
from radixflow.backend import RuntimeEndpoint, RuntimeEndpointError
endpoint = RuntimeEndpoint(sys.argv[1], timeout=float("inf"))
params = {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}
try:
    for chunk in endpoint.generate_stream("A very long story:", params):
        if chunk["finished"]:
            print("final", chunk["meta_info"]["finish_reason"]["type"], flush=True)
        else:
            print("chunk", len(chunk["output_ids"]), flush=True)
except RuntimeEndpointError as e:
    print("error", e.code, flush=True)
"""


def test_frozen_client_frees_its_kv_and_gets_a_final_reply_when_it_resumes(
    endpoint: RuntimeEndpoint,
) -> None:
    """A client process SIGSTOPped mid-stream (test_server's test_killed_client_process_gets_
    its_request_aborted covers SIGKILL) goes silent: the server aborts its request after
    CLIENT_TIMEOUT_S and the KV it held is freed. Resumed before the connection drops, the
    client must get the request's one final reply (the abort result) instead of waiting
    forever: 'every request gets exactly one final reply'."""
    before = endpoint.stats()
    client = subprocess.Popen(
        [sys.executable, "-c", FROZEN_CLIENT, endpoint.address], stdout=subprocess.PIPE, text=True
    )
    try:
        assert client.stdout.readline().split() == ["chunk", "1"]

        def holds_kv() -> bool:  # stats come from the scheduler a few times a second
            s = endpoint.stats()
            return (
                s["running_requests"] == 1
                and s["free_slots"] + s["evictable_tokens"] < (s["total_slots"])
            )

        wait_for(holds_kv, 10, "the stream to hold KV")
        client.send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        wait_idle(endpoint, min_aborted=before["aborted_requests"] + 1, timeout=30)
        assert time.monotonic() - frozen_at < m.CLIENT_TIMEOUT_S + 5
        client.send_signal(signal.SIGCONT)  # well before the server's 10 s heartbeat timeout
        try:
            out, _ = client.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail("the resumed client still waits: the server dropped its final reply")
        last = out.strip().splitlines()[-1]
        assert last in ("final abort", f"error {m.ERROR_DISCONNECTED}"), out
    finally:
        client.kill()
        client.wait()


PROGRAM_TIMEOUT_S = 60


@sgl.function
def story_with_branches(s: Any) -> None:
    s += "Once upon a time"
    s += sgl.gen("opening", max_tokens=1000, temperature=0, ignore_eos=True)
    forks = s.fork(2)
    forks += sgl.gen("branch", max_tokens=8, temperature=0)
    forks.join()


def scheduler_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_killed_server_fails_clients_and_programs_fast_and_the_scheduler_exits(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The server process SIGKILLed while clients stream, block, run a streaming DSL program,
    wait for a slow grammar and stream over HTTP, all without a timeout (the default: they wait
    while the server reports their requests alive, and say so in the log): every call raises
    `disconnected` within 5 s, the program's error() and text_iter() report it, a later call
    fails within its timeout, and the orphaned scheduler exits instead of lingering."""
    # outlines: its compile of a{0,100000} is the slow grammar (llguidance's takes a millisecond)
    rt = Server(max_total_tokens=4096, num_threads=1, log_level="error", grammar_backend="outlines")
    scheduler_pid = rt.endpoint.health()["scheduler_pid"]
    caplog.set_level(logging.INFO, logger="radixflow")
    liveness = sgl.Liveness(interval_s=0.2, log_after_s=0.5)
    try:
        endpoint = RuntimeEndpoint(rt.address, liveness=liveness)
        over_http = RuntimeEndpoint(rt.url, liveness=liveness)
        slow_grammar = {
            "stream": False,
            "text": "Say a",
            "sampling_params": {"regex": "a{0,100000}"},
        }
        clients = start_clients(endpoint, [{"stream": True}, {"stream": False}, slow_grammar])
        clients += start_clients(over_http, [{"stream": True}])
        state = story_with_branches.run(backend=endpoint, stream=True)
        pieces = state.text_iter()
        assert finishes(lambda: next(pieces), PROGRAM_TIMEOUT_S) == "Once upon a time"
        assert clients[0][1].streaming.wait(60) and clients[3][1].streaming.wait(60)
        wait_for(lambda: endpoint.stats()["running_requests"] == 4, 60, "4 requests running")
        wait_for(lambda: waiting_lines(caplog, "tokens so far"), 10, "a waiting stream's log")
        wait_for(lambda: waiting_lines(caplog, "queued of"), 10, "a waiting HTTP call's log")

        killed_at = time.monotonic()
        rt.process.kill()
        error = finishes(state.error, 10)
        for thread, _ in clients:
            thread.join(10)
        assert isinstance(error, RuntimeEndpointError) and error.code == m.ERROR_DISCONNECTED
        with pytest.raises(sgl.ProgramError) as info:
            finishes(lambda: list(pieces), 10)
        assert info.value.__cause__ is error
        outcomes = [outcome for _, outcome in clients]
        assert [o.code for o in outcomes] == [m.ERROR_DISCONNECTED] * 4
        last = max(o.at for o in outcomes) - killed_at
        print(f"\nserver SIGKILL -> last client error: {last:.2f}s")
        assert last < 5

        start = time.monotonic()
        with pytest.raises(RuntimeEndpointError) as later:
            endpoint.generate("Hello", GREEDY, timeout=3)
        assert later.value.code == m.ERROR_DISCONNECTED and time.monotonic() - start < 5
        endpoint.close()
        over_http.close()
        wait_for(lambda: scheduler_gone(scheduler_pid), 10, "the orphaned scheduler to exit")
    finally:
        rt.shutdown()
        if not scheduler_gone(scheduler_pid):
            os.kill(scheduler_pid, signal.SIGKILL)


def waiting_lines(caplog: pytest.LogCaptureFixture, part: str) -> list[str]:
    """The clients' "waiting for request" log lines that contain `part`."""
    lines = [r.getMessage() for r in caplog.records]
    return [line for line in lines if line.startswith("waiting for request") and part in line]


# ---- program-level faults -----------------------------------------------------------------


class ToolError(RuntimeError):
    """What a tool called from a program body raises."""


def test_exception_in_a_program_surfaces_and_its_branches_finish(
    endpoint: RuntimeEndpoint, engine: Any
) -> None:
    @sgl.function
    def explodes(s: Any) -> None:
        s += "Once upon a time"
        forks = s.fork(2)
        forks += sgl.gen("story", max_tokens=8, temperature=0)
        raise ToolError("the tool failed")

    state = finishes(lambda: explodes.run(backend=endpoint), PROGRAM_TIMEOUT_S)
    assert isinstance(finishes(state.error, PROGRAM_TIMEOUT_S), ToolError)
    with pytest.raises(sgl.ProgramError) as info:
        finishes(state.text, PROGRAM_TIMEOUT_S)
    assert isinstance(info.value.__cause__, ToolError)
    branches = state.stream_executor.children  # never joined: closed when the body ended
    assert len(branches) == 2
    assert all(b.done.wait(PROGRAM_TIMEOUT_S) for b in branches), "a branch never ended"
    want = engine.generate("Once upon a time", GREEDY)["text"]
    assert [b.variables.get("story") for b in branches] == [want, want]  # siblings finished
    wait_idle(endpoint)


def test_failed_gen_fails_the_program_and_its_siblings_finish(
    endpoint: RuntimeEndpoint, engine: Any
) -> None:
    prompt = "Q: pick a number. A:"
    unsupported = "(?=1)1"  # Python's re accepts it (so gen() does); the grammar backend cannot
    groups: list[Any] = []

    @sgl.function
    def bad_branch(s: Any) -> None:
        s += prompt
        forks = s.fork(3)
        groups.append(forks)
        forks += [
            sgl.gen("x", max_tokens=8, temperature=0),
            sgl.gen("x", max_tokens=8, regex=unsupported),
            sgl.gen("x", max_tokens=8, temperature=0),
        ]
        forks.join()
        s += sgl.gen("after", max_tokens=4)

    state = finishes(lambda: bad_branch.run(backend=endpoint), PROGRAM_TIMEOUT_S)
    error = finishes(state.error, PROGRAM_TIMEOUT_S)
    assert isinstance(error, RuntimeEndpointError), error
    assert error.code in (m.ERROR_FAILED, m.ERROR_INVALID_REQUEST) and "grammar" in str(error)
    with pytest.raises(sgl.ProgramError) as info:
        finishes(lambda: state["after"], PROGRAM_TIMEOUT_S)  # skipped: the join failed
    assert info.value.__cause__ is error
    first, failed, third = groups[0]
    want = engine.generate(prompt, GREEDY)["text"]
    assert finishes(lambda: (first["x"], third["x"]), PROGRAM_TIMEOUT_S) == (want, want)
    assert finishes(failed.error, PROGRAM_TIMEOUT_S) is error

    @sgl.function
    def bad_gen(s: Any) -> None:
        s += prompt + sgl.gen("x", max_tokens=8, regex=unsupported) + sgl.gen("y", max_tokens=2)

    state = finishes(lambda: bad_gen.run(backend=endpoint), PROGRAM_TIMEOUT_S)
    with pytest.raises(sgl.ProgramError) as info:
        finishes(lambda: state["y"], PROGRAM_TIMEOUT_S)
    assert isinstance(info.value.__cause__, RuntimeEndpointError)
    assert finishes(state.error, PROGRAM_TIMEOUT_S) is info.value.__cause__
    wait_idle(endpoint)
