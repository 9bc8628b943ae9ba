"""How many KV token slots the pool gets, and in which dtype, checked against the machine.

The pool is planned before any weight is read (`plan_memory`, from the file headers'
estimate of the weights and the memory available at start), so a size that cannot fit is
refused in seconds with the figures, never found out by the OS's OOM killer minutes later.
After the load `size_kv_pool` sizes it with the weights as they turned out.

- Neither `--max-total-tokens` nor `--mem-fraction-static` given (both 0): the pool takes
  AUTO_SHARE of what the memory available at start leaves after the weights and a reserve
  (activations, the tokenizer, grammars, the server process, the OS), or one full context (up
  to FLOOR_TOKENS) if that is more and fits; capped at DEFAULT_POOL_TOKENS (or one full
  context if longer), and never above context x --max-running-requests.
- `--max-total-tokens N`: N slots, refused when weights + pool + reserve exceed the memory.
- `--mem-fraction-static F` (SGLang's flag): F of the memory free after the weights
  (SGLang applies F to the whole device, weights included), refused the same way.

A token's KV costs 2 (K and V) x layers x KV heads x head dim x dtype bytes, and for an int8
pool 2 x layers x KV heads x 4 more (a scale per token and head: kernels/kv_int8.py). The
dtype: `--kv-cache-dtype auto` is fp16 for quantized weights and large fp32 models on CPU (as
llama.cpp defaults to f16 KV; measured in docs/models.md), else the model's own; int8 is
CPU only (the Triton attention reads no int8 pool: refused on CUDA at start).
`RADIXFLOW_AVAILABLE_MEMORY` (bytes, or with a K/M/G suffix) replaces the reading of the
available memory: to plan for a smaller machine, and for tests.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from radixflow.kernels.kv_int8 import SCALE_BYTES
from radixflow.runtime.config import DEFAULT_POOL_TOKENS, ServerConfig
from radixflow.runtime.models import quantized
from radixflow.runtime.models.footprint import holds_quantized, weight_bytes_estimate

log = logging.getLogger("radixflow.kv")
GIB = 1 << 30
KV_DTYPES = {  # SGLang's spellings, and llama.cpp's f16 as fp16
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "int8": torch.int8,  # with a scale per token and KV head (kernels/kv_int8.py)
}
AUTO_HALF = torch.float16  # auto's pool for quantized / large fp32 models (docs/models.md)
LARGE_MODEL_BYTES = 2 * GIB  # fp32 weights from this size get auto's half-precision pool
AUTO_SHARE = {"cpu": 0.5, "cuda": 0.9}  # of the memory left after the weights and reserve
FLOOR_TOKENS = 8192  # auto takes more than its share, if it fits, for one context up to this
RESERVE_FIXED = GIB  # activations, tokenizer, grammars, the server process
RESERVE_SHARE = 0.05  # of the machine's total: the OS and page cache breathing room
ENV_AVAILABLE = "RADIXFLOW_AVAILABLE_MEMORY"


class MemoryBudgetError(ValueError):
    """The weights, the KV pool asked for and the reserve do not fit the memory."""


class KVDtypeError(ValueError):
    """A --kv-cache-dtype the device's attention cannot read."""


@dataclass(frozen=True)
class MemoryPlan:
    """The memory a start plans with: what was available before the weights, what they
    take, the reserve kept, and the KV pool's dtype."""

    available: int
    weights: int
    reserve: int
    kv_dtype: torch.dtype
    where: str  # "available RAM" or "free GPU memory", for the messages


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


def kv_cache_dtype(
    name: str, model_dtype: torch.dtype, half_by_default: bool = False
) -> torch.dtype:
    """The KV pool's dtype for `--kv-cache-dtype name`; auto is fp16 where
    `half_by_default` (quantized or large fp32 weights on CPU), else the model's."""
    if name != "auto":
        return KV_DTYPES[name]
    return AUTO_HALF if half_by_default and model_dtype == torch.float32 else model_dtype


def kv_pool_dtype(sizing: KVSizing) -> torch.dtype:
    """The torch dtype of a sized pool."""
    return getattr(torch, sizing.dtype)


POOL_DTYPES = ("float32", "bfloat16", "float16", "int8")  # KVSizing.dtype names, by code


