"""The disk tier through the server: a prompt served, the server stopped (SIGTERM, or SIGKILL
while it writes) and started again on the same directory; the same prompt's greedy reply is
identical and its prefix comes from disk (OpenAI usage, meta_info, /metrics)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from conftest import Server, start_server


def long_text(num_words: int) -> str:
    return "Inventory notes. " + " ".join(
        f"crate {i} holds {i * 7 % 13} bolts;" for i in range(num_words // 5)
    )


def complete(server, prompt: str) -> dict:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
    reply.raise_for_status()
    return reply.json()


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    found = re.search(rf"^radixflow:{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


# two server starts: tests/runtime/cache/test_hicache_engine.py restarts in the default suite
@pytest.mark.slow
def test_restart_serves_the_prefix_from_disk(tmp_path: Path) -> None:
    config = {"enable_hierarchical_cache": True, "hicache_storage_dir": str(tmp_path)}
    prompt = long_text(110)
    with start_server(**config) as server:
        cold = complete(server, prompt)
    # start_server stopped it with SIGTERM: the drain flushed the pending writes
    prompt_tokens = cold["usage"]["prompt_tokens"]
    assert prompt_tokens > 192
    with start_server(**config) as server:
        warm = complete(server, prompt)
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= prompt_tokens - 64  # all but the last partial block, from disk
        assert metric(server, 'cached_tokens_by_tier_total{tier="disk"}') == cached
        assert metric(server, "hicache_bytes_read_total") > 0
        assert metric(server, "hicache_loads_total") == 1


def generate(server, prompt: str) -> dict:
    return server.generate(prompt, {"max_new_tokens": 12, "temperature": 0})


@pytest.mark.slow
def test_1500_token_prompt_after_sigterm_restart(tmp_path: Path) -> None:
    config = {"enable_hierarchical_cache": True, "hicache_storage_dir": str(tmp_path)}
    prompt = long_text(720)
    with start_server(**config) as server:
        cold = generate(server, prompt)
    assert 1480 <= cold["meta_info"]["prompt_tokens"] <= 1700
    with start_server(**config) as server:
        warm = generate(server, prompt)
    assert warm["text"] == cold["text"]
    assert warm["meta_info"]["cached_tokens_disk"] >= 1400
    assert warm["meta_info"]["cached_tokens"] == warm["meta_info"]["cached_tokens_disk"]


@pytest.mark.slow
def test_sigkill_during_write_back_leaves_a_usable_store(tmp_path: Path) -> None:
    """A small pool evicts (writes back) as prompts arrive; the server is killed with
    SIGKILL right after the last reply, with writes still queued or half done. The next
    server on the directory answers every prompt as before and keeps serving."""
    config = {
        "enable_hierarchical_cache": True,
        "hicache_storage_dir": str(tmp_path),
        "hicache_write_policy": "write_back",
        "max_total_tokens": 1024,
    }
    prompts = [f"Agent {n}. " + long_text(400) for n in range(4)]
    server = Server(**config)
    try:
        reference = [generate(server, p)["text"] for p in prompts]
        server.process.kill()
        server.process.wait()
    finally:
        server.shutdown()
    with start_server(**config) as server:
        assert not list(tmp_path.rglob("*.tmp"))  # a dead writer's temporary files go
        for prompt, expected in zip(prompts + prompts, reference + reference):
            assert generate(server, prompt)["text"] == expected
        assert metric(server, "hicache_blocks_bad_total") == 0  # renames: nothing torn
        assert metric(server, "hicache_blocks_read_total") > 0  # written back before the kill
