"""Loading a model and wiring its scheduler: resolve the checkpoint (converting a GGUF once),
plan the memory before any weight is read, load the weights and tokenizer, size the KV pool,
build the model runner and the scheduler. Shared by the offline Engine (runtime/engine.py) and
the server's scheduler process (runtime/scheduler/loop.py), so both run the same code.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from radixflow.runtime import models
from radixflow.runtime.cache.kv_pool import KVPool
from radixflow.runtime.config import ServerConfig, fixed_threads
from radixflow.runtime.config.checks import lora_adapters
from radixflow.runtime.constrained.grammar import GrammarBackend
from radixflow.runtime.constrained.llg_backend import LlgBackend
from radixflow.runtime.constrained.triggered import TriggeredBackend
from radixflow.runtime.distributed.tensor_parallel import start_rank0
from radixflow.runtime.distributed.tier_ranks import TierRanks
from radixflow.runtime.hicache import build_tier
from radixflow.runtime.launch_draft import build_draft
from radixflow.runtime.model_executor.cuda_graph import graph_max_bs
from radixflow.runtime.model_executor.kv_sizing import (
    GIB,
    MemoryPlan,
    kv_pool_dtype,
    plan_memory,
    rank0_pool_dtype,
    size_kv_pool,
)
from radixflow.runtime.model_executor.model_runner import (
    ModelRunner,
    load_model,
    pick_device,
    pick_dtype,
)
from radixflow.runtime.model_executor.threads import ThreadGovernor
from radixflow.runtime.models.bert import Encoder, sentence_pooling
from radixflow.runtime.models.card import model_card
from radixflow.runtime.models.layers import CausalLM
from radixflow.runtime.models.loader import (
    load_hf_config,
    model_fim_token_ids,
    model_sampling_defaults,
    resolve_model_dir,
)
from radixflow.runtime.scheduler.scheduler import Scheduler
from radixflow.runtime.tokenizer import (
    eos_token_ids,
    load_tokenizer,
)

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
    model: CausalLM | Encoder
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
    encoder = isinstance(model, Encoder)
    if config.context_length > model.config.max_position:
        raise ValueError(
            f"context_length {config.context_length} exceeds the model's "
            f"{model.config.max_position} (max_position_embeddings); it can only cap it"
        )
    context_len = config.context_length or model.config.max_position
    sizing = size_kv_pool(config, model, device, loaded.memory)
    num_tokens = sizing.num_tokens
    if loaded.tp is not None:  # every rank's pool has rank 0's dtype and the same slots
        rank0_pool_dtype(loaded.tp.agree_min, sizing)
        num_tokens = loaded.tp.agree_min(num_tokens)
    pool = KVPool(num_tokens, config.page_size)
    runner = ModelRunner(
        model,
        pool.num_slots,
        seed=config.seed,
        shared_prefix=not config.disable_shared_prefix_attention,
        cuda_graph_max_bs=0 if encoder else graph_max_bs(config, model),
        max_kv_len=context_len,
        prefault=not config.disable_kv_prefault,
        governor=governor(config, device, loaded.tp is not None),
        kv_dtype=kv_pool_dtype(sizing),
        max_lora_rank=config.max_lora_rank,
    )
    if loaded.tp is not None:  # each step goes to ranks 1..N-1 first (tensor_parallel.py)
        runner.forward = functools.partial(loaded.tp.run_step, runner.forward)
        runner.loras = None  # adapters are not sharded: refused (ServerConfig, load_lora)
    eos = eos_token_ids(tokenizer, hf_config)
    speculator = None
    if config.speculative_algorithm == "draft":  # a second model in this process
        vocab = model.config.vocab_size
        speculator = build_draft(config, tokenizer, vocab, eos, num_tokens, context_len)
    tiers = build_tier(config, model_dir, runner, pool, (0, config.tp_size))
    if tiers is not None and loaded.tp is not None:  # each rank its own shard of the store
        tiers.shards = TierRanks(loaded.tp)
    scheduler = Scheduler(
        config,
        runner,
        pool,
        eos_token_ids=eos,
        context_len=context_len,
        vocab_size=model.config.vocab_size,
        # an image's placeholders are keyed past the vocabulary (server/images.py): not text
        decode=lambda ids: tokenizer.decode(
            [t for t in ids if t < len(tokenizer)], skip_special_tokens=True
        ),
        grammars=None  # embeddings only: no generation, no grammar
        if config.is_embedding
        else _grammar_backend(config, tokenizer, model.config.vocab_size, eos),
        encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
        encoder=encoder,
        speculator=speculator,
        tiers=tiers,
    )
    for name, path in lora_adapters(config).items():  # LoraError (a ValueError): no start
        scheduler.loras.load(name, path, runner)
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
        "kv_pool": {
            "dtype": sizing.dtype,
            "bytes_per_token": sizing.bytes_per_token,
            "tokens": sizing.num_tokens,
        },  # fmt: skip
        "cuda_graph_batch_sizes": runner.graphs.sizes if runner.graphs is not None else [],
        # what a request leaves unset samples with (--sampling-defaults)
        "sampling_defaults": (
            model_sampling_defaults(model_dir) if config.sampling_defaults == "model" else {}
        ),
        "fim_token_ids": model_fim_token_ids(model_dir),  # a GGUF's FIM tokens (server/fim.py)
        "card": model_card(model_dir, hf_config),  # what the weights are (Ollama's listings)
        # an encoder (--is-embedding): embed inputs get its special tokens ([CLS] ... [SEP])
        "is_encoder": encoder,
        "is_embedding": config.is_embedding,
        "pooling": sentence_pooling(model_dir) if encoder else "last",  # an embed's default
        "lora_adapters": dict(scheduler.loras.paths),  # at start; the server follows changes
        # a vision model's image tokens and processor sizes (server/images.py); None: text only
        # (tensor-parallel ranks hold no vision tower: images are refused there)
        "vision": vision_model_info(
            getattr(model, "vision", None) if config.tp_size == 1 else None, tokenizer
        ),
    }
    # what loading made (modules, tokenizer tables, imports: a few hundred thousand objects)
    # lives as long as the process: frozen out of the collector's reach, its full collections
    # stop walking it every few hundred steps (SmolLM2's one stream: 4-7% more tokens a second)
    gc.collect()
    gc.freeze()
    return ModelBundle(scheduler, tokenizer, info, loaded, time.perf_counter() - start)


def vision_model_info(vision: Any, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any] | None:
    """A vision model's token ids, processor sizes and the text of one image's placeholder
    (what a program writes for an image: <|vision_start|><|image_pad|><|vision_end|>)."""
    if vision is None:
        return None
    info = vision.info
    ids = [info["vision_start_token_id"], info["image_token_id"], info["vision_end_token_id"]]
    return {**info, "placeholder": tokenizer.decode(ids)}


def _grammar_backend(
    config: ServerConfig, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos: tuple[int, ...]
) -> Any:
    """The configured backend, taking structural tags (triggered constraints) too."""
    # None: JSON schemas in the canonical layout (schema_regex.canonical_layout)
    flexible = "[ ]?" if config.grammar_any_whitespace else None
    whitespace = config.grammar_whitespace or flexible
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
