"""Requests the scheduler answers with one reply of its own rather than request updates:
flush_cache (FlushDone) and LoRA adapter load/unload (LoraUpdated, SGLang's reply shape).

They travel as FlushJobs: never aborted, forgotten when their client leaves. The server's
record of the loaded adapters (model_info["lora_adapters"], which request validation and the
OpenAI model list read) follows every LoraUpdated, and a restarted scheduler's ready message.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from radixflow.runtime.protocol.messages import (
    ERROR_INVALID_REQUEST,
    FlushDone,
    LoadLoraAdapter,
    LoraUpdated,
    Result,
    UnloadLoraAdapter,
)
from radixflow.runtime.server.jobs import FlushJob
from radixflow.runtime.server.validation import RequestError


def lora_handlers(server: Any) -> dict[type, Callable[[Any, Any], None]]:
    """The server's handlers of the two adapter requests (either door)."""
    forward = functools.partial(forward_lora, server)
    return {LoadLoraAdapter: forward, UnloadLoraAdapter: forward}


def forward_lora(server: Any, identity: Any, msg: LoadLoraAdapter | UnloadLoraAdapter) -> None:
    """Check the request's fields and pass it to the scheduler, which loads or unloads the
    adapter between two steps and answers with LoraUpdated."""
    server._check_new(msg.rid)
    if not msg.lora_name:
        raise RequestError(ERROR_INVALID_REQUEST, "lora_name must be a non-empty string")
    if msg.lora_name == server.model_info.get("model"):  # `model` would be ambiguous
        raise RequestError(ERROR_INVALID_REQUEST, "lora_name must differ from the base model's")
    if isinstance(msg, LoadLoraAdapter) and not msg.lora_path:
        raise RequestError(ERROR_INVALID_REQUEST, "lora_path must be a non-empty string")
    job = FlushJob(identity, msg.rid)  # answered by the scheduler's one reply
    server._register(job)
    server._put(dataclasses.replace(msg, rid=job.internal[0]), job)


def on_reply(server: Any, msg: FlushDone | LoraUpdated) -> None:
    """The scheduler's answer: the one final reply of its job."""
    if isinstance(msg, LoraUpdated):
        server.model_info["lora_adapters"] = dict(msg.adapters)
    job = server.by_internal.pop(msg.rid, None)
    if job is None:
        return
    if isinstance(msg, FlushDone):
        data: dict[str, Any] = {"flushed": msg.flushed}
    else:
        data = {
            "success": not msg.error,
            "error_message": msg.error or None,
            "loaded_adapters": dict(msg.adapters),
        }
    server._end(job, Result(job.rid, data))
