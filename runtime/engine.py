"""Engine: the scheduler, model and tokenizer in one process, no sockets.

    with Engine(model="smollm2") as engine:
        out = engine.generate("Hello", {"max_new_tokens": 16, "temperature": 0})

`build_scheduler` is shared with the server's scheduler process, so both run the same code.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import zmq
from transformers import PreTrainedTokenizerBase

from radixflow.runtime.config import ServerConfig, config_from_kwargs
from radixflow.runtime.kv_pool import KVPool
from radixflow.runtime.loader import resolve_model_dir
from radixflow.runtime.messages import (
    TO_SCHEDULER,
    AbortRequests,
    AddRequests,
    Flush,
    FlushDone,
    ReqSpec,
    RequestUpdates,
    ReqUpdate,
    SchedulerReady,
    SchedulerStats,
    Shutdown,
)
from radixflow.runtime.model_runner import ModelRunner, load_model, pick_device, pick_dtype
from radixflow.runtime.models.llama import LlamaModel
from radixflow.runtime.request import Req
from radixflow.runtime.sampling import SamplingParams
from radixflow.runtime.scheduler import Scheduler
from radixflow.runtime.tokenizer import (
    IncrementalDetokenizer,
    build_output,
    eos_token_ids,
    load_tokenizer,
)
from radixflow.runtime.transport import IpcAddresses, PullQueue, PushQueue, remove_ipc_dir


@dataclass
class ModelBundle:
    scheduler: Scheduler
    tokenizer: PreTrainedTokenizerBase
    model_info: dict[str, Any]
    loaded: LoadedModel
    load_seconds: float


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: PreTrainedTokenizerBase
    model_dir: Path
    hf_config: dict[str, Any]


def load(config: ServerConfig) -> LoadedModel:
    """Resolve (converting once) and load the model and tokenizer."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    model_dir = resolve_model_dir(config.model)
    tokenizer = load_tokenizer(model_dir)
    hf_config = json.loads((model_dir / "config.json").read_text())
    device = pick_device(config.device)
    model = load_model(model_dir, config, device, pick_dtype(config.dtype, device))
    return LoadedModel(model, tokenizer, model_dir, hf_config)


def build_scheduler(config: ServerConfig, loaded: LoadedModel | None = None) -> ModelBundle:
    """Load tokenizer and model (unless given), size the KV pool, wire the scheduler."""
    start = time.perf_counter()
    loaded = loaded or load(config)
    model, tokenizer, model_dir, hf_config = (
        loaded.model,
        loaded.tokenizer,
        loaded.model_dir,
        loaded.hf_config,
    )
    device = next(model.parameters()).device
    pool = KVPool(config.max_total_tokens, config.page_size)
    runner = ModelRunner(model, pool.num_slots, config.page_size, seed=config.seed)
    context_len = config.context_length or model.config.max_position
    eos = eos_token_ids(tokenizer, hf_config)
    scheduler = Scheduler(
        config,
        runner,
        pool,
        eos_token_ids=eos,
        context_len=context_len,
        vocab_size=model.config.vocab_size,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        grammars=_grammar_backend(config, tokenizer, model.config.vocab_size, eos),
    )
    info = {
        "model": config.model,
        "model_path": str(model_dir),
        "context_length": context_len,
        "vocab_size": model.config.vocab_size,
        "eos_token_ids": list(eos),
        "chat_template": tokenizer.chat_template,
        "special_tokens": list(tokenizer.all_special_tokens),
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "device": str(device),
        "dtype": str(model.embed_tokens.weight.dtype).removeprefix("torch."),
        "attention_backend": model.ops.name,
    }
    return ModelBundle(scheduler, tokenizer, info, loaded, time.perf_counter() - start)


def _grammar_backend(
    config: ServerConfig, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos: tuple[int, ...]
) -> Any:
    from radixflow.runtime.constraints import GrammarBackend  # noqa: PLC0415 (heavy)

    return GrammarBackend(
        tokenizer,
        vocab_size,
        eos,
        config.grammar_whitespace or None,
        max_workers=config.grammar_workers,
        timeout_s=config.grammar_timeout_s,
    )


