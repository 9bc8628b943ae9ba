"""Every message that crosses a process boundary, and the wire protocol (this docstring).

Framing
    Client <-> server: ZeroMQ DEALER (client) / ROUTER (server) over TCP, default
    tcp://127.0.0.1:30000. Server <-> scheduler: PUSH/PULL over ipc:// sockets in a private
    temp dir. Every ZeroMQ message is ONE frame holding ONE msgpack map (string keys, no ext
    types, no pickle) with an envelope:

        {"v": 1, "t": <type tag>, ["key": <api key>,] <the message's fields>...}

    "v" is PROTOCOL_VERSION; "t" names the message; "key" is the API key, sent by clients
    when the server has one (checked on every message). Field names are exactly the
    dataclass field names below; a field with a default may be omitted, any other field is
    required, and an unknown field, a wrong type (a bool is not an int; an int is accepted
    for a float), an unknown tag or another version is a protocol error. Token ids are plain
    int lists. Frames larger than `max_message_bytes` are refused before unpacking, and the
    unpacker's string/array/map limits derive from the same number.

Client requests (client -> server), each with a client-chosen `rid` (unique among the
client's requests in flight, 1 to 256 characters where the scheduler serves it; abort by rid
is global). A value the request cannot be served with (ranges, lengths, sampling) is an
`invalid_request` error; a grammar the scheduler cannot build may instead end as `failed`:
    generate      text | input_ids (exactly one), sampling_params (SamplingParams names;
                  n must be 1: send n requests), stream, return_logprob, logprob_start_len
                  (-1: output logprobs only), top_logprobs_num (0 to 64)
    score         prefix, continuations (non-empty strings), unconditional. Each
                  continuation is tokenized on its own (no special tokens) and appended to the
                  tokenized prefix; all continuations run as one batch of prefill-only requests
                  sharing the prefix through the radix cache.
    cache_prefix  text: prefill only (max_new_tokens = 0) so later requests hit the cache
    abort         target_rid: finish that request wherever it is (queued, chunking,
                  decoding); idempotent, an unknown or finished rid is not an error
    status        target_rids: where each of those requests stands. A client waiting on a
                  generation without a timeout asks every few seconds: a request the server
                  answers for is alive, one it no longer knows is lost
    flush_cache, model_info, stats, health: no fields besides rid
    ping          no fields and no reply. A client with requests in flight sends one at least
                  every PING_INTERVAL_S; the server aborts the requests of a client it has not
                  heard from (any frame) for CLIENT_TIMEOUT_S (the client crashed or froze).

Replies (server -> client), every one carrying the request's rid:
    zero or more `chunk` (only for generate with stream=True), then exactly ONE final reply:
    `result` or `error`. Nothing else is ever sent for that rid. A streamed generate ends
    with the same full `result` as an unstreamed one (the client derives its last chunk).
    chunk   text (cumulative, held back at an incomplete UTF-8 character or a possible stop
            string), new_ids (output ids since the previous chunk), meta_info (id and the
            cumulative prompt/completion/cached token counts; with return_logprob,
            output_token_logprobs holds only the entries of new_ids, each
            [logprob, token_id, None])
    result  data, by request type:
            generate      {"text", "output_ids", "meta_info"}: the full output; meta_info has
                          id, prompt_tokens, completion_tokens, cached_tokens, finish_reason
                          ({"type": "stop", "matched": str|int} | {"type": "length",
                          "length": n} | {"type": "abort", "message": str}), latencies and,
                          with return_logprob, all output_token_logprobs (and
                          input_token_logprobs from logprob_start_len, top logprobs when asked)
            score         {"choices": [{"text", "token_ids", "logprobs",
                          "unconditional_logprobs" (list or None)}]}: logprobs of exactly the
                          continuation's tokens; a token without context (the first one
                          unconditionally, or after an empty prefix) reports 0.0. Aborted:
                          {"choices": [], "aborted": true}
            cache_prefix  {"meta_info": {...}}
            abort         {"aborted": bool}     flush_cache  {"flushed": bool}
            model_info    {"model", "model_path", "chat_template", "special_tokens",
                          "bos_token", "eos_token", "eos_token_ids", "context_length",
                          "vocab_size", "max_new_tokens_limit", "protocol_version", ...}
            stats         the scheduler's stats (free_slots, total_slots, evictable_tokens,
                          running/waiting requests, cache_hit_rate, ..., "idle_check": "ok" or
                          the failed invariant, or None while busy) and "server": counters
            health        {"ok": bool, "status": "ok" | "restarting" | "dead" | ..., ...}
            status        {"requests": {target_rid: {"state": "in_flight", "seconds": s,
                          "completion_tokens": n (streams only)} | {"state": "unknown"}},
                          "running_requests", "waiting_requests" (the scheduler's), "status"}
    error   code (one of the ERROR_* names below), message. A frame that cannot be parsed far
            enough to find its rid is answered with an error whose rid is "".
    A request aborted by its client ends with a `result` whose finish_reason type is "abort";
    a request the server or scheduler could not serve ends with an `error`.

Server <-> scheduler (ipc, same envelope, never seen by clients):
    server -> scheduler: add_requests (a batch of ReqSpec, admitted in the same step; each
        carries its SamplingParams typed, as validated by the server, never re-parsed),
        abort_requests (rids), flush (rid), shutdown
    scheduler -> server: scheduler_ready (model_info, pid) once at start, request_updates (a
        batch of ReqUpdate after each step: stream requests every step they produce tokens,
        the others only when finished; new ids and logprobs are incremental), scheduler_stats
        (on becoming idle, with the idle leak check, a few times a second while busy, and
        ahead of every request_updates that finishes a request, so the stats a client reads
        after its final reply count that request),
        flush_done (rid, flushed)
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, Union

import msgpack

from radixflow.runtime.protocol.sampling import SamplingParams

PROTOCOL_VERSION = 1
PING_INTERVAL_S = 1.0
CLIENT_TIMEOUT_S = 6.0

ERROR_BAD_MESSAGE = "bad_message"  # not msgpack, not a map, missing/unknown/mistyped field
ERROR_BAD_VERSION = "bad_version"
ERROR_UNKNOWN_TYPE = "unknown_type"
ERROR_TOO_LARGE = "too_large"
ERROR_UNAUTHORIZED = "unauthorized"
ERROR_INVALID_REQUEST = "invalid_request"  # well-formed but invalid values (sampling, lengths)
ERROR_DUPLICATE_RID = "duplicate_rid"
ERROR_FAILED = "failed"  # the scheduler could not run it (bad grammar, out of KV, ...)
ERROR_UNAVAILABLE = "unavailable"  # the scheduler process died or is restarting
ERROR_SHUTDOWN = "shutdown"
ERROR_INTERNAL = "internal"  # a server bug, logged with its traceback
ERROR_TIMEOUT = "timeout"  # client side only (never on the wire): no reply in time
ERROR_DISCONNECTED = "disconnected"  # client side only: the connection dropped


class ProtocolError(ValueError):
    """A frame that breaks the protocol. `code` is an ERROR_* name; `rid` is the request id when
    the frame got far enough to have one, else ""."""

    def __init__(self, code: str, message: str, rid: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.rid = rid


# ---- client -> server -------------------------------------------------------------------


@dataclass(frozen=True)
class Generate:
    TAG: ClassVar[str] = "generate"
    rid: str
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0


@dataclass(frozen=True)
class Score:
    TAG: ClassVar[str] = "score"
    rid: str
    prefix: str
    continuations: list[str]
    unconditional: bool = False


@dataclass(frozen=True)
class CachePrefix:
    TAG: ClassVar[str] = "cache_prefix"
    rid: str
    text: str


@dataclass(frozen=True)
class Abort:
    TAG: ClassVar[str] = "abort"
    rid: str
    target_rid: str


@dataclass(frozen=True)
class FlushCache:
    TAG: ClassVar[str] = "flush_cache"
    rid: str


@dataclass(frozen=True)
class ModelInfo:
    TAG: ClassVar[str] = "model_info"
    rid: str


@dataclass(frozen=True)
class Stats:
    TAG: ClassVar[str] = "stats"
    rid: str


@dataclass(frozen=True)
class Health:
    TAG: ClassVar[str] = "health"
    rid: str


@dataclass(frozen=True)
class Status:
    TAG: ClassVar[str] = "status"
    rid: str
    target_rids: list[str]


@dataclass(frozen=True)
class Ping:
    TAG: ClassVar[str] = "ping"


# ---- server -> client -------------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    TAG: ClassVar[str] = "chunk"
    rid: str
    text: str
    new_ids: list[int]
    meta_info: dict[str, Any]


@dataclass(frozen=True)
class Result:
    TAG: ClassVar[str] = "result"
    rid: str
    data: dict[str, Any]


@dataclass(frozen=True)
class Error:
    TAG: ClassVar[str] = "error"
    rid: str
    code: str
    message: str


# ---- server <-> scheduler ---------------------------------------------------------------


@dataclass(frozen=True)
class ReqSpec:
    """One scheduler request (not a message itself: travels inside AddRequests)."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams  # validated once where the request entered (server or Engine)
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0


