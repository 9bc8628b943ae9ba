"""Engine: the scheduler, model and tokenizer in one process, no sockets.

    with Engine(model="smollm2") as engine:
        out = engine.generate("Hello", {"max_new_tokens": 16, "temperature": 0})

`build_scheduler` is shared with the server's scheduler process (runtime/scheduler/loop.py),
so both run the same code.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import functools
import itertools
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from radixflow.runtime import models
from radixflow.runtime.cache.kv_pool import KVPool
from radixflow.runtime.config import ServerConfig, config_from_kwargs, fixed_threads
from radixflow.runtime.constrained.grammar import GrammarBackend
from radixflow.runtime.constrained.llg_backend import LlgBackend
from radixflow.runtime.constrained.triggered import TriggeredBackend
from radixflow.runtime.distributed.tensor_parallel import start_rank0
from radixflow.runtime.engine_request import EngineRequest, finished_output
from radixflow.runtime.model_executor.cuda_graph import graph_max_bs
from radixflow.runtime.model_executor.kv_sizing import (
    GIB,
    MemoryPlan,
    kv_pool_dtype,
    plan_memory,
    size_kv_pool,
)
from radixflow.runtime.model_executor.model_runner import (
    ModelRunner,
    load_model,
    pick_device,
    pick_dtype,
)
from radixflow.runtime.model_executor.threads import ThreadGovernor
from radixflow.runtime.models.layers import CausalLM
from radixflow.runtime.models.loader import (
    load_hf_config,
    model_sampling_defaults,
    resolve_model_dir,
)
from radixflow.runtime.protocol.limits import RequestLimits
from radixflow.runtime.protocol.sampling import SamplingParams, with_defaults
from radixflow.runtime.scheduler.request import Req
from radixflow.runtime.scheduler.scheduler import Scheduler
from radixflow.runtime.tokenizer import eos_token_ids, load_tokenizer

log = logging.getLogger("radixflow.engine")


@dataclass
class ModelBundle:
    scheduler: Scheduler
    tokenizer: PreTrainedTokenizerBase
    model_info: dict[str, Any]
    loaded: LoadedModel
    load_seconds: float


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: PreTrainedTokenizerBase
    model_dir: Path
    hf_config: dict[str, Any]
    tp: Any = None  # tensor_parallel.TensorParallel of rank 0 with --tp-size > 1
    memory: MemoryPlan | None = None  # planned before the weights were read


def load(config: ServerConfig) -> LoadedModel:
    """Resolve (converting once), plan the memory (raising MemoryBudgetError before any
    weight is read when the model and its pool cannot fit) and load the model and tokenizer."""
    if fixed_threads(config):
        torch.set_num_threads(fixed_threads(config))
    model_dir = resolve_model_dir(config.model_path, config.revision)
    tokenizer = load_tokenizer(model_dir, config.chat_template)
    hf_config = json.loads((model_dir / "config.json").read_text())
    device = pick_device(config.device)
    dtype = pick_dtype(config.dtype, device)
    model_config = models.model_config(load_hf_config(model_dir))
    memory, planned = plan_memory(config, model_dir, model_config, device, dtype)
    log.info(
        "memory: %.2f GiB %s at start, weights about %.2f GiB, reserve %.2f GiB: planning a "
        "KV pool of %s tokens; loading the weights",
        memory.available / GIB, memory.where, memory.weights / GIB, memory.reserve / GIB,
        f"{planned.num_tokens:,}",
    )  # fmt: skip
    if config.tp_size > 1:  # torch.distributed only on this path
        model, tp = start_rank0(config, model_dir)
        return LoadedModel(model, tokenizer, model_dir, hf_config, tp, memory)
    model = load_model(model_dir, config, device, dtype)
    release_free_heap()
    return LoadedModel(model, tokenizer, model_dir, hf_config, None, memory)


def release_free_heap() -> None:
    """Hand the heap memory the load freed back to the OS (glibc keeps freed blocks under
    its mmap threshold mapped: 0.5 GiB of a 7B load's transient copies stayed resident)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def governor(config: ServerConfig, device: Any, tensor_parallel: bool) -> ThreadGovernor | None:
    """`--num-threads auto` on a CPU without tensor parallelism: the thread count follows
    the cores other processes leave free, up to the count at start."""
    if config.num_threads != "auto" or getattr(device, "type", "") != "cpu" or tensor_parallel:
        return None
    return ThreadGovernor(torch.get_num_threads())


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
    if config.context_length > model.config.max_position:
        raise ValueError(
            f"context_length {config.context_length} exceeds the model's "
            f"{model.config.max_position} (max_position_embeddings); it can only cap it"
        )
    context_len = config.context_length or model.config.max_position
    sizing = size_kv_pool(config, model, device, loaded.memory)
    num_tokens = sizing.num_tokens
    if loaded.tp is not None:  # every rank's pool has the same slots
        num_tokens = loaded.tp.agree_min(num_tokens)
    pool = KVPool(num_tokens, config.page_size)
    runner = ModelRunner(
        model,
        pool.num_slots,
        seed=config.seed,
        shared_prefix=not config.disable_shared_prefix_attention,
        cuda_graph_max_bs=graph_max_bs(config, model),
        max_kv_len=context_len,
        prefault=not config.disable_kv_prefault,
        governor=governor(config, device, loaded.tp is not None),
        kv_dtype=kv_pool_dtype(sizing),
    )
    if loaded.tp is not None:  # each step goes to ranks 1..N-1 first (tensor_parallel.py)
        runner.forward = functools.partial(loaded.tp.run_step, runner.forward)
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
        encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
    )
    info = {
        "model": config.served_model_name or config.model_path,
        "model_path": str(model_dir),
        "context_length": context_len,
        "vocab_size": model.config.vocab_size,
        "eos_token_ids": list(eos),
        "chat_template": tokenizer.chat_template,
        "special_tokens": list(tokenizer.all_special_tokens),
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "device": str(device),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "attention_backend": model.ops.name,
        "cuda_graph_batch_sizes": runner.graphs.sizes if runner.graphs is not None else [],
        # what a request leaves unset samples with (--sampling-defaults)
        "sampling_defaults": (
            model_sampling_defaults(model_dir) if config.sampling_defaults == "model" else {}
        ),
    }
    return ModelBundle(scheduler, tokenizer, info, loaded, time.perf_counter() - start)


