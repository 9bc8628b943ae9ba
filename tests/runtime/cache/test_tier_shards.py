"""The disk tier's tensor-parallel shards without a model (runtime/cache/tier_shards.py): rank
0's tier and a rank 1 whose pool holds other KV heads (other bytes) in the same slots. Every
rank stores its own pages in its own shard; a restart loads each rank's own pages; a block one
rank lacks is loaded by none and stored again by all. The same over two real ranks and
SmolLM2 is tests/runtime/distributed/test_tp_hicache.py (slow)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_disk_store import FakePages, rows_for

from radixflow.runtime.cache.disk_store import DiskStore
from radixflow.runtime.cache.kv_pool import KVPool
from radixflow.runtime.cache.radix_cache import RadixCache
from radixflow.runtime.cache.tier_shards import ShardFollower, pack_keys, unpack_keys
from radixflow.runtime.cache.tiered import DiskTier, chain_keys

FP = [b"0" * 16, b"1" * 16]  # rank 0's and rank 1's fingerprints (they name the rank)
BLOCK = 4


def rank1_rows(tokens: np.ndarray) -> np.ndarray:
    """Rank 1's heads: other bytes for the same positions."""
    return rows_for(tokens) ^ np.uint8(0x5A)


class LocalShards:
    """Rank 0's `Shards` calling the followers directly (tier_ranks.TierRanks broadcasts)."""

    def __init__(self, followers: list[ShardFollower]) -> None:
        self.followers, self.commands = followers, []

    def save(self, keys, tokens, slots) -> None:
        self.commands.append("save")
        keys = unpack_keys(pack_keys(keys))  # as they travel
        for f in self.followers:
            f.save(keys, tokens, slots)

    def prefetch(self, keys, tokens) -> None:
        self.commands.append("prefetch")
        for f in self.followers:
            f.prefetch(keys, tokens)

    def agree(self, keys, tokens, have) -> int:
        self.commands.append("agree")
        agreed = min([have] + [f.probe(keys, tokens) for f in self.followers])
        for f in self.followers:
            f.keep(agreed)
        return agreed

    def write(self, slots, skip) -> None:
        self.commands.append("write")
        for f in self.followers:
            f.write(slots, skip)


def start(root: Path, policy: str) -> tuple[DiskTier, FakePages, FakePages, LocalShards]:
    """A start of a two-rank server: rank 0's tier, rank 1's shard, one slot numbering."""
    pool = KVPool(64, 1)
    pages0, pages1 = FakePages(pool.num_slots), FakePages(pool.num_slots)
    tier = DiskTier(
        RadixCache(pool), pool, DiskStore(root, FP[0], 1 << 30, {"rank": 0}), pages0, policy, BLOCK
    )
    shards = LocalShards(
        [ShardFollower(DiskStore(root, FP[1], 1 << 30, {"rank": 1}), pages1, BLOCK)]
    )
    tier.shards = shards
    return tier, pages0, pages1, shards


def compute(tier: DiskTier, pages0: FakePages, pages1: FakePages, tokens: np.ndarray) -> None:
    """A forward on both ranks (each its own heads), the tree adopting the slots."""
    got = tier.pool.alloc_pages(len(tokens))
    slots = np.asarray(got, np.int64)
    pages0.write(slots, rows_for(tokens))
    pages1.write(slots, rank1_rows(tokens))
    tier.tree.insert(tokens, slots)
    tier.computed(tokens, slots, 0)
    tier.pool.decref(got)


def close(tier: DiskTier, shards: LocalShards) -> None:
    tier.close()
    for f in shards.followers:
        f.close()


def load_all(tier: DiskTier, tokens: np.ndarray) -> tuple[int, np.ndarray]:
    prefix, node = tier.tree.match_prefix(tokens)
    loaded = tier.load(tokens, prefix, node, tier.pool.alloc_pages)
    slots, _ = tier.tree.match_prefix(tokens)
    return loaded, slots


