"""The KV pool sized to the machine: the default's share and cap, an explicit size refused
before any weight is read, the half-precision default, and the start log's figures. The
available memory is injected (a MemoryPlan, or RADIXFLOW_AVAILABLE_MEMORY for whole starts)."""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from types import SimpleNamespace

import psutil
import pytest
import torch

from radixflow import Runtime
from radixflow.runtime import Engine
from radixflow.runtime import launch as launch_module
from radixflow.runtime.config import DEFAULT_POOL_TOKENS, ServerConfig
from radixflow.runtime.model_executor.kv_sizing import (
    AUTO_SHARE,
    ENV_AVAILABLE,
    GIB,
    KVDtypeError,
    MemoryBudgetError,
    MemoryPlan,
    check_kv_device,
    choose_pool,
    kv_bytes_per_token,
    kv_cache_dtype,
    parse_bytes,
    plan_memory,
    reserve_bytes,
)
from radixflow.runtime.model_executor.model_runner import pick_dtype
from radixflow.runtime.models import model_config
from radixflow.runtime.models.loader import load_hf_config, resolve_model_dir

SMOLLM2 = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64, max_position=8192)
LLAMA_7B = SimpleNamespace(num_layers=32, num_kv_heads=32, head_dim=128, max_position=4096)
SMOLLM2_FP32 = 2 * 30 * 3 * 64 * 4


def plan(available: float, weights: float, dtype=torch.float16, total: float = 24) -> MemoryPlan:
    return MemoryPlan(
        int(available * GIB), int(weights * GIB), reserve_bytes(int(total * GIB)), dtype, "RAM"
    )


def test_bytes_per_token_formula() -> None:
    assert kv_bytes_per_token(30, 3, 64, 4) == SMOLLM2_FP32 == 46_080
    assert kv_bytes_per_token(80, 8, 128, 1) == 163_840  # Llama-3.3-70B, FP8 KV


def test_default_pool_for_smollm2_on_24_gib_stops_at_the_cap() -> None:
    sizing = choose_pool(ServerConfig(), plan(22.8, 0.1), SMOLLM2)
    assert sizing.num_tokens == DEFAULT_POOL_TOKENS
    assert sizing.gib < 1.5  # not the tens of GiB a share of the machine would give
    assert "capped at 65,536 tokens" in sizing.source


def test_default_pool_for_a_7b_takes_its_share_and_fits() -> None:
    p = plan(22.5, 4.1)
    sizing = choose_pool(ServerConfig(), p, LLAMA_7B)
    per_token = kv_bytes_per_token(32, 32, 128, 2)
    room = p.available - p.weights - p.reserve
    assert sizing.num_tokens == int(AUTO_SHARE["cpu"] * room) // per_token
    assert 4096 <= sizing.num_tokens < DEFAULT_POOL_TOKENS
    assert p.weights + sizing.num_tokens * per_token + p.reserve <= p.available
    assert "auto: 50% of the" in sizing.source and "capped" not in sizing.source