def _grammar_backend(
    config: ServerConfig, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos: tuple[int, ...]
) -> Any:
    """The configured backend, taking structural tags (triggered constraints) too."""
    whitespace = config.grammar_whitespace or None
    if config.grammar_backend == "llguidance":
        backend: Any = LlgBackend(tokenizer, vocab_size, eos, whitespace)
        backend.prepare()  # the vocabulary view, while the model warms up
    else:
        backend = GrammarBackend(
            tokenizer,
            vocab_size,
            eos,
            whitespace,
            max_workers=config.grammar_workers,
            timeout_s=config.grammar_timeout_s,
        )
    return TriggeredBackend(backend, tokenizer, vocab_size, eos, whitespace)


def _is_id_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], int)


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
    inside); `submit` + `step` let a caller add requests while others decode. Not
    thread-safe: use one Engine per thread (or one event loop), or the server."""

    def __init__(self, model: str | None = None, **config: Any) -> None:
        """`model` is `model_path` (either name; default smollm2)."""
        named = {"model": model} if model is not None else {}
        self._setup(config_from_kwargs(**named, **config), None)

    def _setup(self, config: ServerConfig, loaded: LoadedModel | None) -> None:
        self.config = config
        bundle = build_scheduler(config, loaded)
        self.scheduler, self.tokenizer = bundle.scheduler, bundle.tokenizer
        self.model_info, self.load_seconds = bundle.model_info, bundle.load_seconds
        self.limits = RequestLimits(
            self.scheduler.context_len, self.scheduler.vocab_size, config.max_new_tokens_limit
        )
        self._loaded = bundle.loaded
        self._ids = itertools.count()

    def with_config(self, **changes: Any) -> Engine:
        """A new engine (own KV pool and scheduler) sharing this one's loaded weights.
        Changes to model, device, dtype, attention_backend or quantized_activations (set on
        the shared weights' layers) need a new Engine."""
        fixed = {"model", "model_path", "revision", "chat_template", "device", "dtype"}
        fixed = (fixed | {"attention_backend", "quantized_activations"}) & set(changes)
        if fixed:
            raise ValueError(f"with_config cannot change {sorted(fixed)}")
        if self._loaded.tp is not None:
            raise ValueError(
                "with_config cannot share a tensor-parallel model (its ranks hold one KV pool)"
            )
        engine = Engine.__new__(Engine)
        # planned anew from the memory available now: this engine's pool is already in it
        loaded = dataclasses.replace(self._loaded, memory=None)
        engine._setup(self.config.replace(**changes), loaded)
        return engine

    def submit(
        self,
        prompt: str | list[str] | list[int] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        stream: bool = False,
    ) -> list[EngineRequest]:
        """Validate and queue requests (n per prompt, prompt-major); they run on `step()`.
        Raises ValueError on bad input, before anything is queued."""
        id_lists, _, _ = normalize_prompts(prompt, input_ids, self.tokenizer)
        reqs = self._build(
            id_lists, sampling_params, return_logprob, logprob_start_len, top_logprobs_num, stream
        )
        for req in reqs:
            self.scheduler.add_request(req)
        return [EngineRequest(req, self.tokenizer) for req in reqs]

    def step(self) -> bool:
        """Run one scheduler step (admit, forward, sample) if there is work; returns whether
        work remains."""
        if self.scheduler.has_work:
            self.scheduler.step()
        return self.scheduler.has_work

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
        an iterator of chunks (`EngineRequest.next_chunk`: cumulative text, the new tokens'
        logprobs). Raises ValueError on bad parameters."""
        id_lists, _, single = normalize_prompts(prompt, input_ids, self.tokenizer)
        reqs = self._build(
            id_lists, sampling_params, return_logprob, logprob_start_len, top_logprobs_num, stream
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

    async def async_generate(
        self,
        prompt: str | list[str] | list[int] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        *,
        stream: bool = False,
        **options: Any,
    ) -> Any:
        """`generate` for asyncio: requests from many coroutines of one event loop batch
        together (each waiting coroutine steps the shared scheduler, then yields). With
        stream=True (one prompt, n == 1) the awaited value is an async iterator of chunks, as
        SGLang's: `async for chunk in await engine.async_generate(..., stream=True)`."""
        handles = self.submit(prompt, sampling_params, stream=stream, **options)
        if stream:
            if len(handles) != 1:
                raise ValueError("stream=True takes one prompt with n == 1")
            return self._async_stream(handles[0])
        while not all(h.finished for h in handles):
            self.step()
            await asyncio.sleep(0)
        results = [h.result() for h in handles]
        ids = options.get("input_ids")
        single = isinstance(prompt, str) or _is_id_list(prompt) or _is_id_list(ids)
        return results[0] if single and len(results) == 1 else results

    async def _async_stream(self, handle: EngineRequest) -> AsyncIterator[dict[str, Any]]:
        while True:
            chunk = handle.next_chunk()
            if chunk is not None:
                yield chunk
                if chunk["finished"]:
                    return
            self.step()
            await asyncio.sleep(0)

    def _build(
        self,
        id_lists: list[list[int]],
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None,
        return_logprob: bool,
        logprob_start_len: int,
        top_logprobs_num: int,
        stream: bool,
    ) -> list[Req]:
        """One typed Req per prompt and sample; every check runs before any is queued."""
        params = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params] * len(id_lists)
        )
        if len(params) != len(id_lists):
            raise ValueError("sampling_params list must match the number of prompts")
        reqs = []
        for ids, p in zip(id_lists, params):
            sampling = SamplingParams.from_dict(with_defaults(p, self.model_info)[0])
            self.limits.check(ids, sampling)
            if not -1 <= logprob_start_len < len(ids):
                raise ValueError(f"logprob_start_len must be in [-1, {len(ids)})")
            for i in range(sampling.n):
                seed = None if sampling.seed is None else sampling.seed + i
                reqs.append(
                    Req(
                        rid=f"engine-{next(self._ids)}",
                        input_ids=list(ids),
                        sampling=dataclasses.replace(sampling, n=1, seed=seed),
                        return_logprob=return_logprob,
                        logprob_start_len=logprob_start_len,
                        top_logprobs_num=top_logprobs_num,
                        stream=stream,
                    )
                )
        return reqs

    def _stream(self, req: Req) -> Iterator[dict[str, Any]]:
        self.scheduler.add_request(req)
        handle = EngineRequest(req, self.tokenizer)
        while True:
            self.scheduler.step()
            chunk = handle.next_chunk()
            if chunk is not None:
                yield chunk
                if chunk["finished"]:
                    return

    def result(self, req: Req) -> dict[str, Any]:
        """Final text and meta data of a finished request."""
        return finished_output(req, self.tokenizer)

    def stats(self) -> dict[str, Any]:
        return self.scheduler.stats()

    def get_model_info(self) -> dict[str, Any]:
        """The served model (SGLang's Engine method): path, context length, chat template..."""
        return dict(self.model_info)

    def get_server_info(self) -> dict[str, Any]:
        """SGLang's shape: the configuration, then `internal_states` (the scheduler's stats:
        cached and computed prefill tokens, slots, requests)."""
        config = dataclasses.asdict(self.config)
        config.pop("api_key")
        return {**config, **self.model_info, "internal_states": [self.stats()]}

    def flush_cache(self) -> bool:
        return self.scheduler.tree.flush()

    def check_idle(self) -> None:
        """Raise AssertionError unless nothing runs and every slot is free or in the tree."""
        assert not self.scheduler.has_work, "engine is not idle"
        self.scheduler.check_invariants()

    def shutdown(self) -> None:
        if self.scheduler.grammars is not None:
            self.scheduler.grammars.shutdown()
        if self._loaded.tp is not None:  # stops ranks 1..N-1
            self._loaded.tp.close()
            self._loaded.tp = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
