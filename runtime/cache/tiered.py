"""DiskTier: the radix tree's second tier, a DiskStore of KV blocks (torch-free).

The tree holds what the pool holds; the disk holds blocks of `block_tokens` positions, each
keyed by a chained hash: key[i] = H(key[i-1] + tokens of block i), key[-1] = H(fingerprint).
A block's key thus names its whole prefix, and matching a prompt on disk is walking its keys
until the first block that is not there.

- Write: `write_back` writes a block when the pool evicts the last tree node it overlaps
  (and, at close, every block the tree still holds); `write_through` writes each block as
  soon as its KV is computed. Either way the block's KV is copied out of the pool at once
  (`KVPages.read`, before the page can be reused) and the file is written by the store's
  background thread.
- Prefetch: a request that starts waiting has the blocks past its pool match read and
  checked by the store's reader thread, so its admission mostly copies from memory.
- Load: `load` extends a pool match with the blocks that follow it on disk: fresh pool pages
  (evicting as usual), KV copied in (`KVPages.write`), inserted into the tree; the caller
  then matches again and sees them as an ordinary cached prefix.
- Tensor parallelism: `shards` (tier_shards.py) mirrors every save, prefetch and load on
  ranks 1..N-1, each into its own shard of the store; a load takes the blocks every rank holds.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from radixflow.runtime.cache.disk_store import DiskStore
from radixflow.runtime.cache.kv_pool import KVPool
from radixflow.runtime.cache.radix_cache import (
    NAMESPACE_SHIFT,
    Node,
    RadixCache,
    common_prefix_len,
)
from radixflow.runtime.cache.tier_shards import Shards

WRITE_POLICIES = ("write_through", "write_back")


class KVPages(Protocol):
    """The pool's KV rows as bytes: (num_tokens, bytes_per_token) uint8, token-major."""

    def read(self, slots: np.ndarray) -> np.ndarray: ...

    def write(self, slots: np.ndarray, rows: np.ndarray) -> None: ...


def chain_keys(fingerprint: bytes, tokens: np.ndarray, block_tokens: int) -> list[bytes]:
    """The key of each whole block of `tokens` (a partial last block has none)."""
    keys, key = [], hashlib.blake2b(fingerprint, digest_size=16).digest()
    tokens = np.asarray(tokens, dtype=np.int64)
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        block = tokens[start : start + block_tokens].tobytes()
        key = hashlib.blake2b(key + block, digest_size=16).digest()
        keys.append(key)
    return keys


def path_of(node: Node) -> tuple[np.ndarray, np.ndarray]:
    """The tokens and slots from the root to the end of `node`."""
    keys, values = [], []
    while node.parent is not None:
        keys.append(node.key)
        values.append(node.value)
        node = node.parent
    if not keys:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(keys[::-1]), np.concatenate(values[::-1])


def on_disk(key: np.ndarray) -> bool:
    """Whether KV of `key` may live on disk: the base model's only. A LoRA adapter's keys
    carry its id (radix_cache.NAMESPACE_SHIFT), which is not stable across restarts."""
    return not len(key) or not int(key[0]) >> NAMESPACE_SHIFT


def resident_len(tree: RadixCache, key: np.ndarray) -> int:
    """How much of `key` the tree holds (match_prefix without its split and LRU touch)."""
    node, matched = tree.root, 0
    while matched < len(key) and int(key[matched]) in node.children:
        child = node.children[int(key[matched])]
        n = common_prefix_len(child.key, key[matched:])
        matched += n
        if n < len(child.key):
            break
        node = child
    return matched


