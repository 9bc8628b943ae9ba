"""The runtime server process: both client doors, validation, tokenization, streaming.

One asyncio loop (`Server.run`) owns everything: the ZeroMQ ROUTER for radixflow's own
protocol, the HTTP door (`runtime/server/http_api.py`: SGLang's native API, the OpenAI-compatible
API and /metrics) and the scheduler's PULL queue. Client requests from either door become the
same typed messages and the same Jobs (`runtime/server/jobs.py`); a Job's `identity` is a ZeroMQ
identity (bytes) or an HTTP handler's sink, and `_send` routes each reply to its door. Errors,
health and stats never wait on the model. The scheduler runs in its own process
(runtime/scheduler/loop.py); if it dies, every request in flight gets an error, the server
reports unhealthy and starts a new one. The protocol is in `runtime/protocol/messages.py`.

SIGTERM/SIGINT drain: new requests are refused (HTTP 503 with Retry-After, ZeroMQ an error
reply), /health answers 503 "draining" so a router stops sending, and the requests in flight
finish for up to `--shutdown-timeout` seconds (a second signal ends the wait); whatever is left
then gets an error reply, the scheduler is stopped and the process exits 0.

Requests are validated once, here, into typed messages (SamplingParams, RequestLimits).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import zmq

from radixflow.runtime import tokenizer
from radixflow.runtime.config import ServerConfig
from radixflow.runtime.protocol.messages import (
    ERROR_DUPLICATE_RID,
    ERROR_INTERNAL,
    ERROR_INVALID_REQUEST,
    ERROR_SHUTDOWN,
    ERROR_UNAVAILABLE,
    Abort,
    AbortRequests,
    AddRequests,
    CachePrefix,
    Embed,
    Error,
    Flush,
    FlushCache,
    FlushDone,
    Generate,
    Health,
    LoraUpdated,
    ModelInfo,
    Ping,
    ReqSpec,
    RequestUpdates,
    Result,
    SchedulerFailed,
    SchedulerReady,
    SchedulerStats,
    Score,
    Stats,
    Status,
)
from radixflow.runtime.protocol.transport import TransportError, is_loopback
from radixflow.runtime.server import control, reports
from radixflow.runtime.server.http_api import HttpDoor
from radixflow.runtime.server.jobs import (
    EmbedJob,
    FlushJob,
    GenerateJob,
    Job,
    ScoreJob,
    embed_spec,
    generate_spec,
    prefill_spec,
)
from radixflow.runtime.server.metrics import Metrics, load_summary
from radixflow.runtime.server.supervisor import SchedulerProcess
from radixflow.runtime.server.validation import (
    MAX_JOBS_IN_FLIGHT,
    MAX_RID_LEN,
    RequestError,
    RequestRules,
)
from radixflow.runtime.server.zmq_door import ZmqDoor
from radixflow.runtime.tokenizer import load_tokenizer

log = logging.getLogger("radixflow.server")

POLL_MS = 100
MAX_RESTARTS_IN_A_ROW = 3
MAX_PUMPS = 8  # drain rounds per callback before yielding to the HTTP handlers
DRAINING_MESSAGE = "the server is shutting down (draining): send the request to another server"
SHUTDOWN_MESSAGE = "the server is shutting down: the request did not finish within the drain"


class ServerStartError(RuntimeError):
    """The server could not start (bad host/key combination, the scheduler failed to load)."""


class Server:
    def __init__(self, config: ServerConfig, log_level: str = "info") -> None:
        if not is_loopback(config.host) and not config.api_key:
            raise ServerStartError(
                f"binding {config.host} (not loopback) requires --api-key; every message "
                "must then carry it"
            )
        self.config = config
        self.ctx = zmq.Context()
        self.scheduler = SchedulerProcess(self.ctx, config, log_level)
        self.zmq = ZmqDoor(self)
        self.address = ""  # tcp:// of the ZeroMQ door
        self.http_url = ""  # http:// of the HTTP door
        self.wakeup: asyncio.Event | None = None
        self.metrics = Metrics(lambda: self.scheduler_stats)
        self.status = "starting"
        self.last_error = ""
        self.start_error = ""  # the scheduler's SchedulerFailed message
        self.failed_starts = 0
        self.model_info: dict[str, Any] = {}
        self.tokenizer: Any = None
        self.rules: RequestRules | None = None  # once the model is known
        self.jobs: dict[str, Job] = {}  # by the client's rid
        self.by_internal: dict[str, Job] = {}  # by scheduler rid
        self.scheduler_stats: dict[str, Any] = {}
        self.idle_check: str | None = None
        self.counters: Counter[str] = Counter()
        self.next_id = 0
        self.drain_deadline: float | None = None  # set by the first SIGTERM/SIGINT
        self.started = time.monotonic()
        self.last_log = (time.monotonic(), 0)
        self.handlers = {
            Generate: self._on_generate,
            Score: self._on_score,
            CachePrefix: self._on_cache_prefix,
            Embed: self._on_embed,
            Abort: self._on_abort,
            FlushCache: self._on_flush,
            ModelInfo: self._on_report,
            Stats: self._on_report,
            Health: self._on_report,
            Status: self._on_report,
            Ping: lambda identity, msg: None,
            **control.lora_handlers(self),
        }

    # ---- lifecycle ------------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        """A stop was asked for: no new requests; the loop ends once the last one is done."""
        return self.drain_deadline is not None

    def start(self) -> str:
        """Start the scheduler, wait until it has loaded the model, bind the ZeroMQ socket.
        Returns its address (the HTTP door binds in `run`). Raises ServerStartError."""
        self.scheduler.spawn()
        tokenizer.preload()  # its imports beside the scheduler process's
        while self.status != "ok":
            if self.draining:
                raise ServerStartError("interrupted while starting")
            for msg in self.scheduler.inbox.drain(POLL_MS):
                self._on_scheduler_message(msg)
            if self.start_error:
                raise ServerStartError(self.start_error)
            code = self.scheduler.exit_code()
            if self.status != "ok" and code is not None:
                raise ServerStartError(f"the scheduler process exited ({code})")
        port = self.config.zmq_port if self.config.port else 0  # --port 0: both ports free
        self.address = self.zmq.bind(self.ctx, self.config.host, port)
        if self.config.api_key:
            log.warning("API key required: every message and HTTP request must carry it")
        return self.address

    def request_stop(self, *_: object) -> None:
        """Signal handler: drain (refuse new requests, give those in flight up to
        --shutdown-timeout seconds), then shut down; a second signal ends the drain now."""
        now = time.monotonic()
        first = self.drain_deadline is None
        self.drain_deadline = now + self.config.shutdown_timeout if first else now
        if self.wakeup is not None:
            self.wakeup.set()

    def _on_signal(self) -> None:
        self.request_stop()
        log.info(
            "stop requested: draining %d requests in flight (at most %.0fs more)",
            len(self.jobs),
            max((self.drain_deadline or 0.0) - time.monotonic(), 0.0),
        )

    def _drained(self) -> bool:
        """Draining, and nothing is left in flight or the drain's time is up."""
        if self.drain_deadline is None:
            return False
        return not self.jobs or time.monotonic() >= self.drain_deadline

    async def run(self, announce: Callable[[str, str], None]) -> None:
        """The loop, until request_stop's drain ends: bind HTTP, call `announce(http_url,
        zmq_address)`, then serve both doors; at the end every request still in flight gets an
        error reply."""

        assert self.zmq.router is not None, "start() first"
        loop = asyncio.get_running_loop()
        self.wakeup = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)
        door = HttpDoor(self)
        self.http_url = await door.start(self.config.host, self.config.port)
        sockets = (self.zmq.router, self.scheduler.inbox.socket)
        for sock in sockets:
            loop.add_reader(sock.getsockopt(zmq.FD), self._pump)
        announce(self.http_url, self.address)
        try:
            while not self._drained():
                self._pump()  # a safety net under the edge-triggered readers
                self._housekeeping()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.wakeup.wait(), POLL_MS / 1000)
                self.wakeup.clear()
        finally:
            log.info("shutting down: aborting %d requests still in flight", len(self.jobs))
            for sock in sockets:
                loop.remove_reader(sock.getsockopt(zmq.FD))
            self.status = "stopping"
            self._fail_all(ERROR_SHUTDOWN, SHUTDOWN_MESSAGE)
            await door.stop()  # HTTP handlers write their final answers first

    def _pump(self) -> None:
        """Drain the ROUTER and the scheduler queue. Their FDs are edge-triggered and a send
        can consume an edge, so keep going until ZMQ_EVENTS shows nothing left."""
        for _ in range(MAX_PUMPS):
            self.zmq.drain()
            for msg in self.scheduler.inbox.drain():
                self._on_scheduler_message(msg)
            scheduler_waiting = self.scheduler.inbox.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN
            if not (self.zmq.pending() or scheduler_waiting):
                return
        asyncio.get_running_loop().call_soon(self._pump)  # let HTTP handlers run meanwhile

    def _fail_all(self, code: str, message: str) -> None:
        for job in list(self.jobs.values()):
            self._end(job, Error(job.rid, code, message))

    def close(self) -> None:
        """Answer every request in flight, stop the scheduler, remove the ipc files."""
        self._fail_all(ERROR_SHUTDOWN, SHUTDOWN_MESSAGE)
        self.scheduler.close()
        self.zmq.close()
        self.ctx.term()

    # ---- the scheduler process ------------------------------------------------------------

    def _check_scheduler(self) -> None:
        """Fail everything in flight when the scheduler died; restart it (a few times)."""
        code = self.scheduler.reap()
        if code is None:
            return
        self.last_error = f"the scheduler process exited with code {code}"
        log.error("%s; failing %d requests in flight", self.last_error, len(self.jobs))
        for job in list(self.jobs.values()):
            self._end(job, Error(job.rid, ERROR_UNAVAILABLE, self.last_error))
        self.failed_starts += self.status != "ok"
        if self.draining:
            return
        if self.failed_starts >= MAX_RESTARTS_IN_A_ROW:
            self.status = "dead"
            log.error("the scheduler failed %d times in a row; giving up", self.failed_starts)
            return
        self.status = "restarting"
        self.scheduler.spawn()

    def _on_scheduler_message(self, msg: Any) -> None:
        if isinstance(msg, RequestUpdates):
            for update in msg.updates:
                self._on_update(update)
        elif isinstance(msg, SchedulerStats):
            self.scheduler_stats, self.idle_check = msg.stats, msg.idle_check
        elif isinstance(msg, (FlushDone, LoraUpdated)):
            control.on_reply(self, msg)
        elif isinstance(msg, SchedulerReady):
            self._on_ready(msg)
        elif isinstance(msg, SchedulerFailed):
            self.start_error = msg.message

    def _on_ready(self, msg: SchedulerReady) -> None:
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(msg.model_info["model_path"], self.config.chat_template)
        self.model_info = msg.model_info
        self.rules = RequestRules(self.config, self.model_info, self.tokenizer)
        self.status, self.failed_starts = "ok", 0
        log.info("scheduler %d ready (model loaded in %.1fs)", msg.pid, msg.load_seconds)

    # ---- requests (either door) ----------------------------------------------------------

    def handle(self, identity: Any, msg: Any) -> None:
        """Run one client request (either door); its replies go to `identity` by `_send`,
        an invalid one as an error reply."""
        rid = getattr(msg, "rid", "")
        try:
            self.handlers[type(msg)](identity, msg)
        except RequestError as e:
            self.counters[f"error_{e.code}"] += 1
            self._send(identity, Error(rid, e.code, str(e)))
        except Exception as e:  # a bug must cost one request, not the server
            log.exception("internal error on %s %r", msg.TAG, rid)
            self.counters[f"error_{ERROR_INTERNAL}"] += 1
            self._send(identity, Error(rid, ERROR_INTERNAL, f"{type(e).__name__}: {e}"))

    def submit_generates(self, requests: list[tuple[Any, Generate]]) -> None:
        """Validate a batch of generate requests (an HTTP batch, or n > 1) and send them to
        the scheduler as ONE add_requests, so they are admitted in the same step and share
        their prompt's KV. Raises RequestError for the first invalid one; none is sent then."""
        rids = [msg.rid for _, msg in requests]
        if len(set(rids)) != len(rids):
            raise RequestError(ERROR_DUPLICATE_RID, "the batch repeats a rid")
        prepared = [self._prepare_generate(identity, msg) for identity, msg in requests]
        self.counters["request_generate"] += len(prepared)
        for job, _ in prepared:
            self._register(job)
        specs = [dataclasses.replace(s, rid=job.internal[0]) for job, s in prepared]
        try:
            self.scheduler.put(AddRequests(specs))
        except TransportError as e:
            for job, _ in prepared:
                self._forget(job)
            raise RequestError(ERROR_UNAVAILABLE, "the scheduler is not connected") from e

    def _on_generate(self, identity: Any, msg: Generate) -> None:
        job, spec = self._prepare_generate(identity, msg)
        self._dispatch(job, [spec])

    def _prepare_generate(self, identity: Any, msg: Generate) -> tuple[GenerateJob, ReqSpec]:
        self._check_new(msg.rid)
        ids, sampling, defaults, (keyed, images) = self.rules.generate(msg)
        job = GenerateJob(identity, msg, ids, sampling, self.tokenizer, defaults)
        return job, generate_spec(msg, keyed, sampling, images)

    def _on_score(self, identity: Any, msg: Score) -> None:
        self._check_new(msg.rid)
        self.rules.check_generation()
        if not msg.continuations:
            raise RequestError(ERROR_INVALID_REQUEST, "continuations is empty")
        prefix = self.rules.encode(msg.prefix)
        conts = [self.rules.encode(c) for c in msg.continuations]
        if not all(conts):
            raise RequestError(ERROR_INVALID_REQUEST, "a continuation is empty")
        specs = [prefill_spec(prefix + ids, len(prefix)) for ids in conts]
        if msg.unconditional:
            specs += [prefill_spec(ids, 0) for ids in conts]
        for spec in specs:
            self.rules.check_limits(spec.input_ids, None)
        self._dispatch(ScoreJob(identity, msg, conts), specs)

    def _on_cache_prefix(self, identity: Any, msg: CachePrefix) -> None:
        self._check_new(msg.rid)
        self.rules.check_generation()
        ids = self.rules.prompt_ids(msg.text, None)
        self._dispatch(Job(identity, msg.rid), [prefill_spec(ids, -1)])

    def _on_embed(self, identity: Any, msg: Embed) -> None:
        """One prefill-only request per input, sent as one add_requests."""
        self._check_new(msg.rid)
        id_lists = self.rules.embed_inputs(msg)
        self.counters["request_embed"] += len(id_lists)
        pooling = msg.pooling or self.model_info["pooling"]
        self._dispatch(EmbedJob(identity, msg.rid), [embed_spec(i, pooling) for i in id_lists])

    def _on_abort(self, identity: Any, msg: Abort) -> None:
        found = msg.target_rid in self.jobs
        self.abort_rid(msg.target_rid)
        self._send(identity, Result(msg.rid, {"aborted": found}))

    def _on_flush(self, identity: Any, msg: FlushCache) -> None:
        self._check_new(msg.rid)
        job = FlushJob(identity, msg.rid)
        self._register(job)
        self._put(Flush(job.internal[0]), job)

    def _on_report(self, identity: Any, msg: ModelInfo | Stats | Health | Status) -> None:
        """Answered from the server's own state (reports.py), never waiting on the model."""
        if isinstance(msg, Status):
            data = reports.status_data(self, msg.target_rids)
        else:
            by_type = {ModelInfo: reports.model_info_data, Stats: reports.stats_data}
            data = by_type.get(type(msg), reports.health_data)(self)
        self._send(identity, Result(msg.rid, data))

    def abort_rid(self, rid: str, message: str = "aborted by the client") -> bool:
        """Abort request `rid` (either door's); False when it is not in flight."""
        job = self.jobs.get(rid)
        if job is None or isinstance(job, FlushJob):
            return False
        self._abort(job, message)
        return True

    def abort_identity(self, identity: Any, message: str) -> None:
        """Abort every request still in flight for `identity` (a client that left)."""
        for job in [j for j in self.jobs.values() if j.identity == identity]:
            if isinstance(job, FlushJob):
                self._forget(job)
            else:
                self._abort(job, message)

    def _check_new(self, rid: str) -> None:
        if self.draining:
            raise RequestError(ERROR_SHUTDOWN, DRAINING_MESSAGE)
        if self.status != "ok":
            reason = self.last_error or "the scheduler is not ready"
            raise RequestError(ERROR_UNAVAILABLE, f"{reason} (status: {self.status})")
        if not rid or len(rid) > MAX_RID_LEN:
            raise RequestError(ERROR_INVALID_REQUEST, f"rid must have 1 to {MAX_RID_LEN} chars")
        if rid in self.jobs:
            raise RequestError(ERROR_DUPLICATE_RID, f"request {rid!r} is already in flight")
        if len(self.jobs) >= MAX_JOBS_IN_FLIGHT:
            raise RequestError(
                ERROR_UNAVAILABLE, f"overloaded: {len(self.jobs)} requests in flight; retry later"
            )

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens added); raises RequestError."""
        return self.rules.encode(text)

    # ---- jobs -----------------------------------------------------------------------------

    def _register(self, job: Job, count: int = 1) -> None:
        for _ in range(count):
            self.next_id += 1
            job.internal.append(f"s{self.next_id}")
        self.jobs[job.rid] = job
        for rid in job.internal:
            self.by_internal[rid] = job

    def _dispatch(self, job: Job, specs: list[ReqSpec]) -> None:
        self._register(job, len(specs))
        specs = [dataclasses.replace(s, rid=r) for s, r in zip(specs, job.internal)]
        self._put(AddRequests(specs), job)

    def _put(self, msg: Any, job: Job) -> None:
        try:
            self.scheduler.put(msg)
        except TransportError as e:
            self._forget(job)
            raise RequestError(ERROR_UNAVAILABLE, "the scheduler is not connected") from e

    def _on_update(self, update: Any) -> None:
        job = self.by_internal.get(update.rid)
        if job is None:
            self.counters["stale_updates"] += 1  # its job already ended (scheduler restart)
            return
        for reply in job.on_update(update):
            if reply.TAG == "chunk":
                self._send(job.identity, reply)
            else:
                self._end(job, reply)

    def _abort(self, job: Job, message: str) -> None:
        job.abort_requested = True
        live = [rid for rid in job.internal if rid in self.by_internal]
        if live:
            try:
                self.scheduler.put(AbortRequests(live, message))
            except TransportError:
                log.warning("abort of %s not delivered: the scheduler is gone", job.rid)

    def _end(self, job: Job, reply: Any) -> None:
        """Send the one final reply of `job` and forget it."""
        self._forget(job)
        self.counters["errors" if reply.TAG == "error" else "results"] += 1
        self.metrics.on_final(job, reply)
        self._send(job.identity, reply)

    def _forget(self, job: Job) -> None:
        self.jobs.pop(job.rid, None)
        for rid in job.internal:
            self.by_internal.pop(rid, None)

    def _send(self, identity: Any, reply: Any) -> None:
        """To a ZeroMQ client (identity bytes) or an HTTP handler's sink (never blocks)."""
        if isinstance(identity, bytes):
            self.zmq.send(identity, reply)
        else:
            identity.deliver(reply)

    # ---- housekeeping ---------------------------------------------------------------------

    def _housekeeping(self) -> None:
        self._check_scheduler()
        self.zmq.check_clients()
        now = time.monotonic()
        since, decoded_before = self.last_log
        if now - since >= self.config.log_interval_s:  # the load line, while busy
            stats = self.scheduler_stats
            self.last_log = (now, stats.get("decode_tokens", 0))
            if self.jobs or stats.get("running_requests"):
                rate = (self.last_log[1] - decoded_before) / (now - since)
                log.info("%s", load_summary(stats, len(self.jobs), rate))