def shard_files(root: Path, rank: int) -> list[Path]:
    return sorted((root / FP[rank].hex()).rglob("*.kv"))


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_each_rank_stores_and_loads_its_own_pages(tmp_path: Path, policy: str) -> None:
    tier, pages0, pages1, shards = start(tmp_path, policy)
    tokens = np.arange(50, 50 + 3 * BLOCK + 2)  # 3 whole blocks and a tail
    compute(tier, pages0, pages1, tokens)
    if policy == "write_back":
        assert tier.tree.evict(1000) == len(tokens)  # the pool forgets it: both ranks store
    close(tier, shards)  # (write_back at close would store it too)
    assert len(shard_files(tmp_path, 0)) == len(shard_files(tmp_path, 1)) == 3
    # same names (rank 0's keys), other bytes (each rank's heads)
    assert [p.name for p in shard_files(tmp_path, 0)] == [p.name for p in shard_files(tmp_path, 1)]
    assert shard_files(tmp_path, 0)[0].read_bytes() != shard_files(tmp_path, 1)[0].read_bytes()

    tier, pages0, pages1, shards = start(tmp_path, policy)  # a restart, same tp size
    tier.prefetch(tokens)
    loaded, slots = load_all(tier, tokens)
    assert loaded == 3 * BLOCK and len(slots) == 3 * BLOCK
    assert np.array_equal(pages0.data[slots], rows_for(tokens[:loaded]))
    assert np.array_equal(pages1.data[slots], rank1_rows(tokens[:loaded]))
    assert shards.commands == ["prefetch", "agree", "write"]
    close(tier, shards)


def test_a_block_one_rank_lacks_is_loaded_by_none_and_stored_again(tmp_path: Path) -> None:
    tier, pages0, pages1, shards = start(tmp_path, "write_through")
    tokens = np.arange(9, 9 + 3 * BLOCK)
    compute(tier, pages0, pages1, tokens)
    close(tier, shards)
    second = chain_keys(FP[0], tokens, BLOCK)[1].hex()
    (rank1_second,) = [p for p in shard_files(tmp_path, 1) if p.stem == second]
    rank1_second.write_bytes(rank1_second.read_bytes()[:-1])  # torn on rank 1 only

    tier, pages0, pages1, shards = start(tmp_path, "write_through")
    loaded, slots = load_all(tier, tokens)
    assert loaded == BLOCK  # block 0: the one both ranks hold
    assert np.array_equal(pages1.data[slots], rank1_rows(tokens[:BLOCK]))
    assert tier.stats()["hicache_shard_misses"] == 1
    assert second not in {p.stem for p in shard_files(tmp_path, 0)}  # rank 0 dropped its copy
    assert second not in {p.stem for p in shard_files(tmp_path, 1)}  # rank 1's failed its check
    # the rest is computed again (the request's prefill) and stored on both ranks
    rest = tier.pool.alloc_pages(len(tokens) - BLOCK)
    full = np.concatenate([slots, np.asarray(rest, np.int64)])
    pages0.write(full[BLOCK:], rows_for(tokens)[BLOCK:])
    pages1.write(full[BLOCK:], rank1_rows(tokens)[BLOCK:])
    tier.tree.insert(tokens, full)
    tier.computed(tokens, full, BLOCK)
    tier.pool.decref(rest)
    close(tier, shards)

    tier, pages0, pages1, shards = start(tmp_path, "write_through")
    loaded, slots = load_all(tier, tokens)
    assert loaded == len(tokens)
    assert np.array_equal(pages1.data[slots], rank1_rows(tokens))
    close(tier, shards)


def test_no_room_in_the_pool_lets_every_rank_drop_its_blocks(tmp_path: Path) -> None:
    tier, pages0, pages1, shards = start(tmp_path, "write_through")
    tokens = np.arange(200, 200 + 2 * BLOCK)
    compute(tier, pages0, pages1, tokens)
    close(tier, shards)
    tier, pages0, pages1, shards = start(tmp_path, "write_through")
    prefix, node = tier.tree.match_prefix(tokens)
    assert tier.load(tokens, prefix, node, lambda count: None) == 0
    assert shards.commands == ["agree", "write"]  # the write with no slots: they let go
    assert shards.followers[0]._held == []
    close(tier, shards)