class DiskTier:
    def __init__(
        self,
        tree: RadixCache,
        pool: KVPool,
        store: DiskStore,
        pages: KVPages,
        write_policy: str,
        block_tokens: int,
    ) -> None:
        assert write_policy in WRITE_POLICIES, write_policy
        assert block_tokens % pool.page_size == 0, f"{block_tokens=} {pool.page_size=}"
        self.tree, self.pool, self.store, self.pages = tree, pool, store, pages
        self.write_policy, self.block_tokens = write_policy, block_tokens
        self.counters = {"hit_tokens": 0, "loads": 0, "load_seconds": 0.0, "shard_misses": 0}
        self.shards: Shards | None = None  # ranks 1..N-1 under --tp-size N (tier_shards.py)
        tree.on_evict = self._evicted

    def load(
        self, key: np.ndarray, prefix: np.ndarray, node: Node, take: Callable[[int], Any]
    ) -> int:
        """Load the blocks of `key` that follow its pool match (`prefix` slots, ending at
        `node`) from disk into pool pages taken with `take(count)` (None: no room), insert
        them into the tree; return the tokens added. `node` is locked meanwhile."""
        if not on_disk(key):
            return 0
        size, block = self.pool.page_size, self.block_tokens
        matched = len(prefix)
        first = matched // block
        if first >= len(key) // block:
            return 0
        start = time.perf_counter()
        keys = chain_keys(self.store.fingerprint, key, block)
        rows = []
        for i in range(first, len(keys)):
            payload = self.store.get(keys[i], key[i * block : (i + 1) * block])
            if payload is None:
                break
            rows.append(payload)
        if rows and self.shards is not None:
            rows = rows[: self._agree(keys[first : first + len(rows)], key, first)]
        if not rows:
            return 0
        end = (first + len(rows)) * block
        base = matched - matched % size  # own pages stay position-aligned (request_kv.py)
        self.tree.lock(node)
        try:
            pages = take(-(-(end - base) // size))
        finally:
            self.tree.unlock(node)
        if pages is None:
            if self.shards is not None:
                self.shards.write(np.zeros(0, np.int64), 0)  # they let go of the blocks
            return 0
        positions = np.arange(matched, end)
        slots = np.asarray(pages, np.int64)[(positions - base) // size] * size + positions % size
        self.pages.write(slots, np.concatenate(rows)[matched - first * block :])
        if self.shards is not None:
            self.shards.write(slots, matched - first * block)
        self.tree.insert(key[:end], np.concatenate([prefix, slots]))
        self.pool.decref(pages)  # the tree holds them now
        self.counters["hit_tokens"] += end - matched
        self.counters["loads"] += 1
        self.counters["load_seconds"] += time.perf_counter() - start
        return end - matched

    def _agree(self, keys: list[bytes], key: np.ndarray, first: int) -> int:
        """How many of the blocks `keys` (from block `first` of `key`) every rank holds; a
        block some other rank lacks is dropped here too, so that it is computed again and
        stored on every rank."""
        block = self.block_tokens
        tokens = key[first * block : (first + len(keys)) * block]
        assert self.shards is not None
        agreed = self.shards.agree(keys, tokens, len(keys))
        if agreed < len(keys):
            self.counters["shard_misses"] += 1
            self.store.discard(keys[agreed])
        return agreed

    def prefetch(self, key: np.ndarray) -> None:
        """Start reading the blocks of `key` past its pool match (a request that waits)."""
        block = self.block_tokens
        if not on_disk(key):
            return
        keys = chain_keys(self.store.fingerprint, key, block)
        first = resident_len(self.tree, key) // block
        found = first
        while found < len(keys) and self.store.contains(keys[found]):
            self.store.prefetch(keys[found], key[found * block : (found + 1) * block])
            found += 1
        if self.shards is not None and found > first:
            self.shards.prefetch(keys[first:found], key[first * block : found * block])

    def computed(self, key: np.ndarray, slots: np.ndarray, known: int) -> None:
        """Positions `known`..len(key) of `key` were just computed into `slots` (the tree's):
        with write_through, store the whole blocks they complete."""
        if self.write_policy == "write_through":
            self._store(key, slots, known)

    def close(self) -> None:
        """Store what only the pool holds (write_back), then wait for every write."""
        if self.write_policy == "write_back":
            for node in self.tree._nodes():
                if not node.children:
                    self._store(*path_of(node), 0)
        self.store.close()

    def stats(self) -> dict[str, Any]:
        store = {f"hicache_{k}": v for k, v in self.store.stats().items()}
        return {**store, **{f"hicache_{k}": v for k, v in self.counters.items()}}

    def _evicted(self, node: Node) -> None:
        """The pool is about to drop `node` (a leaf): store the blocks it overlaps."""
        key, slots = path_of(node)
        self._store(key, slots, len(key) - len(node.key))

    def _store(self, key: np.ndarray, slots: np.ndarray, known: int) -> None:
        """Copy out and queue every whole block of `key` that ends after `known` and is not
        stored yet."""
        block = self.block_tokens
        if not on_disk(key):
            return
        keys = chain_keys(self.store.fingerprint, key, block)
        saved = []
        for i in range(known // block, len(keys)):
            if self.store.contains(keys[i]):
                continue
            span = slice(i * block, (i + 1) * block)
            self.store.put(keys[i], key[span], self.pages.read(slots[span]))
            saved.append(i)
        if self.shards is not None and saved:  # the same blocks, from their own pools
            spans = np.concatenate([np.arange(i * block, (i + 1) * block) for i in saved])
            self.shards.save([keys[i] for i in saved], key[spans], slots[spans])
