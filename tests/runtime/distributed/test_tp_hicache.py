"""The disk tier under tensor parallelism (runtime/cache/tier_shards.py,
runtime/distributed/tier_ranks.py) on SmolLM2 with two ranks on loopback: each rank stores its
own KV heads in its own shard of the store; a server restarted (SIGTERM) with the same tp size
loads every rank's shard, one with another tp size reads none. The shard logic without a model
or ranks: tests/runtime/cache/test_tier_shards.py."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from conftest import start_server

GREEDY = {"max_new_tokens": 12, "temperature": 0}


def long_text(num_words: int) -> str:
    return "Inventory notes. " + " ".join(
        f"crate {i} holds {i * 7 % 13} bolts;" for i in range(num_words // 5)
    )


def shards(root: Path) -> dict[tuple[int, int], set[str]]:
    """(tp_rank, tp_size) -> the block files of that shard."""
    found = {}
    for described in root.glob("*/FINGERPRINT.json"):
        fingerprint = json.loads(described.read_text())
        key = (fingerprint["tp_rank"], fingerprint["tp_size"])
        found[key] = {p.name for p in described.parent.rglob("*.kv")}
    return found


# three SmolLM2 starts, two of them two ranks each: about 2 minutes on 2 cores
@pytest.mark.slow
def test_tp2_restart_loads_every_ranks_shard(tmp_path: Path) -> None:
    config = {
        "enable_hierarchical_cache": True,
        "hicache_storage_dir": str(tmp_path),
        "num_threads": 1,
        "max_total_tokens": 4096,
        "log_level": "warning",
        "endpoint_timeout": 300.0,  # a shared 2-core machine
    }
    prompt = long_text(360)
    with start_server(tp_size=2, **config) as server:
        cold = server.generate(prompt, GREEDY)
    prompt_tokens = cold["meta_info"]["prompt_tokens"]
    assert prompt_tokens >= 600
    on_disk = shards(tmp_path)
    assert set(on_disk) == {(0, 2), (1, 2)}  # one shard per rank
    assert on_disk[0, 2] == on_disk[1, 2] and len(on_disk[0, 2]) == prompt_tokens // 64

    with start_server(tp_size=2, **config) as server:
        warm = server.generate(prompt, GREEDY)
        info = httpx.get(f"{server.url}/get_server_info", timeout=30).json()
    assert warm["text"] == cold["text"]
    assert warm["meta_info"]["cached_tokens_disk"] >= prompt_tokens - 64
    assert warm["meta_info"]["cached_tokens"] == warm["meta_info"]["cached_tokens_disk"]
    assert info["internal_states"][0]["hicache_shard_misses"] == 0

    with start_server(tp_size=1, **config) as server:  # another tp size: not its shards
        other = server.generate(prompt, GREEDY)
    assert other["meta_info"]["cached_tokens_disk"] == 0
    assert set(shards(tmp_path)) == {(0, 2), (1, 2), (0, 1)}