def rank0_pool_dtype(agree_min: Any, sizing: KVSizing | None) -> str:
    """Tensor parallelism: the pool dtype every rank takes, rank 0's (`sizing`: rank 0's pool;
    None on the other ranks). Under auto rank 0's plan saw the checkpoint (quantized: a
    half-precision pool) while a rank > 0 holds only its dequantized shard, so each would pick
    its own. `agree_min`: the group's all-reduce-min (TensorParallel.agree_min); every rank
    calls this at the same point of its start."""
    code = agree_min(len(POOL_DTYPES) if sizing is None else POOL_DTYPES.index(sizing.dtype))
    return POOL_DTYPES[code]


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def token_bytes(model_config: Any, dtype: torch.dtype) -> int:
    """A token's KV bytes in a pool of `dtype`, an int8 pool's scales included."""
    c = model_config
    per_token = kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, dtype.itemsize)
    if dtype == torch.int8:
        per_token += 2 * c.num_layers * c.num_kv_heads * SCALE_BYTES
    return per_token


def check_kv_device(dtype: torch.dtype, device_type: str, backend: str = "") -> None:
    """Raises KVDtypeError for an int8 pool off the CPU or under the Triton attention."""
    if dtype == torch.int8 and (device_type != "cpu" or backend == "triton"):
        where = "--attention-backend triton" if backend == "triton" else device_type
        raise KVDtypeError(
            f"--kv-cache-dtype int8 is read by the CPU kernels only: the Triton attention "
            f"({where}) reads no int8 pool; use bf16 or fp16 there"
        )


