"""The disk tier under tensor parallelism (runtime/cache/tier_shards.py,
runtime/distributed/tier_ranks.py):

- two gloo ranks without a model (rank 1 a subprocess with a pool of bytes): rank 0's tier
  sends its saves, prefetches and loads with the plan broadcast; rank 1 stores its own pages in
  its own shard and loads them into the slots rank 0 chose;
- (slow) SmolLM2 with two ranks on loopback: a server restarted (SIGTERM) with the same tp
  size loads every rank's shard, one with another tp size reads none.

The shard logic without ranks: tests/runtime/cache/test_tier_shards.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from conftest import die_with_parent, start_server
from radixflow.runtime.cache.disk_store import DiskStore
from radixflow.runtime.cache.kv_pool import KVPool
from radixflow.runtime.cache.radix_cache import RadixCache
from radixflow.runtime.cache.tiered import DiskTier

GREEDY = {"max_new_tokens": 12, "temperature": 0}
ROW, BLOCK, SLOTS = 8, 4, 64
RANK1 = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import numpy as np
    import torch
    from radixflow.runtime.cache.disk_store import DiskStore
    from radixflow.runtime.cache.tier_shards import ShardFollower
    from radixflow.runtime.distributed.tensor_parallel import TensorParallel
    from radixflow.runtime.distributed.tier_ranks import follow

    class Pages:  # rank 1's pool: each slot's row starts as its own bytes (other KV heads)
        data = ((np.arange(64)[:, None] * 3 + np.arange(8)) % 251).astype(np.uint8)
        def read(self, slots): return self.data[slots].copy()
        def write(self, slots, rows): self.data[slots] = rows

    addr, root = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    tp = TensorParallel.join(1, 2, addr, 30.0, torch.device("cpu"))
    pages = Pages()
    shard = ShardFollower(DiskStore(root, b"1" * 16, 1 << 30, {"tp_rank": 1}), pages, 4)
    follow(tp, shard)
    assert tp.recv_plan() is None  # no step: the tier's commands, then the stop
    shard.close()
    tp.close(stop=False)
    np.save(root / "rank1.npy", pages.data)
    """
)


class RankZeroPages:
    def __init__(self) -> None:
        self.data = np.zeros((SLOTS, ROW), dtype=np.uint8)

    def read(self, slots: np.ndarray) -> np.ndarray:
        return self.data[slots].copy()

    def write(self, slots: np.ndarray, rows: np.ndarray) -> None:
        self.data[slots] = rows


def test_rank0_drives_rank1s_shard_through_the_plan_broadcast(tmp_path: Path) -> None:
    from radixflow.runtime.distributed.tensor_parallel import TensorParallel
    from radixflow.runtime.distributed.tier_ranks import TierRanks

    listener = socket.create_server(("127.0.0.1", 0))
    addr = f"127.0.0.1:{listener.getsockname()[1]}"
    rank1 = subprocess.Popen(
        [sys.executable, "-c", RANK1, addr, str(tmp_path)], preexec_fn=die_with_parent()
    )
    try:
        tp = TensorParallel.join(0, 2, addr, 30.0, torch.device("cpu"), listener.detach())
        pool, pages = KVPool(SLOTS, 1), RankZeroPages()
        store = DiskStore(tmp_path, b"0" * 16, 1 << 30, {"tp_rank": 0})
        tier = DiskTier(RadixCache(pool), pool, store, pages, "write_back", BLOCK)
        tier.shards = TierRanks(tp)
        tokens = np.arange(30, 30 + 2 * BLOCK + 1)
        first = np.asarray(pool.alloc_pages(len(tokens)), np.int64)  # the "forward's" slots
        pages.write(first, np.full((len(tokens), ROW), 7, np.uint8))
        tier.tree.insert(tokens, first)
        pool.decref(first.tolist())
        assert tier.tree.evict(SLOTS) == len(tokens)  # write-back on both ranks
        tier.prefetch(tokens)
        prefix, node = tier.tree.match_prefix(tokens)
        assert tier.load(tokens, prefix, node, pool.alloc_pages) == 2 * BLOCK
        loaded, _ = tier.tree.match_prefix(tokens)
        assert not set(loaded.tolist()) & set(first.tolist())  # new slots
        tier.close()
        tp.close()  # the stop
        assert rank1.wait(60) == 0
    finally:
        if rank1.poll() is None:
            rank1.kill()
    rank1_pages = np.load(tmp_path / "rank1.npy")
    original = (first[: 2 * BLOCK, None] * 3 + np.arange(ROW)) % 251
    assert np.array_equal(rank1_pages[loaded], original)  # its own rows, in rank 0's slots
    names = [
        sorted(p.name for p in (tmp_path / fp.hex()).rglob("*.kv")) for fp in (b"0" * 16, b"1" * 16)
    ]
    assert names[0] == names[1] and len(names[0]) == 2


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
