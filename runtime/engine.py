"""Engine: the scheduler, model and tokenizer in one process, no sockets.

    with Engine(model="smollm2") as engine:
        out = engine.generate("Hello", {"max_new_tokens": 16, "temperature": 0})

The model and its scheduler come from runtime/launch.py, which the server's scheduler process
uses too, so both run the same code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

from transformers import PreTrainedTokenizerBase

from radixflow.runtime.config import ServerConfig, config_from_kwargs
from radixflow.runtime.engine_request import EngineRequest, finished_output
from radixflow.runtime.launch import LoadedModel, build_scheduler
from radixflow.runtime.protocol.limits import RequestLimits
from radixflow.runtime.protocol.messages import EMBEDDING_ONLY, POOLINGS
from radixflow.runtime.protocol.sampling import SamplingParams, with_defaults
from radixflow.runtime.scheduler.request import Req
from radixflow.runtime.server.images import ImageRules

log = logging.getLogger("radixflow.engine")
PREFILL_ONLY = SamplingParams(max_new_tokens=0)


def _is_id_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], int)


def normalize_prompts(
    prompt: Any, input_ids: Any, tokenizer: PreTrainedTokenizerBase, special: bool = False
) -> tuple[list[list[int]], list[str | None], bool]:
    """-> (token id lists, texts, was a single prompt); text tokenized with the special
    tokens when `special` (an encoder's). Raises ValueError on bad input."""
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
    return [tokenizer.encode(t, add_special_tokens=special) for t in texts], list(texts), single


def _per_prompt(image_data: list[Any] | None, single: bool, num_prompts: int) -> list[list[Any]]:
    """`image_data` as one list of images per prompt (a single prompt's list is wrapped)."""
    if not image_data:
        return []
    lists = [image_data] if single else image_data
    if len(lists) != num_prompts or not all(isinstance(x, list) for x in lists):
        raise ValueError("image_data: one list of images per prompt")
    return lists


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
        image_data: list[Any] | None = None,
    ) -> list[EngineRequest]:
        """Validate and queue requests (n per prompt, prompt-major); they run on `step()`.
        Raises ValueError on bad input, before anything is queued."""
        id_lists, _, single = normalize_prompts(prompt, input_ids, self.tokenizer)
        reqs = self._build(
            id_lists, sampling_params, return_logprob, logprob_start_len, top_logprobs_num, stream,
            _per_prompt(image_data, single, len(id_lists)),
        )  # fmt: skip
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
        image_data: list[Any] | None = None,
    ) -> Any:
        """Generate for one prompt (a dict, or a list of n dicts when n > 1) or a list of
        prompts (a list of dicts, n per prompt). `stream=True` (one prompt, n == 1) returns
        an iterator of chunks (`EngineRequest.next_chunk`: cumulative text, the new tokens'
        logprobs). `image_data` (a vision model): the images of one prompt, in the order of
        its image placeholders (bytes, data: URL, base64, a path), or a list of such lists
        for a list of prompts. Raises ValueError on bad parameters or images."""
        id_lists, _, single = normalize_prompts(prompt, input_ids, self.tokenizer)
        reqs = self._build(
            id_lists, sampling_params, return_logprob, logprob_start_len, top_logprobs_num, stream,
            _per_prompt(image_data, single, len(id_lists)),
        )  # fmt: skip
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

    def encode(
        self,
        prompt: str | list[str] | list[int] | None = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        pooling: str = "",
    ) -> Any:
        """Embeddings (SGLang's `Engine.encode`): per prompt {"embedding": the final hidden
        state (after a decoder's final norm), pooled ("last" token, "mean" or "cls", the first;
        "": the model's default), L2-normalized, as floats; "meta_info"}; one dict for one
        prompt, else a list. Each prompt is a prefill-only request, batched like any prefill;
        an encoder's text gets its special tokens. Raises ValueError on bad input,
        RuntimeError if the scheduler failed a request."""
        pooling = pooling or self.model_info["pooling"]
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        special = bool(self.model_info["is_encoder"])
        id_lists, _, single = normalize_prompts(prompt, input_ids, self.tokenizer, special)
        for ids in id_lists:
            self.limits.check(ids, None)
        reqs = [
            Req(f"engine-{next(self._ids)}", list(ids), PREFILL_ONLY, pooling=pooling)
            for ids in id_lists
        ]
        for req in reqs:
            self.scheduler.add_request(req)
        while any(not r.finished for r in reqs):
            self.scheduler.step()
        failed = next((r.error or "no vector" for r in reqs if r.embedding is None), None)
        if failed is not None:
            raise RuntimeError(f"an embedding request failed: {failed}")
        results = [{"embedding": r.embedding, "meta_info": r.meta_info()} for r in reqs]
        return results[0] if single else results

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
        images: list[list[Any]] | None = None,
    ) -> list[Req]:
        """One typed Req per prompt and sample; every check runs before any is queued."""
        if self.config.is_embedding:
            raise ValueError(EMBEDDING_ONLY)
        params = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params] * len(id_lists)
        )
        if len(params) != len(id_lists):
            raise ValueError("sampling_params list must match the number of prompts")
        reqs = []
        for i, (ids, p) in enumerate(zip(id_lists, params)):
            sampling = SamplingParams.from_dict(with_defaults(p, self.model_info)[0])
            keyed, items = ids, []
            if images and images[i]:
                ids, keyed, items = self.image_rules().items(images[i], ids, self.limits.vocab_size)
            self.limits.check(ids, sampling)
            if not -1 <= logprob_start_len < len(ids):
                raise ValueError(f"logprob_start_len must be in [-1, {len(ids)})")
            for i in range(sampling.n):
                seed = None if sampling.seed is None else sampling.seed + i
                reqs.append(
                    Req(
                        rid=f"engine-{next(self._ids)}",
                        input_ids=list(keyed),
                        images=list(items),
                        sampling=dataclasses.replace(sampling, n=1, seed=seed),
                        return_logprob=return_logprob,
                        logprob_start_len=logprob_start_len,
                        top_logprobs_num=top_logprobs_num,
                        stream=stream,
                    )
                )
        return reqs

    def image_rules(self) -> ImageRules:
        c = self.config
        return ImageRules(
            self.model_info.get("vision"), c.max_image_bytes, c.max_request_image_bytes,
            c.max_image_pixels, c.allow_local_media,
        )  # fmt: skip

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
        if self.scheduler.kv.tiers is not None:  # pending disk writes land
            self.scheduler.kv.tiers.close()
            self.scheduler.kv.tiers = None
        if self.scheduler.grammars is not None:
            self.scheduler.grammars.shutdown()
        if self._loaded.tp is not None:  # stops ranks 1..N-1
            self._loaded.tp.close()
            self._loaded.tp = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
