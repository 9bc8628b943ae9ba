"""One store directory under several processes: two servers given the same
--hicache-storage-dir at once, and the replicas of --dp-size behind sglang-router (which share
the directory by default). Every reply equals the reference, no block fails its check, and a
restart serves from what the processes wrote together. The store's own concurrency test,
without a model: tests/runtime/cache/test_shared_store.py."""

from __future__ import annotations

import importlib.util
import re
import threading
from pathlib import Path

import httpx
import pytest

from conftest import start_server

GREEDY = {"max_new_tokens": 12, "temperature": 0}


def long_text(num_words: int) -> str:
    return "Inventory notes. " + " ".join(
        f"crate {i} holds {i * 7 % 13} bolts;" for i in range(num_words // 5)
    )


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.search(rf"^radixflow:{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def serve_all(server, prompts: list[str]) -> list[dict]:
    return [server.generate(p, GREEDY) for p in prompts]


# four SmolLM2 starts and 16 prompts of ~800 tokens: about 2 minutes on 2 cores
@pytest.mark.slow
def test_two_servers_on_one_directory_at_once(tmp_path: Path) -> None:
    config = {
        "enable_hierarchical_cache": True,
        "hicache_storage_dir": str(tmp_path),
        "hicache_write_policy": "write_back",  # evictions write while the other one reads
        "max_total_tokens": 1024,
        "num_threads": 1,
        "log_level": "warning",
        "endpoint_timeout": 300.0,  # a shared 2-core machine
    }
    prompts = [f"Agent {n}. " + long_text(400) for n in range(4)]
    with start_server(**config) as a, start_server(**config) as b:
        replies: dict[str, list[dict]] = {}
        other = threading.Thread(target=lambda: replies.update(b=serve_all(b, prompts[::-1])))
        other.start()
        replies["a"] = serve_all(a, prompts)
        other.join(600)
        reference = [r["text"] for r in replies["a"]]
        assert [r["text"] for r in replies["b"][::-1]] == reference
        for server in (a, b):
            assert metric(server.url, "hicache_blocks_written_total") > 0
    # SIGTERM: each drained and wrote back what its pool held; both start again at once
    with start_server(**config) as a, start_server(**config) as b:
        for server in (a, b):
            warm = serve_all(server, prompts)
            assert [r["text"] for r in warm] == reference
            assert all(r["meta_info"]["cached_tokens_disk"] > 0 for r in warm)
            assert metric(server.url, "hicache_blocks_bad_total") == 0
    assert not list(tmp_path.rglob("*.tmp"))


HAS_ROUTER = importlib.util.find_spec("sglang_router") is not None


# two replicas started twice behind the router: about 2 minutes on 2 cores
@pytest.mark.slow
@pytest.mark.skipif(not HAS_ROUTER, reason="pip install sglang-router (test extra)")
def test_router_replicas_share_the_disk_tier(tmp_path: Path) -> None:
    """--dp-size 2 behind sglang-router's cache-aware policy: a prompt sent again reaches the
    replica whose pool holds it (cached from the pool, not the disk); after the replicas are
    restarted, whichever one the router picks loads it from the shared directory."""
    config = {
        "dp_size": 2,
        "threads_per_replica": 1,
        "enable_hierarchical_cache": True,
        "hicache_storage_dir": str(tmp_path),
        "max_total_tokens": 4096,
        "log_level": "warning",
        "endpoint_timeout": 300.0,  # a shared 2-core machine
        "launch_timeout": 900.0,
    }
    prompts = [f"Agent {n}. " + long_text(300) for n in range(3)]
    with start_server(**config) as cluster:
        cold = serve_all(cluster, prompts)
        again = serve_all(cluster, prompts)
    for first, second in zip(cold, again):
        assert second["text"] == first["text"]
        # cache-aware routing: the replica that computed it serves it from its pool
        assert second["meta_info"]["cached_tokens"] >= first["meta_info"]["prompt_tokens"] - 16
        assert second["meta_info"]["cached_tokens_disk"] == 0
    with start_server(**config) as cluster:  # new replicas, new router: only the disk knows
        warm = serve_all(cluster, prompts)
    for first, loaded in zip(cold, warm):
        assert loaded["text"] == first["text"]
        assert loaded["meta_info"]["cached_tokens_disk"] >= first["meta_info"]["prompt_tokens"] - 64
