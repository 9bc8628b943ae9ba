"""KV sized by memory (--mem-fraction-static) and the start log's figures."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest
import torch

from radixflow.runtime.config import ServerConfig
from radixflow.runtime.model_executor.kv_sizing import GIB, kv_bytes_per_token, size_kv_pool

SMOLLM2_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # K and V, 30 layers, 3 KV heads, dim 64, fp32


def fake_model(layers: int = 30, kv_heads: int = 3, head_dim: int = 64, dtype_bytes: int = 4):
    dtype = {4: torch.float32, 2: torch.bfloat16, 1: torch.int8}[dtype_bytes]
    param = SimpleNamespace(element_size=lambda: dtype_bytes, dtype=dtype)
    config = SimpleNamespace(
        num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, max_position=8192
    )
    return SimpleNamespace(config=config, parameters=lambda: iter([param]))


def test_pool_follows_the_fraction() -> None:
    free = 10 * GIB
    sizes = {
        f: size_kv_pool(ServerConfig(mem_fraction_static=f), fake_model(), "cpu", free).num_tokens
        for f in (0.1, 0.2, 0.4)
    }
    assert sizes[0.1] == int(free * 0.1) // SMOLLM2_BYTES_PER_TOKEN
    assert sizes[0.4] == int(free * 0.4) // SMOLLM2_BYTES_PER_TOKEN
    assert abs(sizes[0.2] / sizes[0.1] - 2) < 1e-3 and abs(sizes[0.4] / sizes[0.2] - 2) < 1e-3


def test_page_rounding_and_override() -> None:
    config = ServerConfig(mem_fraction_static=0.3, page_size=16)
    tokens = size_kv_pool(config, fake_model(), "cpu", 3 * GIB).num_tokens
    assert tokens % 16 == 0 and tokens == int(0.3 * 3 * GIB) // SMOLLM2_BYTES_PER_TOKEN // 16 * 16
    explicit = config.replace(max_total_tokens=4096)
    assert size_kv_pool(explicit, fake_model(), "cpu", 3 * GIB).num_tokens == 4096
    off = ServerConfig()  # fraction 0: --max-total-tokens as before
    assert size_kv_pool(off, fake_model(), "cpu", 3 * GIB).num_tokens == off.max_total_tokens


def test_fraction_too_small_or_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="leaves no KV pool"):
        size_kv_pool(ServerConfig(mem_fraction_static=1e-9), fake_model(), "cpu", GIB)
    with pytest.raises(ValueError, match="mem_fraction_static"):
        ServerConfig(mem_fraction_static=1.5)


def test_bytes_per_token_formula() -> None:
    assert kv_bytes_per_token(30, 3, 64, 4) == SMOLLM2_BYTES_PER_TOKEN == 46_080
    assert kv_bytes_per_token(80, 8, 128, 1) == 163_840  # Llama-3.3-70B, FP8 KV


def test_engine_start_log_for_smollm2(make_engine, caplog) -> None:
    """The real engine: the log's bytes per token are SmolLM2's, the pool it allocated is
    the logged size, the logged GiB is tokens x bytes, and the size is the fraction of the
    free memory it logged."""
    with caplog.at_level(logging.INFO, logger="radixflow.kv"):
        # the session engine sets max_total_tokens; back to the default, the fraction decides
        engine = make_engine(
            mem_fraction_static=0.01, max_total_tokens=ServerConfig().max_total_tokens
        )
    line = next(r.getMessage() for r in caplog.records if r.name == "radixflow.kv")
    match = re.search(
        r"([\d,]+) B per token, ([\d,]+) tokens, ([\d.]+) GiB \(--mem-fraction-static 0.01 of "
        r"([\d.]+) GiB available RAM\); fits ([\d,]+) requests at the full context of ([\d,]+)",
        line,
    )
    assert match, line
    per_token, tokens, gib, free_gib, fits, context = match.groups()
    per_token, tokens, context = (int(v.replace(",", "")) for v in (per_token, tokens, context))
    assert per_token == SMOLLM2_BYTES_PER_TOKEN
    assert engine.stats()["total_slots"] == tokens
    assert abs(float(gib) - tokens * per_token / GIB) < 0.01
    assert abs(tokens - 0.01 * float(free_gib) * GIB / per_token) / tokens < 0.01
    assert int(fits.replace(",", "")) == tokens // context
    out = engine.generate("Hello", {"max_new_tokens": 2, "temperature": 0})
    assert out["meta_info"]["completion_tokens"] == 2
