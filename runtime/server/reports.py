"""What the server reports about itself, the same through either door: model info, stats,
health (with "draining" once a stop was asked for, so routers stop sending) and where given
requests stand (a waiting client's liveness signal). Each reads a Server (server.py)."""

from __future__ import annotations

import time
from typing import Any

from radixflow.runtime.protocol.messages import PROTOCOL_VERSION
from radixflow.runtime.server.jobs import GenerateJob
from radixflow.runtime.server.validation import MAX_JOBS_IN_FLIGHT

MAX_STATUS_RIDS = MAX_JOBS_IN_FLIGHT  # a status query answers for at most this many rids


def status_data(server: Any, rids: list[str]) -> dict[str, Any]:
    """Where each request of `rids` stands (a waiting client's liveness signal)."""
    stats, now = server.scheduler_stats, time.monotonic()
    requests: dict[str, Any] = {}
    for rid in rids[:MAX_STATUS_RIDS]:
        job = server.jobs.get(rid)
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
        "status": "draining" if server.draining else server.status,
    }


def model_info_data(server: Any) -> dict[str, Any]:
    return {
        **server.model_info,
        "max_new_tokens_limit": server.config.max_new_tokens_limit,
        "max_message_bytes": server.config.max_message_bytes,
        "protocol_version": PROTOCOL_VERSION,
    }


def stats_data(server: Any) -> dict[str, Any]:
    own = {
        **server.counters,
        "status": server.status,
        "requests_in_flight": len(server.jobs),
        "clients_waiting": len(server.zmq.last_seen),
        "scheduler_restarts": server.scheduler.restarts,
        "uptime_s": time.monotonic() - server.started,
    }
    return {**server.scheduler_stats, "idle_check": server.idle_check, "server": own}


def health_data(server: Any) -> dict[str, Any]:
    """`status` is "draining" once a stop was asked for (so routers stop sending)."""
    status = "draining" if server.draining else server.status
    return {
        "ok": status == "ok",
        "status": status,
        "scheduler_pid": server.scheduler.pid,
        "scheduler_restarts": server.scheduler.restarts,
        "last_error": server.last_error,
        "requests_in_flight": len(server.jobs),
    }