def parse_bytes(text: str) -> int:
    """'8G', '512M', '1.5g' or a plain byte count -> bytes. Raises ValueError."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(text[-1:], 1)
    number = float(text[:-1] if scale > 1 else text)
    if number <= 0:
        raise ValueError(f"{ENV_AVAILABLE} must be positive")
    return int(number * scale)


def available_memory(device: Any) -> tuple[int, int, str]:
    """(available bytes now, the machine's total, what was read) for `device`: CUDA free
    memory, or available RAM on CPU; RADIXFLOW_AVAILABLE_MEMORY replaces the reading."""
    cuda = getattr(device, "type", str(device)) == "cuda"
    if cuda:
        free, total = (int(v) for v in torch.cuda.mem_get_info(device))
    else:
        memory = psutil.virtual_memory()
        free, total = int(memory.available), int(memory.total)
    where = "free GPU memory" if cuda else "available RAM"
    override = os.environ.get(ENV_AVAILABLE)
    if override:
        free = total = parse_bytes(override)  # as on a machine of that size
        where += f" ({ENV_AVAILABLE})"
    return free, total, where


def reserve_bytes(total: int) -> int:
    return RESERVE_FIXED + int(RESERVE_SHARE * total)


def plan_memory(
    config: ServerConfig,
    model_dir: Path,
    model_config: Any,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[MemoryPlan, KVSizing]:
    """The plan and the pool it gives, before any weight is read; raises MemoryBudgetError
    (the figures and the largest pool that fits) when the model cannot start."""
    available, total, where = available_memory(device)
    weights = weight_bytes_estimate(model_dir, config, device, dtype)
    half = device.type == "cpu" and (
        holds_quantized(model_dir, config) or weights >= LARGE_MODEL_BYTES
    )
    plan = MemoryPlan(
        available,
        weights,
        reserve_bytes(total),
        kv_cache_dtype(config.kv_cache_dtype, dtype, half),
        where,
    )
    return plan, choose_pool(config, plan, model_config, device.type)


def plan_after_load(config: ServerConfig, model: Any, device: torch.device) -> MemoryPlan:
    """A plan for a model loaded without one (a tensor-parallel rank, a model passed in):
    the memory available now plus what the weights hold was what the load started from."""
    weights = quantized.weight_bytes(model)
    available, total, where = available_memory(device)
    param = next(model.parameters())
    half = device.type == "cpu" and (
        bool(quantized.quant_layers(model)) or weights >= LARGE_MODEL_BYTES
    )
    kv_dtype = kv_cache_dtype(config.kv_cache_dtype, param.dtype, half)
    if ENV_AVAILABLE not in where:  # a given figure is the machine's, weights included
        available += weights
    return MemoryPlan(available, weights, reserve_bytes(total), kv_dtype, where)


def measured_plan(plan: MemoryPlan, weights: int, device: torch.device) -> MemoryPlan:
    """The plan with the weights as loaded (the larger of the estimate and `weights`); on
    CUDA the free memory is read again, the weights already out of it."""
    if device.type == "cuda":
        free, _, _ = available_memory(device)
        return dataclasses.replace(plan, available=free + weights, weights=weights)
    return dataclasses.replace(plan, weights=max(plan.weights, weights))


def choose_pool(
    config: ServerConfig, plan: MemoryPlan, model_config: Any, device_type: str = "cpu"
) -> KVSizing:
    """The pool for `config` under `plan` (see the module docstring). Raises
    MemoryBudgetError, or KVDtypeError for an int8 pool off the CPU."""
    c = model_config
    check_kv_device(plan.kv_dtype, device_type)
    per_token = token_bytes(c, plan.kv_dtype)
    context = config.context_length or c.max_position
    page = config.page_size
    name = str(plan.kv_dtype).removeprefix("torch.")
    room = plan.available - plan.weights - plan.reserve
    largest = max(room, 0) // per_token // page * page

    def refuse(asked: str) -> MemoryBudgetError:
        return MemoryBudgetError(
            f"{asked} does not fit: the weights take {plan.weights / GIB:.2f} GiB, the reserve "
            f"{plan.reserve / GIB:.2f} GiB, of {plan.available / GIB:.2f} GiB {plan.where}; "
            + (
                f"the largest KV pool that fits is --max-total-tokens {largest:,} "
                f"({largest * per_token / GIB:.2f} GiB of {name} at {per_token:,} B per token)"
                if largest >= 2 * page
                else "no KV pool fits beside these weights (a smaller or more quantized model, "
                "or more memory, is needed)"
            )
        )

    if config.max_total_tokens:
        tokens = config.max_total_tokens
        if tokens > largest:
            raise refuse(
                f"--max-total-tokens {tokens:,} ({tokens * per_token / GIB:.2f} GiB of {name} KV)"
            )
        return KVSizing(tokens, per_token, "--max-total-tokens", context, name)
    if config.mem_fraction_static:
        fraction = config.mem_fraction_static
        free = plan.available - plan.weights
        tokens = int(max(free, 0) * fraction) // per_token // page * page
        if tokens < 2 * page or tokens > largest:
            raise refuse(f"--mem-fraction-static {fraction} ({tokens:,} tokens)")
        source = f"--mem-fraction-static {fraction} of {free / GIB:.2f} GiB {plan.where}"
        return KVSizing(tokens, per_token, source, context, name)
    if largest < 2 * page:
        raise refuse("the model")
    share = AUTO_SHARE.get(device_type, AUTO_SHARE["cpu"])
    if device_type == "cpu":
        share /= config.tp_size  # the ranks of one machine share its RAM
    floor = min(largest, context, FLOOR_TOKENS)  # a small machine: one context, if it fits
    fit = max(int(share * room) // per_token, floor) // page * page
    cap = min(max(DEFAULT_POOL_TOKENS, context), context * config.max_running_requests)
    cap = max(cap // page * page, 2 * page)
    tokens = min(fit, cap)
    source = (
        f"auto: {share:.0%} of the {room / GIB:.2f} GiB that {plan.available / GIB:.2f} GiB "
        f"{plan.where} leaves after {plan.weights / GIB:.2f} GiB of weights and a "
        f"{plan.reserve / GIB:.2f} GiB reserve"
        + (f", capped at {cap:,} tokens" if tokens == cap else "")
        + "; --max-total-tokens or --mem-fraction-static to change"
    )
    if tokens < context:
        log.warning(
            "the KV pool holds %s tokens, less than the model's context of %s: a longer "
            "request is refused (--context-length caps the context)", f"{tokens:,}", f"{context:,}"
        )  # fmt: skip
    return KVSizing(tokens, per_token, source, context, name)


def size_kv_pool(
    config: ServerConfig, model: Any, device: Any, plan: MemoryPlan | None = None
) -> KVSizing:
    """The pool for `config` and a loaded `model`: the plan redone with the weights as
    loaded (`plan_after_load` without one; what else the load left resident is the
    reserve's to cover); logs the start line. Raises MemoryBudgetError."""
    device = torch.device(device) if isinstance(device, str) else device
    weights = quantized.weight_bytes(model)
    if plan is None:
        plan = plan_after_load(config, model, device)
    final = measured_plan(plan, weights, device)
    if config.kv_cache_dtype != "auto":  # an engine sharing these weights may name its own
        final = dataclasses.replace(final, kv_dtype=KV_DTYPES[config.kv_cache_dtype])
    sizing = choose_pool(config, final, model.config, device.type)
    log.info("%s", sizing.describe())
    return sizing