@dataclass(frozen=True)
class ReqUpdate:
    """Progress of one request since its previous update (inside RequestUpdates)."""

    rid: str
    new_ids: list[int]
    new_logprobs: list[float] = field(default_factory=list)
    new_top_logprobs: list[Any] = field(default_factory=list)
    finished: bool = False
    finish_reason: dict[str, Any] | None = None
    error: str | None = None
    meta_info: dict[str, Any] | None = None
    input_logprobs: list[float | None] = field(default_factory=list)  # set when finished
    input_top_logprobs: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class AddRequests:
    TAG: ClassVar[str] = "add_requests"
    reqs: list[ReqSpec]


@dataclass(frozen=True)
class AbortRequests:
    TAG: ClassVar[str] = "abort_requests"
    rids: list[str]
    message: str = "aborted"


@dataclass(frozen=True)
class Flush:
    TAG: ClassVar[str] = "flush"
    rid: str


@dataclass(frozen=True)
class Shutdown:
    TAG: ClassVar[str] = "shutdown"


@dataclass(frozen=True)
class SchedulerReady:
    TAG: ClassVar[str] = "scheduler_ready"
    model_info: dict[str, Any]
    pid: int
    load_seconds: float


@dataclass(frozen=True)
class SchedulerFailed:
    """The scheduler could not start (the model and its pool do not fit, an unsupported or
    broken model): the server stops with this message; the scheduler exits."""

    TAG: ClassVar[str] = "scheduler_failed"
    message: str


