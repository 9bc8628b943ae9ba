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
                  (-1: output logprobs only), top_logprobs_num (0 to 64), lora_path (the
                  name of a loaded LoRA adapter, or None for the base model; an unknown
                  name is an invalid_request)
    score         prefix, continuations (non-empty strings), unconditional. Each
                  continuation is tokenized on its own (no special tokens) and appended to the
                  tokenized prefix; all continuations run as one batch of prefill-only requests
                  sharing the prefix through the radix cache.
    cache_prefix  text: prefill only (max_new_tokens = 0) so later requests hit the cache
    embed         text (a list of strings) | input_ids (a list of id lists), exactly one, not
                  empty; pooling "last" (the last token's hidden state), "mean" (of every
                  position's) or "cls" (the first position's); "" (default): the model's own
                  ("last" for a decoder, an encoder's sentence-transformers pooling config).
                  An encoder's text gets its special tokens. Each input is one prefill-only
                  request (checked against the context as a generate prompt is); all run as
                  one batch, and with generate requests in the same steps. A server started
                  with --is-embedding refuses generate, score and cache_prefix.
    abort         target_rid: finish that request wherever it is (queued, chunking,
                  decoding); idempotent, an unknown or finished rid is not an error
    status        target_rids: where each of those requests stands. A client waiting on a
                  generation without a timeout asks every few seconds: a request the server
                  answers for is alive, one it no longer knows is lost
    flush_cache, model_info, stats, health: no fields besides rid
    load_lora_adapter    lora_name, lora_path (a PEFT adapter directory on the server's disk)
    unload_lora_adapter  lora_name; refused while a request under that adapter is in flight
    model         on every request above but abort, status and ping: the model it is for,
                  optional. A server of one model accepts its own name (its served name or
                  path), "default" or none, and answers any other with invalid_request; the
                  desk (`--model-path NAME=PATH` more than once) sends it to that model,
                  loading it first (none: the first model; abort and status follow their
                  target's model). Omitted from the frame when None.
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
            embed         {"embeddings": [[float, ...], ...] (one per input, in order: the
                          final hidden state after the model's final norm, pooled, L2-
                          normalized), "prompt_tokens": [n, ...], "cached_tokens": [n, ...]}.
                          Aborted: {"embeddings": [], "aborted": true}
            abort         {"aborted": bool}     flush_cache  {"flushed": bool}
            load_lora_adapter, unload_lora_adapter  {"success": bool, "error_message":
                          str | None, "loaded_adapters": {name: path}} (SGLang's shape)
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
        abort_requests (rids), flush (rid), shutdown, load_lora_adapter and
        unload_lora_adapter (as the client's, with the server's rid)
    scheduler -> server: scheduler_ready (model_info, pid) once at start, request_updates (a
        batch of ReqUpdate after each step: stream requests every step they produce tokens,
        the others only when finished; new ids and logprobs are incremental; an embedding
        request's final update carries its pooled vector), scheduler_stats
        (on becoming idle, with the idle leak check, a few times a second while busy, and
        ahead of every request_updates that finishes a request, so the stats a client reads
        after its final reply count that request),
        flush_done (rid, flushed), lora_updated (rid, error: "" on success, adapters: the
        adapters loaded after it, {name: path})
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from radixflow.runtime.protocol.sampling import SamplingParams

PROTOCOL_VERSION = 1
POOLINGS = ("last", "mean", "cls")  # how an embed request pools its hidden states
EMBEDDING_ONLY = "this server serves embeddings (--is-embedding)"  # a generation's refusal
# the model a request is for, on a server of several models (the desk); None: the server's
# own (or the desk's first). Left out of the frame when None, so servers older than it parse it.
MODEL: Any = field(default=None, metadata={"omit_none": True})
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
    priority: int = 0  # larger first, with --enable-priority-scheduling
    lora_path: str | None = None  # the name of a loaded LoRA adapter (SGLang's field)
    # images of a vision model, in the order of the image placeholders in the prompt: each an
    # encoded file's bytes (PNG, JPEG, ...), or a str (a data: URL or base64; a local path
    # where the server allows it)
    image_data: list[bytes | str] | None = None
    model: str | None = MODEL


@dataclass(frozen=True)
class Score:
    TAG: ClassVar[str] = "score"
    rid: str
    prefix: str
    continuations: list[str]
    unconditional: bool = False
    model: str | None = MODEL


@dataclass(frozen=True)
class CachePrefix:
    TAG: ClassVar[str] = "cache_prefix"
    rid: str
    text: str
    model: str | None = MODEL


@dataclass(frozen=True)
class Embed:
    TAG: ClassVar[str] = "embed"
    rid: str
    text: list[str] | None = None
    input_ids: list[list[int]] | None = None
    pooling: str = ""  # "": the model's default
    model: str | None = MODEL


@dataclass(frozen=True)
class Abort:
    TAG: ClassVar[str] = "abort"
    rid: str
    target_rid: str


@dataclass(frozen=True)
class FlushCache:
    TAG: ClassVar[str] = "flush_cache"
    rid: str
    model: str | None = MODEL


@dataclass(frozen=True)
class ModelInfo:
    TAG: ClassVar[str] = "model_info"
    rid: str
    model: str | None = MODEL


@dataclass(frozen=True)
class Stats:
    TAG: ClassVar[str] = "stats"
    rid: str
    model: str | None = MODEL


@dataclass(frozen=True)
class Health:
    TAG: ClassVar[str] = "health"
    rid: str
    model: str | None = MODEL


@dataclass(frozen=True)
class Status:
    TAG: ClassVar[str] = "status"
    rid: str
    target_rids: list[str]


@dataclass(frozen=True)
class Ping:
    TAG: ClassVar[str] = "ping"


@dataclass(frozen=True)
class LoadLoraAdapter:
    """Client -> server, and server -> scheduler (with the server's rid)."""

    TAG: ClassVar[str] = "load_lora_adapter"
    rid: str
    lora_name: str
    lora_path: str
    model: str | None = MODEL


@dataclass(frozen=True)
class UnloadLoraAdapter:
    TAG: ClassVar[str] = "unload_lora_adapter"
    rid: str
    lora_name: str
    model: str | None = MODEL


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
class ImageItem:
    """One image of a request, checked and measured by the server (inside ReqSpec)."""

    data: bytes  # the encoded file (PNG, JPEG, ...), decoded again where it is encoded
    key: int  # from a hash of its decoded pixels: the tree key of its placeholder tokens
    offset: int  # index of its first placeholder token in the prompt
    grid: list[int]  # (t, h, w) in patches, before the spatial merge
    num_tokens: int  # placeholder tokens: t * h * w / merge_size**2


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
    priority: int = 0
    pooling: str = ""  # an embedding request (one of POOLINGS, prefill only); "" generates
    lora: str = ""  # the LoRA adapter's name; "": the base model
    # a vision model's images; their placeholder ids in input_ids are already `key`s
    images: list[ImageItem] = field(default_factory=list)


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
    embedding: list[float] | None = None  # an embedding request's pooled vector, when finished


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


@dataclass(frozen=True)
class LoraUpdated:
    """The scheduler's answer to a load/unload: error "" on success; the adapters loaded
    after it, {name: path}."""

    TAG: ClassVar[str] = "lora_updated"
    rid: str
    error: str
    adapters: dict[str, str]


CLIENT_REQUESTS = (
    Generate,
    Score,
    CachePrefix,
    Embed,
    Abort,
    FlushCache,
    ModelInfo,
    Stats,
    Health,
    Status,
    Ping,
    LoadLoraAdapter,
    UnloadLoraAdapter,
)
CLIENT_REPLIES = (Chunk, Result, Error)
TO_SCHEDULER = (AddRequests, AbortRequests, Flush, Shutdown, LoadLoraAdapter, UnloadLoraAdapter)
FROM_SCHEDULER = (
    SchedulerReady, SchedulerFailed, RequestUpdates, SchedulerStats, FlushDone, LoraUpdated
)  # fmt: skip
# the adapter load/unload requests travel on both legs (client -> server -> scheduler)
ALL_MESSAGES = tuple(
    dict.fromkeys(CLIENT_REQUESTS + CLIENT_REPLIES + TO_SCHEDULER + FROM_SCHEDULER)
)
