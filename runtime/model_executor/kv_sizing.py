"""How many KV token slots the pool gets: an absolute count, or a share of memory.

`--mem-fraction-static F` (SGLang's flag name) gives the KV pool F of the memory that is free
once the weights are loaded: the device's free memory on CUDA (`torch.cuda.mem_get_info`),
available RAM on CPU (psutil). SGLang applies its F to the whole device, weights included;
radixflow applies it to what the weights left, so F = 0.9 means "90% of what is free now".
An explicit `--max-total-tokens` (any value but its default) still wins. A token's KV costs
2 (K and V) x layers x KV heads x head dim x dtype bytes, the dtype `--kv-cache-dtype`'s
(`kv_cache_dtype`): a bf16 pool holds twice an fp32 model's tokens in the same memory.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from radixflow.runtime.config import ServerConfig

log = logging.getLogger("radixflow.kv")
GIB = 1 << 30
KV_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16}  # SGLang's spellings
DEFAULT_MAX_TOTAL_TOKENS = next(
    f.default for f in dataclasses.fields(ServerConfig) if f.name == "max_total_tokens"
)


@dataclass(frozen=True)
class KVSizing:
    num_tokens: int
    bytes_per_token: int
    source: str  # how the size was chosen, for the start log
    context_len: int
    dtype: str = "float32"  # the pool's, for the start log

    @property
    def gib(self) -> float:
        return self.num_tokens * self.bytes_per_token / GIB

    def describe(self) -> str:
        fits = self.num_tokens // max(self.context_len, 1)
        quarter = self.num_tokens // max(self.context_len // 4, 1)
        return (
            f"KV pool: {self.dtype}, {self.bytes_per_token:,} B per token, {self.num_tokens:,} "
            "tokens, "
            f"{self.gib:.2f} GiB ({self.source}); fits {fits:,} requests at the full context "
            f"of {self.context_len:,} tokens, {quarter:,} at {self.context_len // 4:,} (the "
            "live figure for the observed average is stats' requests_fit_avg_context)"
        )


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's dtype for `--kv-cache-dtype name`: the model's own for auto."""
    return model_dtype if name == "auto" else KV_DTYPES[name]


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def tokens_for_memory(free_bytes: int, fraction: float, bytes_per_token: int, page: int) -> int:
    """Whole pages of KV that fit in `fraction` of `free_bytes`."""
    tokens = int(free_bytes * fraction) // bytes_per_token
    return tokens // page * page


def free_memory_bytes(device: Any) -> int:
    """Free memory on `device` now: CUDA free memory, or available RAM on CPU."""
    if getattr(device, "type", str(device)) == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])

    return int(psutil.virtual_memory().available)


def size_kv_pool(
    config: ServerConfig, model: Any, device: Any, free_bytes: int | None = None
) -> KVSizing:
    """The pool size for `config` and a loaded `model` (its weights already in memory);
    logs the start line. Raises ValueError when the fraction leaves no room for a request."""
    c = model.config
    param = next(model.parameters())
    dtype = KV_DTYPES.get(config.kv_cache_dtype)  # None for auto: the model's
    dtype_bytes = param.element_size() if dtype is None else dtype.itemsize
    name = str(param.dtype if dtype is None else dtype).removeprefix("torch.")
    per_token = kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, dtype_bytes)
    context = config.context_length or c.max_position
    fraction = config.mem_fraction_static
    if fraction <= 0 or config.max_total_tokens != DEFAULT_MAX_TOTAL_TOKENS:
        note = (
            "--max-total-tokens" if fraction <= 0 else "--max-total-tokens overrides the fraction"
        )
        sizing = KVSizing(config.max_total_tokens, per_token, note, context, name)
    else:
        free = free_memory_bytes(device) if free_bytes is None else free_bytes
        tokens = tokens_for_memory(free, fraction, per_token, config.page_size)
        if tokens < 2 * config.page_size:
            raise ValueError(
                f"--mem-fraction-static {fraction} of {free / GIB:.2f} GiB free leaves no KV "
                f"pool ({per_token:,} B per token)"
            )
        where = "GPU memory" if getattr(device, "type", "") == "cuda" else "available RAM"
        sizing = KVSizing(
            tokens,
            per_token,
            f"--mem-fraction-static {fraction} of {free / GIB:.2f} GiB {where}",
            context,
            name,
        )
    log.info("%s", sizing.describe())
    return sizing
