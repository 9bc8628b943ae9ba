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
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import zmq

from radixflow.runtime.config import ServerConfig
from radixflow.runtime.protocol.limits import RequestLimits
from radixflow.runtime.protocol.messages import (
    ERROR_DUPLICATE_RID,
    ERROR_INTERNAL,
    ERROR_INVALID_REQUEST,
    ERROR_SHUTDOWN,
    ERROR_UNAVAILABLE,
    FROM_SCHEDULER,
    PROTOCOL_VERSION,
    Abort,
    AbortRequests,
    AddRequests,
    CachePrefix,
    Error,
    Flush,
    FlushCache,
    FlushDone,
    Generate,
    Health,
    ModelInfo,
    Ping,
    ReqSpec,
    RequestUpdates,
    Result,
    SchedulerFailed,
    SchedulerReady,
    SchedulerStats,
    Score,
    Shutdown,
    Stats,
    Status,
)
from radixflow.runtime.protocol.sampling import SamplingParams
from radixflow.runtime.protocol.transport import (
    PullQueue,
    PushQueue,
    TransportError,
    is_loopback,
    make_ipc_dir,
    remove_ipc_dir,
)
from radixflow.runtime.server.http_api import HttpDoor
from radixflow.runtime.server.jobs import FlushJob, GenerateJob, Job, ScoreJob, prefill_spec
from radixflow.runtime.server.metrics import Metrics, load_summary
from radixflow.runtime.server.zmq_door import ZmqDoor
from radixflow.runtime.tokenizer import load_tokenizer

log = logging.getLogger("radixflow.server")

POLL_MS = 100
MAX_RESTARTS_IN_A_ROW = 3
SHUTDOWN_WAIT_S = 10.0
MAX_TOP_LOGPROBS = 64
MAX_RID_LEN = 256
MAX_CHARS_PER_TOKEN = 64  # text longer than this times the context cannot fit it
MAX_PUMPS = 8  # drain rounds per callback before yielding to the HTTP handlers
MAX_JOBS_IN_FLIGHT = 4096  # more waiting requests than this: refuse new ones (overloaded)
MAX_STATUS_RIDS = MAX_JOBS_IN_FLIGHT  # a status query answers for at most this many rids
DRAINING_MESSAGE = "the server is shutting down (draining): send the request to another server"
SHUTDOWN_MESSAGE = "the server is shutting down: the request did not finish within the drain"


class ServerStartError(RuntimeError):
    """The server could not start (bad host/key combination, the scheduler failed to load)."""


