"""Loading the draft model of `--speculative-algorithm draft` beside the target, in the same
(scheduler) process: its weights as they are (a GGUF's stay quantized), its tokenizer checked
against the target's before any weight is read, its own KV pool (one-slot pages) and model
runner. The speculator itself is torch-free: runtime/scheduler/draft_model.py."""

from __future__ import annotations

import logging
import time
from typing import Any

from transformers import PreTrainedTokenizerBase

from radixflow.runtime import models
from radixflow.runtime.cache.kv_pool import KVPool
from radixflow.runtime.config import ServerConfig
from radixflow.runtime.model_executor.model_runner import (
    ModelRunner,
    load_model,
    pick_device,
    pick_dtype,
)
from radixflow.runtime.models.loader import load_hf_config, resolve_model_dir
from radixflow.runtime.scheduler.draft_model import (
    DraftSpeculator,
    check_same_tokenizer,
    draft_config,
)
from radixflow.runtime.tokenizer import load_tokenizer

log = logging.getLogger("radixflow.engine")
MAX_DRAFT_POOL_TOKENS = 32768  # the draft's pool: the target's, up to this


def build_draft(
    config: ServerConfig,
    tokenizer: PreTrainedTokenizerBase,
    vocab_size: int,
    eos_token_ids: tuple[int, ...],
    target_tokens: int,
    context_len: int,
) -> DraftSpeculator:
    """The draft speculator for a target with `tokenizer` and `vocab_size`. Raises
    DraftMismatchError (a ValueError) when the draft's tokenizer is not the target's."""
    start = time.perf_counter()
    dconfig = draft_config(config)
    model_dir = resolve_model_dir(dconfig.model_path, "")
    draft_vocab = models.model_config(load_hf_config(model_dir)).vocab_size
    check_same_tokenizer(
        tokenizer, load_tokenizer(model_dir, ""), vocab_size, draft_vocab, dconfig.model_path
    )
    device = pick_device(config.device)
    model: Any = load_model(model_dir, dconfig, device, pick_dtype(config.dtype, device))
    if model.config.max_position < context_len:
        log.warning(
            "draft model: %d positions, the target's context %d; longer requests get no drafts",
            model.config.max_position, context_len,
        )  # fmt: skip
    pool = KVPool(min(target_tokens, MAX_DRAFT_POOL_TOKENS), 1)
    runner = ModelRunner(model, pool.num_slots, seed=config.seed + 1, max_kv_len=context_len)
    log.info(
        "draft model %s loaded in %.1f s (KV pool of %d tokens)",
        model_dir.name, time.perf_counter() - start, pool.capacity_pages,
    )  # fmt: skip
    return DraftSpeculator(
        config, eos_token_ids, runner, pool, vocab_size, min(context_len, model.config.max_position)
    )
