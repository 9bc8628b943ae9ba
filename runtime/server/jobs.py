"""Requests in flight in the server: how a client request's scheduler updates become replies.

A Job belongs to one client request (either door: a ZeroMQ identity or an HTTP sink, see
`runtime/server/server.py`). It knows its scheduler rids; `on_update` turns each ReqUpdate into the
replies it causes (stream chunks, or exactly one final `Result`/`Error`).
"""

from __future__ import annotations

import time
from typing import Any

from radixflow.runtime.protocol.messages import (
    ERROR_FAILED,
    Chunk,
    Error,
    Generate,
    ImageItem,
    ReqSpec,
    ReqUpdate,
    Result,
    Score,
)
from radixflow.runtime.protocol.sampling import SamplingParams
from radixflow.runtime.tokenizer import IncrementalDetokenizer, build_output, trim_at_stop

PREFILL_ONLY = SamplingParams(max_new_tokens=0)


def embed_spec(ids: list[int], pooling: str) -> ReqSpec:
    """A prefill-only request whose final update carries its pooled hidden state."""
    return ReqSpec("", ids, PREFILL_ONLY, pooling=pooling)


def prefill_spec(ids: list[int], logprob_start_len: int) -> ReqSpec:
    """A prefill-only request; input logprobs from `logprob_start_len` (-1: none)."""
    return ReqSpec(
        "",
        ids,
        PREFILL_ONLY,
        return_logprob=logprob_start_len >= 0,
        logprob_start_len=logprob_start_len,
    )


def generate_spec(
    msg: Generate, ids: list[int], sampling: SamplingParams, images: list[ImageItem] = ()
) -> ReqSpec:
    """The scheduler request of a checked generate message (with its images' keys in `ids`)."""
    return ReqSpec(
        "",
        ids,
        sampling,
        stream=msg.stream,
        return_logprob=msg.return_logprob,
        logprob_start_len=msg.logprob_start_len,
        top_logprobs_num=msg.top_logprobs_num,
        priority=msg.priority,
        lora=msg.lora_path or "",
        images=list(images),
    )


class Job:
    """A client request in flight: its scheduler rids and how their updates become replies.

    This base class serves cache_prefix (one prefill-only request; the result is its
    meta_info). `on_update` returns the replies an update causes: chunks, or one final."""

    def __init__(self, identity: Any, rid: str) -> None:
        self.identity = identity
        self.rid = rid
        self.internal: list[str] = []  # scheduler rids, assigned by the server
        self.abort_requested = False
        self.started = time.monotonic()

    def on_update(self, update: ReqUpdate) -> list[Any]:
        if not update.finished:
            return []
        meta = {**(update.meta_info or {}), "id": self.rid}
        return [self.failure(update) or Result(self.rid, {"meta_info": meta})]

    def failure(self, update: ReqUpdate) -> Error | None:
        """The error reply for a request the scheduler failed (or aborted unasked)."""
        kind = (update.finish_reason or {}).get("type")
        if kind == "error" or (kind == "abort" and not self.abort_requested):
            return Error(self.rid, ERROR_FAILED, update.error or f"finished: {kind}")
        return None


class FlushJob(Job):
    """flush_cache: answered by the scheduler's FlushDone, not by request updates."""


