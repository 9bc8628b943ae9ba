"""The server's scheduler process: one loop that drains messages, steps and sends updates.

    python -m radixflow.runtime scheduler --ipc-dir DIR --parent-pid PID --config-json JSON

The server (runtime/server/server.py) spawns it; the protocol between them is in messages.py. The
scheduler and model are wired exactly as for the offline Engine (`launch.build_scheduler`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import zmq

from radixflow.runtime.config import ServerConfig
from radixflow.runtime.launch import build_scheduler
from radixflow.runtime.protocol.messages import (
    TO_SCHEDULER,
    AbortRequests,
    AddRequests,
    Flush,
    FlushDone,
    LoadLoraAdapter,
    LoraUpdated,
    ReqSpec,
    RequestUpdates,
    ReqUpdate,
    SchedulerFailed,
    SchedulerReady,
    SchedulerStats,
    Shutdown,
    UnloadLoraAdapter,
)
from radixflow.runtime.protocol.transport import IpcAddresses, PullQueue, PushQueue, remove_ipc_dir
from radixflow.runtime.scheduler.request import Req

log = logging.getLogger("radixflow.scheduler")
IDLE_WAIT_MS = 500  # the idle scheduler wakes this often to see whether its server lives
STATS_INTERVAL_S = 0.25  # stats from a busy scheduler at most this often


class SchedulerLoop:
    """The scheduler process's one loop: drain messages (blocking only when idle), step, send
    updates (stream requests every step, others when finished) and stats."""

    def __init__(
        self,
        scheduler: Any,
        inbox: PullQueue[Any],
        outbox: PushQueue[Any],
        parent_pid: int,
        check: Callable[[], None] | None = None,
    ) -> None:
        self.scheduler, self.inbox, self.outbox = scheduler, inbox, outbox
        self.parent_pid = parent_pid
        self.check = check  # tensor parallel: raises once a rank is gone (this process exits)
        self.live: dict[str, Req] = {}
        self.sent: dict[str, int] = {}  # output ids already sent, by rid
        self.touched: list[Req] = []
        self.dirty = True
        self.last_stats = 0.0

    def run(self) -> bool:
        """Until a Shutdown message (returns False), or the server process is gone (True)."""
        while os.getppid() == self.parent_pid:
            if self.check is not None:
                self.check()
            messages = self.inbox.drain(0 if self.scheduler.has_work else IDLE_WAIT_MS)
            if any(isinstance(m, Shutdown) for m in messages):
                return False
            for msg in messages:
                self._handle(msg)
            if self.scheduler.has_work:
                self.touched += self.scheduler.step()
                self.dirty = True
            self._send_updates()
            self._send_stats()
        log.error("the server process is gone; the scheduler exits")
        return True

    def _handle(self, msg: Any) -> None:
        self.dirty = True
        if isinstance(msg, AddRequests):
            for spec in msg.reqs:
                self._add(spec)
        elif isinstance(msg, AbortRequests):
            for rid in msg.rids:
                req = self.scheduler.abort(rid, msg.message)
                if req is not None:
                    self.touched.append(req)
        elif isinstance(msg, Flush):
            self.outbox.put(FlushDone(msg.rid, self.scheduler.tree.flush()))
        elif isinstance(msg, (LoadLoraAdapter, UnloadLoraAdapter)):
            self.outbox.put(self._update_lora(msg))

    def _update_lora(self, msg: LoadLoraAdapter | UnloadLoraAdapter) -> LoraUpdated:
        """Load or unload an adapter between two steps: running requests keep theirs."""
        scheduler, error = self.scheduler, ""
        try:
            if isinstance(msg, LoadLoraAdapter):
                scheduler.loras.load(msg.lora_name, msg.lora_path, scheduler.runner)
                log.info("LoRA adapter %r loaded from %s", msg.lora_name, msg.lora_path)
            else:
                scheduler.loras.unload(msg.lora_name, scheduler.live_requests(), scheduler.runner)
                log.info("LoRA adapter %r unloaded", msg.lora_name)
        except ValueError as e:  # models.lora.LoraError too: the client's to fix
            error = str(e)
        return LoraUpdated(msg.rid, error, dict(scheduler.loras.paths))

    def _add(self, spec: ReqSpec) -> None:
        req = Req(
            rid=spec.rid,
            input_ids=spec.input_ids,
            sampling=spec.sampling,
            return_logprob=spec.return_logprob,
            logprob_start_len=spec.logprob_start_len,
            top_logprobs_num=spec.top_logprobs_num,
            stream=spec.stream,
            priority=spec.priority,
            pooling=spec.pooling,
            lora=self.scheduler.loras.id_of(spec.lora) or 0,
            images=list(spec.images),
        )
        self.live[req.rid] = req
        self.scheduler.add_request(req)
        if self.scheduler.loras.id_of(spec.lora) is None:  # unloaded since the server checked
            self.scheduler.abort(req.rid, f"no LoRA adapter named {spec.lora!r} is loaded")
        if req.finished:  # refused at once (too long for the pool, no grammar backend)
            self.touched.append(req)

    def _send_updates(self) -> None:
        self.touched += [req for req in self.live.values() if req.finished]  # none is missed
        updates: list[ReqUpdate] = []
        for req in self.touched:
            update = self._update(req) if req.rid in self.live else None
            if update is not None:
                updates.append(update)
        self.touched = []
        if any(update.finished for update in updates):
            # Stats first: a client that reads them after its final reply sees its request.
            self.outbox.put(SchedulerStats(self.scheduler.stats(), None))
            self.last_stats = time.monotonic()
        if updates:
            self.outbox.put(RequestUpdates(updates))

    def _update(self, req: Req) -> ReqUpdate | None:
        sent = self.sent.get(req.rid, 0)
        ready = len(req.output_ids) if req.finished else req.num_ready_outputs
        if not req.finished and (not req.stream or ready == sent):
            return None
        new = {
            "new_ids": req.output_ids[sent:ready],
            "new_logprobs": req.output_logprobs[sent:ready],
            "new_top_logprobs": req.output_top_logprobs[sent:ready],
        }
        if not req.finished:
            self.sent[req.rid] = ready
            return ReqUpdate(req.rid, **new, meta_info=_progress_meta(req))
        del self.live[req.rid]
        self.sent.pop(req.rid, None)
        return ReqUpdate(
            req.rid,
            **new,
            meta_info=req.meta_info(),
            finished=True,
            finish_reason=req.finish_reason,
            error=req.error,
            input_logprobs=req.input_logprobs,
            input_top_logprobs=req.input_top_logprobs,
            embedding=req.embedding,
        )

    def _send_stats(self) -> None:
        now = time.monotonic()
        if not self.scheduler.has_work:
            if self.dirty:
                self.outbox.put(SchedulerStats(self.scheduler.stats(), self._idle_check()))
                self.dirty, self.last_stats = False, now
        elif now - self.last_stats >= STATS_INTERVAL_S:
            self.outbox.put(SchedulerStats(self.scheduler.stats(), None))
            self.last_stats = now

    def _idle_check(self) -> str:
        """The leak check at idle: every slot is free or in the tree, no lock is held."""
        try:
            self.scheduler.check_invariants()
        except AssertionError as e:
            log.error("idle check failed: %s", e)
            return f"failed: {e}"
        return "ok"


def _progress_meta(req: Req) -> dict[str, Any]:
    """The counts of a running request (cheap, unlike the final `meta_info()`)."""
    return {
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": max(req.cached_tokens, 0),
        "finish_reason": None,
    }


def run_scheduler(config: ServerConfig, addresses: IpcAddresses, parent_pid: int) -> None:
    """The scheduler process: load the model, say ready, loop until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; the server decides
    _die_with_parent(parent_pid, signal.SIGKILL)  # while loading: the loop only watches later
    ctx = zmq.Context()
    inbox: PullQueue[Any] = PullQueue(ctx, addresses.to_scheduler, False, TO_SCHEDULER)
    outbox: PushQueue[Any] = PushQueue(ctx, addresses.from_scheduler, False)
    try:
        bundle = build_scheduler(config)
    except ValueError as e:  # the model or its pool cannot start: the user's to fix, no trace
        log.error("%s", e)
        outbox.put(SchedulerFailed(str(e)))
        outbox.close()  # the socket's linger delivers the message before ctx.term returns
        inbox.close()
        ctx.term()
        sys.exit(2)
    tp = bundle.loaded.tp
    outbox.put(SchedulerReady(bundle.model_info, os.getpid(), bundle.load_seconds))
    stopped = False  # told to stop, or orphaned: the other ranks stop too
    _die_with_parent(parent_pid, 0)  # from here an orphan cleans up (the loop's watch)
    try:
        loop = SchedulerLoop(
            bundle.scheduler, inbox, outbox, parent_pid, tp.check if tp is not None else None
        )
        if loop.run():
            remove_ipc_dir(addresses)  # nobody else will
        stopped = True
    finally:
        if bundle.scheduler.kv.tiers is not None:  # pending disk writes land before exit
            bundle.scheduler.kv.tiers.close()
        if bundle.scheduler.grammars is not None:
            bundle.scheduler.grammars.shutdown()
        if tp is not None:
            tp.close(stop=stopped)
        inbox.close()
        outbox.close()
        ctx.term()


def _die_with_parent(parent_pid: int, sig: int) -> None:
    """Linux: `sig` this process when the server dies, even by SIGKILL (0: no longer), so a
    scheduler still loading its model does not outlive it."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    if sig and os.getppid() != parent_pid:  # the server died before the call above
        os._exit(1)