class RequestError(ValueError):
    """A request that is answered with an error reply; `code` is an ERROR_* name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Server:
    def __init__(self, config: ServerConfig, log_level: str = "info") -> None:
        if not is_loopback(config.host) and not config.api_key:
            raise ServerStartError(
                f"binding {config.host} (not loopback) requires --api-key; every message "
                "must then carry it"
            )
        self.config = config
        self.log_level = log_level
        self.ctx = zmq.Context()
        self.ipc = make_ipc_dir()
        self.to_scheduler: PushQueue[Any] = PushQueue(self.ctx, self.ipc.to_scheduler, True)
        self.from_scheduler: PullQueue[Any] = PullQueue(
            self.ctx, self.ipc.from_scheduler, True, FROM_SCHEDULER
        )
        self.zmq = ZmqDoor(self)
        self.address = ""  # tcp:// of the ZeroMQ door
        self.http_url = ""  # http:// of the HTTP door
        self.wakeup: asyncio.Event | None = None
        self.metrics = Metrics(lambda: self.scheduler_stats)
        self.proc: subprocess.Popen[bytes] | None = None
        self.status = "starting"
        self.last_error = ""
        self.start_error = ""  # the scheduler's SchedulerFailed message
        self.restarts = 0
        self.failed_starts = 0
        self.model_info: dict[str, Any] = {}
        self.tokenizer: Any = None
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
            Abort: self._on_abort,
            FlushCache: self._on_flush,
            ModelInfo: self._on_model_info,
            Stats: self._on_stats,
            Health: self._on_health,
            Status: self._on_status,
            Ping: lambda identity, msg: None,
        }

    # ---- lifecycle ------------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        """A stop was asked for: no new requests; the loop ends once the last one is done."""
        return self.drain_deadline is not None

    def start(self) -> str:
        """Start the scheduler, wait until it has loaded the model, bind the ZeroMQ socket.
        Returns its address (the HTTP door binds in `run`). Raises ServerStartError."""
        self._spawn_scheduler()
        while self.status != "ok":
            if self.draining:
                raise ServerStartError("interrupted while starting")
            for msg in self.from_scheduler.drain(POLL_MS):
                self._on_scheduler_message(msg)
            if self.start_error:
                raise ServerStartError(self.start_error)
            if self.status != "ok" and self.proc is not None and self.proc.poll() is not None:
                raise ServerStartError(f"the scheduler process exited ({self.proc.returncode})")
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
        sockets = (self.zmq.router, self.from_scheduler.socket)
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
            for msg in self.from_scheduler.drain():
                self._on_scheduler_message(msg)
            scheduler_waiting = self.from_scheduler.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN
            if not (self.zmq.pending() or scheduler_waiting):
                return
        asyncio.get_running_loop().call_soon(self._pump)  # let HTTP handlers run meanwhile

    def _fail_all(self, code: str, message: str) -> None:
        for job in list(self.jobs.values()):
            self._end(job, Error(job.rid, code, message))

    def close(self) -> None:
        """Answer every request in flight, stop the scheduler, remove the ipc files."""
        self._fail_all(ERROR_SHUTDOWN, SHUTDOWN_MESSAGE)
        self._stop_scheduler()
        self.zmq.close()
        self.to_scheduler.close()
        self.from_scheduler.close()
        self.ctx.term()
        remove_ipc_dir(self.ipc)

    # ---- the scheduler process ------------------------------------------------------------

    def _spawn_scheduler(self) -> None:
        config = dataclasses.asdict(self.config.replace(api_key=""))
        cmd = [sys.executable, "-m", "radixflow.runtime", "scheduler", "--ipc-dir"]
        cmd += [self.ipc.directory, "--parent-pid", str(os.getpid())]
        cmd += ["--config-json", json.dumps(config), "--log-level", self.log_level]
        # PYTHONSAFEPATH: `-m` would put the working directory first on sys.path, and a
        # checkout's kernels/ folder there shadows the `kernels` package transformers imports
        env = {**os.environ, "PYTHONSAFEPATH": "1"}
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(), env=env
        )

    def _stop_scheduler(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.to_scheduler.put(Shutdown())
        except TransportError:
            self.proc.terminate()
        try:
            self.proc.wait(SHUTDOWN_WAIT_S)
        except subprocess.TimeoutExpired:
            log.error("scheduler did not stop in %.0fs; killing it", SHUTDOWN_WAIT_S)
            self.proc.kill()
            self.proc.wait()

    def _check_scheduler(self) -> None:
        """Fail everything in flight when the scheduler died; restart it (a few times)."""
        if self.proc is None or self.proc.poll() is None:
            return
        code = self.proc.returncode
        self.proc = None
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
        self.restarts += 1
        self._spawn_scheduler()

    def _on_scheduler_message(self, msg: Any) -> None:
        if isinstance(msg, RequestUpdates):
            for update in msg.updates:
                self._on_update(update)
        elif isinstance(msg, SchedulerStats):
            self.scheduler_stats, self.idle_check = msg.stats, msg.idle_check
        elif isinstance(msg, FlushDone):
            job = self.by_internal.pop(msg.rid, None)
            if job is not None:
                self._end(job, Result(job.rid, {"flushed": msg.flushed}))
        elif isinstance(msg, SchedulerReady):
            self._on_ready(msg)
        elif isinstance(msg, SchedulerFailed):
            self.start_error = msg.message

    def _on_ready(self, msg: SchedulerReady) -> None:
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(msg.model_info["model_path"], self.config.chat_template)
        self.model_info = msg.model_info
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
            self.to_scheduler.put(AddRequests(specs))
        except TransportError as e:
            for job, _ in prepared:
                self._forget(job)
            raise RequestError(ERROR_UNAVAILABLE, "the scheduler is not connected") from e

    def _on_generate(self, identity: Any, msg: Generate) -> None:
        job, spec = self._prepare_generate(identity, msg)
        self._dispatch(job, [spec])

    def _prepare_generate(self, identity: Any, msg: Generate) -> tuple[GenerateJob, ReqSpec]:
        self._check_new(msg.rid)
        ids = self._prompt_ids(msg.text, msg.input_ids)
        sampling = self._sampling(msg.sampling_params)
        self._check_limits(ids, sampling)
        if not -1 <= msg.logprob_start_len < len(ids):
            raise RequestError(
                ERROR_INVALID_REQUEST, f"logprob_start_len must be in [-1, {len(ids)})"
            )
        if not 0 <= msg.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise RequestError(
                ERROR_INVALID_REQUEST, f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}]"
            )
        job = GenerateJob(identity, msg, ids, sampling, self.tokenizer)
        spec = ReqSpec(
            "",
            ids,
            sampling,
            stream=msg.stream,
            return_logprob=msg.return_logprob,
            logprob_start_len=msg.logprob_start_len,
            top_logprobs_num=msg.top_logprobs_num,
        )
        return job, spec

    def _on_score(self, identity: Any, msg: Score) -> None:
        self._check_new(msg.rid)
        if not msg.continuations:
            raise RequestError(ERROR_INVALID_REQUEST, "continuations is empty")
        prefix = self._encode(msg.prefix)
        conts = [self._encode(c) for c in msg.continuations]
        if not all(conts):
            raise RequestError(ERROR_INVALID_REQUEST, "a continuation is empty")
        specs = [prefill_spec(prefix + ids, len(prefix)) for ids in conts]
        if msg.unconditional:
            specs += [prefill_spec(ids, 0) for ids in conts]
        for spec in specs:
            self._check_limits(spec.input_ids, None)
        self._dispatch(ScoreJob(identity, msg, conts), specs)

    def _on_cache_prefix(self, identity: Any, msg: CachePrefix) -> None:
        self._check_new(msg.rid)
        ids = self._prompt_ids(msg.text, None)
        self._dispatch(Job(identity, msg.rid), [prefill_spec(ids, -1)])

    def _on_abort(self, identity: Any, msg: Abort) -> None:
        found = msg.target_rid in self.jobs
        self.abort_rid(msg.target_rid)
        self._send(identity, Result(msg.rid, {"aborted": found}))

    def _on_flush(self, identity: Any, msg: FlushCache) -> None:
        self._check_new(msg.rid)
        job = FlushJob(identity, msg.rid)
        self._register(job)
        self._put(Flush(job.internal[0]), job)

    def _on_model_info(self, identity: Any, msg: ModelInfo) -> None:
        self._send(identity, Result(msg.rid, self.model_info_data()))

    def _on_stats(self, identity: Any, msg: Stats) -> None:
        self._send(identity, Result(msg.rid, self.stats_data()))

    def _on_health(self, identity: Any, msg: Health) -> None:
        self._send(identity, Result(msg.rid, self.health_data()))

    def _on_status(self, identity: Any, msg: Status) -> None:
        self._send(identity, Result(msg.rid, self.status_data(msg.target_rids)))

    def status_data(self, rids: list[str]) -> dict[str, Any]:
        """Where each request of `rids` stands (a waiting client's liveness signal)."""
        stats, now = self.scheduler_stats, time.monotonic()
        requests: dict[str, Any] = {}
        for rid in rids[:MAX_STATUS_RIDS]:
            job = self.jobs.get(rid)
            if job is None:
                requests[rid] = {"state": "unknown"}
                continue
            requests[rid] = {"state": "in_flight", "seconds": round(now - job.started, 1)}
            if isinstance(job, GenerateJob) and job.msg.stream:  # others report only at the end
                requests[rid]["completion_tokens"] = len(job.output_ids)
        return {
            "requests": requests,
            "running_requests": stats.get("running_requests", 0),
            "waiting_requests": stats.get("waiting_requests", 0),
            "status": "draining" if self.draining else self.status,
        }

    def model_info_data(self) -> dict[str, Any]:
        return {
            **self.model_info,
            "max_new_tokens_limit": self.config.max_new_tokens_limit,
            "max_message_bytes": self.config.max_message_bytes,
            "protocol_version": PROTOCOL_VERSION,
        }

    def stats_data(self) -> dict[str, Any]:
        server = {
            **self.counters,
            "status": self.status,
            "requests_in_flight": len(self.jobs),
            "clients_waiting": len(self.zmq.last_seen),
            "scheduler_restarts": self.restarts,
            "uptime_s": time.monotonic() - self.started,
        }
        return {**self.scheduler_stats, "idle_check": self.idle_check, "server": server}

    def health_data(self) -> dict[str, Any]:
        """`status` is "draining" once a stop was asked for (so routers stop sending)."""
        status = "draining" if self.draining else self.status
        return {
            "ok": status == "ok",
            "status": status,
            "scheduler_pid": self.proc.pid if self.proc is not None else None,
            "scheduler_restarts": self.restarts,
            "last_error": self.last_error,
            "requests_in_flight": len(self.jobs),
        }

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

    # ---- validation -----------------------------------------------------------------------

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
        return self._encode(text)

    def _encode(self, text: str) -> list[int]:
        """Token ids of `text`; text that cannot fit the context is refused untokenized (a
        huge text would stall this loop in the tokenizer)."""
        if len(text) > MAX_CHARS_PER_TOKEN * self.model_info["context_length"]:
            raise RequestError(ERROR_INVALID_REQUEST, f"text of {len(text)} chars is too long")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _prompt_ids(self, text: str | None, input_ids: list[int] | None) -> list[int]:
        if (text is None) == (input_ids is None):
            raise RequestError(ERROR_INVALID_REQUEST, "give exactly one of text and input_ids")
        ids = self._encode(text) if text is not None else input_ids
        self._check_limits(ids, None)
        return ids

    def _sampling(self, params: dict[str, Any]) -> SamplingParams:
        try:
            sampling = SamplingParams.from_dict(params)
        except (ValueError, TypeError) as e:
            raise RequestError(ERROR_INVALID_REQUEST, str(e)) from e
        if sampling.n != 1:
            raise RequestError(ERROR_INVALID_REQUEST, "n must be 1 here; send n requests")
        return sampling

    def _check_limits(self, ids: list[int], sampling: SamplingParams | None) -> None:
        limits = RequestLimits(
            self.model_info["context_length"],
            self.model_info["vocab_size"],
            self.config.max_new_tokens_limit,
        )
        try:
            limits.check(ids, sampling)
        except ValueError as e:
            raise RequestError(ERROR_INVALID_REQUEST, str(e)) from e

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
            self.to_scheduler.put(msg)
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
                self.to_scheduler.put(AbortRequests(live, message))
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


def ready_line(http_url: str, zmq_address: str) -> str:
    """The one stdout line that says the server can serve (parsed by `Runtime`)."""
    return f"radixflow ready on {http_url} (HTTP) and {zmq_address} (ZeroMQ)"


def failed_line(reason: object) -> str:
    """The stdout line of a server that could not start (`Runtime` raises with it)."""
    return f"radixflow failed to start: {reason}"


def serve(config: ServerConfig, log_level: str = "info") -> int:
    """Run a server until SIGINT/SIGTERM; print the ready line on stdout. Returns an exit code."""
    try:
        server = Server(config, log_level)
    except ServerStartError as e:
        log.error("%s", e)
        print(failed_line(e), flush=True)
        return 1
    signal.signal(signal.SIGTERM, server.request_stop)  # while loading; the loop's own after
    signal.signal(signal.SIGINT, server.request_stop)
    try:
        server.start()
        asyncio.run(
            server.run(lambda url, zmq_address: print(ready_line(url, zmq_address), flush=True))
        )
    except (ServerStartError, OSError) as e:  # OSError: the HTTP port is taken
        log.error("%s", e)
        print(failed_line(e), flush=True)
        return 1
    finally:
        server.close()
    return 0