@dataclass(frozen=True)
class RequestUpdates:
    TAG: ClassVar[str] = "request_updates"
    updates: list[ReqUpdate]


@dataclass(frozen=True)
class SchedulerStats:
    TAG: ClassVar[str] = "scheduler_stats"
    stats: dict[str, Any]
    idle_check: str | None = None  # "ok" or the failed invariant when idle; None while busy


@dataclass(frozen=True)
class FlushDone:
    TAG: ClassVar[str] = "flush_done"
    rid: str
    flushed: bool


CLIENT_REQUESTS = (
    Generate,
    Score,
    CachePrefix,
    Abort,
    FlushCache,
    ModelInfo,
    Stats,
    Health,
    Status,
    Ping,
)
CLIENT_REPLIES = (Chunk, Result, Error)
TO_SCHEDULER = (AddRequests, AbortRequests, Flush, Shutdown)
FROM_SCHEDULER = (SchedulerReady, SchedulerFailed, RequestUpdates, SchedulerStats, FlushDone)
ALL_MESSAGES = CLIENT_REQUESTS + CLIENT_REPLIES + TO_SCHEDULER + FROM_SCHEDULER

M = TypeVar("M")
ENVELOPE_KEYS = ("v", "t", "key")


# ---- encoding ---------------------------------------------------------------------------


def encode(message: Any, api_key: str = "") -> bytes:
    """One frame for `message`. numpy / torch scalars and arrays become plain ints and lists."""
    body = {"v": PROTOCOL_VERSION, "t": message.TAG, **_to_map(message)}
    if api_key:
        body["key"] = api_key
    return msgpack.packb(body, use_bin_type=True, default=_to_builtin)


def _to_map(obj: Any) -> dict[str, Any]:
    return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return _to_map(value)
    if isinstance(value, (list, tuple)) and value and dataclasses.is_dataclass(value[0]):
        return [_to_map(v) for v in value]
    if isinstance(value, tuple):
        return list(value)
    return value


def _to_builtin(obj: Any) -> Any:
    """msgpack's fallback: numpy/torch scalars and arrays have `tolist()`."""
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):
        return tolist()
    raise TypeError(f"cannot encode {type(obj).__name__} in a message")


# ---- decoding ---------------------------------------------------------------------------


def decode(frame: bytes, family: tuple[type[M], ...], max_bytes: int = 64 << 20) -> M:
    """Parse one frame into one of `family`'s messages. Raises ProtocolError."""
    return decode_with_key(frame, family, max_bytes)[0]


def decode_with_key(
    frame: bytes, family: tuple[type[M], ...], max_bytes: int = 64 << 20
) -> tuple[M, str]:
    """Like `decode`, also returning the envelope's API key ("" when absent)."""
    body = _unpack(frame, max_bytes)
    rid = body.get("rid") if isinstance(body.get("rid"), str) else ""
    if "v" not in body:
        raise ProtocolError(ERROR_BAD_VERSION, "missing protocol version 'v'", rid)
    if body["v"] != PROTOCOL_VERSION or isinstance(body["v"], bool):
        raise ProtocolError(
            ERROR_BAD_VERSION,
            f"protocol version {body['v']!r} is not supported (this side speaks "
            f"{PROTOCOL_VERSION})",
            rid,
        )
    tag = body.get("t")
    cls = next((c for c in family if c.TAG == tag), None)
    if cls is None:
        raise ProtocolError(ERROR_UNKNOWN_TYPE, f"unknown message type {tag!r}", rid)
    key = body.get("key", "")
    if not isinstance(key, str):
        raise ProtocolError(ERROR_BAD_MESSAGE, "'key' must be a string", rid)
    fields = {k: v for k, v in body.items() if k not in ENVELOPE_KEYS}
    return _from_map(cls, fields, tag, rid), key