def normalize_prompts(
    prompt: Any, input_ids: Any, tokenizer: PreTrainedTokenizerBase
) -> tuple[list[list[int]], list[str | None], bool]:
    """-> (token id lists, texts, was a single prompt). Raises ValueError on bad input."""
    if (prompt is None) == (input_ids is None):
        raise ValueError("give exactly one of prompt (text) and input_ids")
    if input_ids is None and isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        prompt, input_ids = None, prompt
    if input_ids is not None:
        single = bool(input_ids) and isinstance(input_ids[0], int)
        batch = [input_ids] if single else input_ids
        if not isinstance(batch, list) or not all(
            isinstance(ids, list) and all(isinstance(t, int) and t >= 0 for t in ids)
            for ids in batch
        ):
            raise ValueError("input_ids must be a list of non-negative ints or a list of those")
        return [list(ids) for ids in batch], [None] * len(batch), single
    single = isinstance(prompt, str)
    texts = [prompt] if single else prompt
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise ValueError("prompt must be a string or a list of strings")
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts], list(texts), single


class Engine:
    """Offline engine: `generate` blocks until its requests finish (continuous batching
    inside). Not thread-safe: use one Engine per thread, or the server for concurrency."""

    def __init__(self, model: str = "smollm2", **config: Any) -> None:
        self._setup(config_from_kwargs(model=model, **config), None)

    def _setup(self, config: ServerConfig, loaded: LoadedModel | None) -> None:
        self.config = config
        bundle = build_scheduler(config, loaded)
        self.scheduler, self.tokenizer = bundle.scheduler, bundle.tokenizer
        self.model_info, self.load_seconds = bundle.model_info, bundle.load_seconds
        self._loaded = bundle.loaded
        self._ids = itertools.count()

    def with_config(self, **changes: Any) -> Engine:
        """A new engine (own KV pool and scheduler) sharing this one's loaded weights.
        Changes to model, device, dtype or attention_backend need a new Engine."""
        fixed = {"model", "device", "dtype", "attention_backend"} & set(changes)
        if fixed:
            raise ValueError(f"with_config cannot change {sorted(fixed)}")
        engine = Engine.__new__(Engine)
        engine._setup(self.config.replace(**changes), self._loaded)
        return engine

    def generate(
        self,
        prompt: str | list[str] | list[int] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        stream: bool = False,
    ) -> Any:
        """Generate for one prompt (a dict, or a list of n dicts when n > 1) or a list of
        prompts (a list of dicts, n per prompt). `stream=True` (one prompt, n == 1) returns
        an iterator of cumulative chunks. Raises ValueError on bad parameters."""
        id_lists, texts, single = normalize_prompts(prompt, input_ids, self.tokenizer)
        params = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params] * len(id_lists)
        )
        if len(params) != len(id_lists):
            raise ValueError("sampling_params list must match the number of prompts")
        sampling = [SamplingParams.from_dict(p) for p in params]
        reqs = []
        for ids, sp in zip(id_lists, sampling):
            self._check_length(ids, sp)
            for i in range(sp.n):
                seed = None if sp.seed is None else sp.seed + i
                child = SamplingParams.from_dict({**sp.to_dict(), "n": 1, "seed": seed})
                reqs.append(
                    Req(
                        rid=f"engine-{next(self._ids)}",
                        input_ids=list(ids),
                        sampling=child,
                        return_logprob=return_logprob,
                        logprob_start_len=logprob_start_len,
                        top_logprobs_num=top_logprobs_num,
                        stream=stream,
                    )
                )
        if stream:
            if len(reqs) != 1:
                raise ValueError("stream=True takes one prompt with n == 1")
            return self._stream(reqs[0])
        for req in reqs:
            self.scheduler.add_request(req)
        while any(not r.finished for r in reqs):
            self.scheduler.step()
        results = [self.result(r) for r in reqs]
        return results[0] if single and len(results) == 1 else results

    def _stream(self, req: Req) -> Iterator[dict[str, Any]]:
        self.scheduler.add_request(req)
        detok = IncrementalDetokenizer(self.tokenizer, req.input_ids[-8:])
        sent = 0
        while not req.finished:
            self.scheduler.step()
            if len(req.output_ids) > sent and not req.finished:
                text = detok.update(req.output_ids)
                sent = len(req.output_ids)
                yield {
                    "text": text,
                    "output_ids": list(req.output_ids),
                    "finished": False,
                    "meta_info": req.meta_info(),
                }
        yield {**self.result(req), "finished": True}

    def _check_length(self, ids: list[int], sampling: SamplingParams) -> None:
        context = self.scheduler.context_len
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= context:
            raise ValueError(f"prompt has {len(ids)} tokens; the context length is {context}")
        if sampling.max_new_tokens > self.config.max_new_tokens_limit:
            raise ValueError(
                f"max_new_tokens={sampling.max_new_tokens} exceeds the limit "
                f"{self.config.max_new_tokens_limit}"
            )

    def result(self, req: Req) -> dict[str, Any]:
        """Final text and meta data of a finished request."""
        return finished_output(req, self.tokenizer)

    def stats(self) -> dict[str, Any]:
        return self.scheduler.stats()

    def flush_cache(self) -> bool:
        return self.scheduler.tree.flush()

    def check_idle(self) -> None:
        """Raise AssertionError unless nothing runs and every slot is free or in the tree."""
        assert not self.scheduler.has_work, "engine is not idle"
        self.scheduler.check_invariants()

    def shutdown(self) -> None:
        if self.scheduler.grammars is not None:
            self.scheduler.grammars.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def finished_output(req: Req, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """The result dict of a finished request: text trimmed at its stop, ids, meta data."""
    out = build_output(
        tokenizer,
        req.output_ids,
        req.input_ids,
        req.sampling,
        req.finish_reason,
        req.meta_info(),
        return_logprob=req.return_logprob,
        logprob_start_len=req.logprob_start_len,
        top_logprobs_num=req.top_logprobs_num,
        output_logprobs=req.output_logprobs,
        input_logprobs=req.input_logprobs,
        output_top_logprobs=req.output_top_logprobs,
        input_top_logprobs=req.input_top_logprobs,
    )
    if req.error:
        out["error"] = req.error
    return out


# ---- the server's scheduler process ----------------------------------------------------

log = logging.getLogger("radixflow.scheduler")
IDLE_WAIT_MS = 500  # the idle scheduler wakes this often to see whether its server lives
STATS_INTERVAL_S = 0.25  # stats from a busy scheduler at most this often


class SchedulerLoop:
    """The scheduler process's one loop: drain messages (blocking only when idle), step, send
    updates (stream requests every step, others when finished) and stats."""

    def __init__(
        self, scheduler: Any, inbox: PullQueue[Any], outbox: PushQueue[Any], parent_pid: int
    ) -> None:
        self.scheduler, self.inbox, self.outbox = scheduler, inbox, outbox
        self.parent_pid = parent_pid
        self.live: dict[str, Req] = {}
        self.sent: dict[str, int] = {}  # output ids already sent, by rid
        self.touched: list[Req] = []
        self.failed: list[ReqUpdate] = []
        self.dirty = True
        self.last_stats = 0.0

    def run(self) -> bool:
        """Until a Shutdown message (returns False), or the server process is gone (True)."""
        while os.getppid() == self.parent_pid:
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

    def _add(self, spec: ReqSpec) -> None:
        try:
            sampling = SamplingParams.from_dict(spec.sampling_params)
        except ValueError as e:
            reason = {"type": "error", "message": str(e)}
            self.failed.append(ReqUpdate(spec.rid, [], finished=True, finish_reason=reason))
            return
        req = Req(
            rid=spec.rid,
            input_ids=spec.input_ids,
            sampling=sampling,
            return_logprob=spec.return_logprob,
            logprob_start_len=spec.logprob_start_len,
            top_logprobs_num=spec.top_logprobs_num,
            stream=spec.stream,
        )
        self.live[req.rid] = req
        self.scheduler.add_request(req)
        if req.finished:  # refused at once (too long for the pool, no grammar backend)
            self.touched.append(req)

    def _send_updates(self) -> None:
        self.touched += [req for req in self.live.values() if req.finished]  # none is missed
        updates, self.failed = self.failed, []
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
        if not req.finished and (not req.stream or len(req.output_ids) == sent):
            return None
        new = {
            "new_ids": req.output_ids[sent:],
            "new_logprobs": req.output_logprobs[sent:],
            "new_top_logprobs": req.output_top_logprobs[sent:],
        }
        if not req.finished:
            self.sent[req.rid] = len(req.output_ids)
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
    ctx = zmq.Context()
    inbox: PullQueue[Any] = PullQueue(ctx, addresses.to_scheduler, False, TO_SCHEDULER)
    outbox: PushQueue[Any] = PushQueue(ctx, addresses.from_scheduler, False)
    bundle = build_scheduler(config)
    outbox.put(SchedulerReady(bundle.model_info, os.getpid(), bundle.load_seconds))
    try:
        if SchedulerLoop(bundle.scheduler, inbox, outbox, parent_pid).run():
            remove_ipc_dir(addresses)  # nobody else will
    finally:
        if bundle.scheduler.grammars is not None:
            bundle.scheduler.grammars.shutdown()
        inbox.close()
        outbox.close()
        ctx.term()