def test_int8_pool_holds_about_twice_bf16s_tokens_in_the_same_memory() -> None:
    """The 7B's default pool on a 24 GiB machine: int8 (a byte a value plus a 4-byte scale per
    token and KV head) holds 1.94x the tokens of bf16's pool in no more memory; refused off
    the CPU, where the Triton attention reads no int8 pool."""
    p = plan(22.5, 4.1, torch.int8)
    bf16 = choose_pool(ServerConfig(), dataclasses.replace(p, kv_dtype=torch.bfloat16), LLAMA_7B)
    int8 = choose_pool(ServerConfig(), p, LLAMA_7B)
    assert int8.bytes_per_token == 2 * 32 * 32 * (128 + 4) == 270_336  # bf16: 524,288
    assert int8.dtype == "int8" and bf16.bytes_per_token == 524_288
    share = int(AUTO_SHARE["cpu"] * (p.available - p.weights - p.reserve))  # the same bytes
    assert (int8.num_tokens, bf16.num_tokens) == (share // 270_336, share // 524_288)
    assert 1.9 < int8.num_tokens / bf16.num_tokens < 2.0
    assert kv_cache_dtype("int8", torch.float32) == torch.int8
    with pytest.raises(KVDtypeError, match="int8 is read by the CPU kernels only"):
        choose_pool(ServerConfig(), plan(22.5, 4.1, torch.int8), LLAMA_7B, "cuda")
    with pytest.raises(KVDtypeError, match=r"Triton attention \(--attention-backend triton\)"):
        check_kv_device(torch.int8, "cpu", "triton")  # the runner's check, --attention-backend
    check_kv_device(torch.int8, "cpu", "torch")
    check_kv_device(torch.bfloat16, "cuda", "triton")


def test_small_machine_gets_one_full_context_when_it_fits_and_less_when_not() -> None:
    per_token = kv_bytes_per_token(32, 32, 128, 2)
    roomy = plan(4.1 + reserve_bytes(8 * GIB) / GIB + 2.5, 4.1, total=8)  # 2.5 GiB of room
    assert choose_pool(ServerConfig(), roomy, LLAMA_7B).num_tokens == 4096  # > half the room
    tight = plan(4.1 + reserve_bytes(8 * GIB) / GIB + 1.0, 4.1, total=8)  # 1 GiB: 2,048 tokens
    assert choose_pool(ServerConfig(), tight, LLAMA_7B).num_tokens == GIB // per_token


def test_cap_is_never_above_context_times_running_requests() -> None:
    config = ServerConfig(context_length=512, max_running_requests=4)
    assert choose_pool(config, plan(22.8, 0.1), SMOLLM2).num_tokens == 2048


def test_explicit_size_that_cannot_fit_is_refused_with_the_largest_that_fits() -> None:
    p = plan(22.5, 4.1)
    with pytest.raises(MemoryBudgetError) as caught:
        choose_pool(ServerConfig(max_total_tokens=100_000), p, LLAMA_7B)
    message = str(caught.value)
    assert "--max-total-tokens 100,000" in message and "4.10 GiB" in message
    largest = int(
        re.search(r"largest KV pool that fits is --max-total-tokens ([\d,]+)", message)[1].replace(
            ",", ""
        )
    )
    assert choose_pool(ServerConfig(max_total_tokens=largest), p, LLAMA_7B).num_tokens == largest
    with pytest.raises(MemoryBudgetError):
        choose_pool(ServerConfig(max_total_tokens=largest + 1), p, LLAMA_7B)


def test_weights_beyond_the_memory_leave_no_pool() -> None:
    for config in (ServerConfig(), ServerConfig(max_total_tokens=1024)):
        with pytest.raises(MemoryBudgetError, match="no KV pool fits beside these weights"):
            choose_pool(config, plan(6.0, 5.5, total=8), LLAMA_7B)


def test_pool_follows_the_fraction_with_page_rounding() -> None:
    p = plan(10 + reserve_bytes(24 * GIB) / GIB, 0, torch.float32)
    free = p.available
    sizes = {
        f: choose_pool(ServerConfig(mem_fraction_static=f, page_size=16), p, SMOLLM2).num_tokens
        for f in (0.1, 0.2, 0.4)
    }
    for f, tokens in sizes.items():
        assert tokens % 16 == 0 and tokens == int(free * f) // SMOLLM2_FP32 // 16 * 16
    with pytest.raises(MemoryBudgetError):  # leaves the reserve no room
        choose_pool(ServerConfig(mem_fraction_static=0.99), p, SMOLLM2)
    with pytest.raises(ValueError, match="mem_fraction_static"):
        ServerConfig(mem_fraction_static=1.5)


def test_kv_dtype_spellings_and_the_half_precision_default() -> None:
    for name, dtype in (
        ("bf16", torch.bfloat16),
        ("fp16", torch.float16),
        ("float32", torch.float32),
    ):
        assert kv_cache_dtype(name, torch.float32, half_by_default=True) == dtype
    assert kv_cache_dtype("auto", torch.float32, half_by_default=True) == torch.float16
    assert kv_cache_dtype("auto", torch.float32) == torch.float32
    assert kv_cache_dtype("auto", torch.bfloat16, half_by_default=True) == torch.bfloat16
    assert parse_bytes("8G") == 8 * GIB and parse_bytes("512MiB") == 512 << 20
    model_dir = resolve_model_dir("smollm2")
    config = model_config(load_hf_config(model_dir))
    cpu = torch.device("cpu")
    for settings, want in (({}, torch.float16), ({"dequantize_weights": True}, torch.float32)):
        server = ServerConfig(**settings)
        memory, _ = plan_memory(server, model_dir, config, cpu, pick_dtype("auto", cpu))
        assert memory.kv_dtype == want, settings
    assert 80 << 20 < memory.weights  # dequantized: 135M fp32 weights, packed twice
    quantized, _ = plan_memory(ServerConfig(), model_dir, config, cpu, torch.float32)
    assert 80 << 20 < quantized.weights < 120 << 20  # the file's blocks (92 MiB loaded)


def test_engine_refuses_before_reading_any_weight(monkeypatch) -> None:
    def no_load(*args, **kwargs):
        raise AssertionError("weights were read before the memory check")

    monkeypatch.setattr(launch_module, "load_model", no_load)
    monkeypatch.setenv(ENV_AVAILABLE, "2G")
    with pytest.raises(MemoryBudgetError, match="--max-total-tokens 1,000,000"):
        Engine(model="smollm2", max_total_tokens=1_000_000)


def test_engine_start_log_says_how_the_default_pool_was_sized(
    make_engine, monkeypatch, caplog
) -> None:
    """An engine sharing the session's weights, the machine made 3 GiB: the pool is half of
    what 3 GiB leaves after the weights and the reserve, fp16, and the log says so."""
    monkeypatch.setenv(ENV_AVAILABLE, "3G")
    with caplog.at_level(logging.INFO, logger="radixflow.kv"):
        engine = make_engine(max_total_tokens=0, kv_cache_dtype="auto")
    line = next(r.getMessage() for r in caplog.records if r.name == "radixflow.kv")
    match = re.search(
        r"KV pool: float16, ([\d,]+) B per token, ([\d,]+) tokens, ([\d.]+) GiB \(auto: 50% of "
        r"the ([\d.]+) GiB that 3.00 GiB available RAM \(RADIXFLOW_AVAILABLE_MEMORY\) leaves",
        line,
    )
    assert match, line
    per_token, tokens = (int(v.replace(",", "")) for v in match.groups()[:2])
    room = float(match[4]) * GIB
    assert per_token == SMOLLM2_FP32 // 2
    assert engine.stats()["total_slots"] == tokens
    assert engine.scheduler.runner.k_caches.dtype == torch.float16
    assert abs(tokens - 0.5 * room / per_token) <= 1 + 0.01 * tokens
    assert room < 3 * GIB - reserve_bytes(3 * GIB) + 1  # the reserve came off
    out = engine.generate("Hello", {"max_new_tokens": 2, "temperature": 0})
    assert out["meta_info"]["completion_tokens"] == 2


def test_server_that_cannot_fit_exits_with_the_reason(monkeypatch) -> None:
    """`radixflow serve --max-total-tokens 100000` on a machine made 2 GiB: Runtime raises
    with the server's reason within seconds, and no process is left."""
    monkeypatch.setenv(ENV_AVAILABLE, "2G")
    before = {p.pid for p in psutil.Process().children(recursive=True)}  # the session's servers
    start = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        Runtime(max_total_tokens=100_000)
    assert time.monotonic() - start < 30
    message = str(caught.value)
    assert "failed to start: --max-total-tokens 100,000" in message and "does not fit" in message
    time.sleep(1)  # the scheduler exits right after it sends its reason
    left = [p.cmdline() for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert not [c for c in left if "radixflow.runtime" in " ".join(c)], left


def test_a_prompt_the_pool_cannot_hold_is_refused_not_preempted(make_engine) -> None:
    engine = make_engine(max_total_tokens=64)
    out = engine.generate("word " * 100, {"max_new_tokens": 4})
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "error" and "the pool holds 64" in reason["message"]
    assert out["meta_info"]["num_preemptions"] == 0
    assert engine.generate("Hi", {"max_new_tokens": 4})["meta_info"]["completion_tokens"] == 4
    engine.scheduler.check_invariants()  # nothing leaked: every slot free or in the tree