def _unpack(frame: bytes, max_bytes: int) -> dict[str, Any]:
    if len(frame) > max_bytes:
        message = f"frame of {len(frame)} bytes exceeds {max_bytes}"
        raise ProtocolError(ERROR_TOO_LARGE, message, peek_rid(frame))
    try:
        body = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            max_str_len=max_bytes,
            max_bin_len=max_bytes,
            max_array_len=max_bytes,
            max_map_len=max_bytes // 2,
            max_ext_len=0,
        )
    except (ValueError, TypeError) as e:  # msgpack's errors are ValueError subclasses
        raise ProtocolError(
            ERROR_BAD_MESSAGE, f"not a msgpack frame: {e or type(e).__name__}"
        ) from e
    if not isinstance(body, dict):
        raise ProtocolError(ERROR_BAD_MESSAGE, f"frame is a {type(body).__name__}, not a map")
    return body


def peek_rid(frame: bytes) -> str:
    """The top-level "rid" of a msgpack map frame, found by skipping every other value without
    building it (keys and the rid are read under a 1 KiB limit), or "" if there is none.
    Lets a `too_large` refusal reach the call that sent the oversized frame."""
    unpacker = msgpack.Unpacker(
        raw=False,
        max_buffer_size=max(len(frame), 1),
        max_str_len=1024,
        max_bin_len=1024,
        max_array_len=0,
        max_map_len=0,
        max_ext_len=0,
    )
    try:
        unpacker.feed(frame)
        for _ in range(unpacker.read_map_header()):
            if unpacker.unpack() == "rid":
                rid = unpacker.unpack()
                return rid if isinstance(rid, str) else ""
            unpacker.skip()
    except (ValueError, TypeError, msgpack.OutOfData, msgpack.StackError):
        pass
    return ""


def _from_map(cls: type[M], body: dict[str, Any], where: str, rid: str = "") -> M:
    spec = _field_spec(cls)
    unknown = sorted(map(repr, set(body) - set(spec)))  # keys may be bytes, ints, ...
    if unknown:
        raise ProtocolError(ERROR_BAD_MESSAGE, f"{where}: unknown field(s) {unknown}", rid)
    values = {}
    for name, (hint, required) in spec.items():
        if name not in body:
            if required:
                raise ProtocolError(ERROR_BAD_MESSAGE, f"{where}: missing field {name!r}", rid)
            continue
        values[name] = _check(body[name], hint, f"{where}.{name}", rid)
    return cls(**values)


@functools.cache
def _field_spec(cls: type) -> dict[str, tuple[Any, bool]]:
    hints = typing.get_type_hints(cls)
    return {
        f.name: (
            hints[f.name],
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
        )
        for f in dataclasses.fields(cls)
    }


def _check(value: Any, hint: Any, where: str, rid: str) -> Any:
    """`value` if it matches the type `hint` (converted where harmless), else ProtocolError."""
    if hint is Any:
        return value
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in typing.get_args(hint):
            return None
        for arg in typing.get_args(hint):
            if arg is not type(None) and _matches_shallow(value, arg):
                return _check(value, arg, where, rid)
    elif origin is list:
        return _check_list(value, typing.get_args(hint)[0], where, rid)
    elif origin is tuple:  # only tuple[X, ...]
        return tuple(_check_list(value, typing.get_args(hint)[0], where, rid))
    elif origin is dict:
        if isinstance(value, dict):
            return value  # string keys are guaranteed by strict_map_key
    elif dataclasses.is_dataclass(hint):
        if isinstance(value, dict):
            return _from_map(hint, value, where, rid)
    elif _matches_shallow(value, hint):
        return float(value) if hint is float else value
    raise ProtocolError(
        ERROR_BAD_MESSAGE, f"{where}: expected {_type_name(hint)}, got {type(value).__name__}", rid
    )


def _check_list(value: Any, item: Any, where: str, rid: str) -> list[Any]:
    if isinstance(value, list):
        if item is int and all(type(v) is int for v in value):
            return value
        if item in (str, Any) and all(item is Any or type(v) is str for v in value):
            return value
        if item not in (int, str):
            return [_check(v, item, f"{where}[{i}]", rid) for i, v in enumerate(value)]
    raise ProtocolError(ERROR_BAD_MESSAGE, f"{where}: expected a list of {_type_name(item)}", rid)


def _matches_shallow(value: Any, hint: Any) -> bool:
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    origin = typing.get_origin(hint)
    if origin in (list, tuple):
        return isinstance(value, list)
    if origin is dict or dataclasses.is_dataclass(hint):
        return isinstance(value, dict)
    return hint is Any


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