class GenerateJob(Job):
    def __init__(
        self,
        identity: Any,
        msg: Generate,
        input_ids: list[int],
        sampling: SamplingParams,
        tokenizer: Any,
        defaults: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(identity, msg.rid)
        self.defaults = defaults or {}  # the model's sampling values it was given
        self.msg, self.input_ids, self.sampling, self.tokenizer = (
            msg,
            input_ids,
            sampling,
            tokenizer,
        )
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[Any] = []
        self.detokenizer = (
            IncrementalDetokenizer(
                tokenizer, input_ids, skip_special_tokens=sampling.skip_special_tokens
            )
            if msg.stream
            else None
        )

    def on_update(self, update: ReqUpdate) -> list[Any]:
        self.output_ids += update.new_ids
        self.logprobs += update.new_logprobs
        self.top_logprobs += update.new_top_logprobs
        if update.finished:
            return [self.failure(update) or Result(self.rid, self.output(update))]
        if self.detokenizer is None:
            return []
        text = visible_text(self.detokenizer.update(self.output_ids), self.sampling.stop)
        meta = {**(update.meta_info or {}), "id": self.rid}
        if self.msg.return_logprob:
            new = zip(update.new_logprobs, update.new_ids)
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in new]
            meta["output_token_logprobs_length"] = len(self.logprobs)
            if self.msg.top_logprobs_num:
                meta["output_top_logprobs"] = update.new_top_logprobs
        return [Chunk(self.rid, text, update.new_ids, meta)]

    def meta_defaults(self) -> dict[str, Any]:
        return {"sampling_defaults": self.defaults} if self.defaults else {}

    def output(self, update: ReqUpdate) -> dict[str, Any]:
        """The final {text, output_ids, meta_info}, as the offline Engine builds it."""
        msg = self.msg
        return build_output(
            self.tokenizer,
            self.output_ids,
            self.input_ids,
            self.sampling,
            update.finish_reason,
            {**(update.meta_info or {}), "id": self.rid, **self.meta_defaults()},
            return_logprob=msg.return_logprob,
            logprob_start_len=msg.logprob_start_len,
            top_logprobs_num=msg.top_logprobs_num,
            output_logprobs=self.logprobs,
            input_logprobs=update.input_logprobs,
            output_top_logprobs=self.top_logprobs,
            input_top_logprobs=update.input_top_logprobs,
        )


class GatherJob(Job):
    """A job of several prefill-only requests answered once, when the last one finishes."""

    def __init__(self, identity: Any, rid: str) -> None:
        super().__init__(identity, rid)
        self.done: dict[str, ReqUpdate] = {}

    def gather(self, update: ReqUpdate) -> tuple[list[ReqUpdate], Any]:
        """(every request's final update, in order, or [] until the last arrives; the first
        failure's error reply, or None)."""
        if not update.finished:
            return [], None
        self.done[update.rid] = update
        if len(self.done) < len(self.internal):
            return [], None
        updates = [self.done[rid] for rid in self.internal]
        failures = [f for f in map(self.failure, updates) if f is not None]
        return updates, failures[0] if failures else None


class ScoreJob(GatherJob):
    """score: one prefill-only request per continuation (then one per unconditional one)."""

    def __init__(self, identity: Any, msg: Score, continuations: list[list[int]]) -> None:
        super().__init__(identity, msg.rid)
        self.msg, self.continuations = msg, continuations

    def on_update(self, update: ReqUpdate) -> list[Any]:
        updates, failed = self.gather(update)
        if failed is not None:
            return [failed]
        if not updates:
            return []
        if any((u.finish_reason or {}).get("type") == "abort" for u in updates):
            return [Result(self.rid, {"choices": [], "aborted": True})]
        num = len(self.continuations)
        choices = []
        for i, ids in enumerate(self.continuations):
            unconditional = _logprobs(updates[num + i], ids) if self.msg.unconditional else None
            choices.append(
                {
                    "text": self.msg.continuations[i],
                    "token_ids": ids,
                    "logprobs": _logprobs(updates[i], ids),
                    "unconditional_logprobs": unconditional,
                }
            )
        return [Result(self.rid, {"choices": choices})]


class EmbedJob(GatherJob):
    """embed: one prefill-only request per input; one result with every vector, in order."""

    def on_update(self, update: ReqUpdate) -> list[Any]:
        updates, failed = self.gather(update)
        if failed is not None:
            return [failed]
        if not updates:
            return []
        if any(u.embedding is None for u in updates):  # aborted by its client
            return [Result(self.rid, {"embeddings": [], "aborted": True})]
        metas = [u.meta_info or {} for u in updates]
        data = {
            "embeddings": [u.embedding for u in updates],
            "prompt_tokens": [meta.get("prompt_tokens", 0) for meta in metas],
            "cached_tokens": [meta.get("cached_tokens", 0) for meta in metas],
        }
        return [Result(self.rid, data)]


def _logprobs(update: ReqUpdate, ids: list[int]) -> list[float]:
    """Input logprobs of the continuation tokens; a token without context counts 0.0."""
    values = [0.0 if lp is None else lp for lp in update.input_logprobs]
    assert len(values) == len(ids), f"{update.rid}: {len(values)=} {len(ids)=}"
    return values


def visible_text(text: str, stops: tuple[str, ...]) -> str:
    """Streamed text: cut at a stop string, and hold back a tail that may begin one."""
    if not stops:
        return text
    text, _ = trim_at_stop(text, stops)
    hold = max(
        (k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0
    )
    return text[: len(text) - hold]
