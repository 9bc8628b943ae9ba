"""The KV a request holds: its slot table over pool pages and the radix tree's lock on its
cached prefix. The scheduler decides who runs; this allocates, grows, shares with the tree
and gives back, keeping the pool's invariants (DESIGN.md §5)."""

from __future__ import annotations

from typing import Any

import numpy as np

from radixflow.runtime.cache.kv_pool import KVPool, run_hint
from radixflow.runtime.cache.radix_cache import RadixCache
from radixflow.runtime.cache.tiered import DiskTier
from radixflow.runtime.protocol.plan import I64
from radixflow.runtime.scheduler.request import Req
from radixflow.runtime.scheduler.stats import SchedulerStats

# A cached prefix this short is copied into the request's own run: one contiguous run per
# request decodes faster (kernels/cpu/grid.py) than a few keys read from elsewhere.
COPY_PREFIX_BELOW = 16


class RequestKV:
    """Slots for requests, from `pool` (evicting from `tree` when short) and the tree."""

    def __init__(
        self, pool: KVPool, tree: RadixCache, metrics: SchedulerStats, tiers: DiskTier | None = None
    ) -> None:
        self.pool, self.tree, self.metrics = pool, tree, metrics
        self.tiers = tiers  # the disk tier under the tree (runtime/cache/tiered.py), or None

    def match(self, req: Req) -> tuple[np.ndarray, Any]:
        """`req`'s longest cached prefix (slots, node): the pool's, extended by the blocks
        that follow it on disk (loaded into the pool and the tree here)."""
        key = req.cache_key(req.max_prefix_len)
        prefix, node = self.tree.match_prefix(key)
        if self.tiers is None or self.tree.disabled:
            return prefix, node
        loaded = self.tiers.load(key, prefix, node, self._take_pages)
        if not loaded:
            return prefix, node
        if req.cached_tokens < 0:  # counted at first admission, as cached_tokens
            req.cached_tokens_disk += loaded
        return self.tree.match_prefix(key)

    def prefetch(self, req: Req) -> None:
        """A request starts waiting: the disk tier reads its blocks meanwhile."""
        if self.tiers is not None and not self.tree.disabled:
            self.tiers.prefetch(req.cache_key(req.max_prefix_len))

    def _take_pages(self, count: int) -> list[int] | None:
        short = count - self.pool.num_free_pages
        if short > 0:
            self.metrics.evicted(self.tree.evict(short * self.pool.page_size))
        return self.pool.alloc_pages(count)

    def start(self, req: Req, prefix: np.ndarray, node: Any, chunk: int) -> bool:
        """Give a waiting request its cached prefix (lock already held) and `chunk` new slots."""
        size = self.pool.page_size
        req.slots = np.zeros(0, dtype=I64)
        req.set_slots(0, prefix)
        req.kv_len = req.prefix_len = len(prefix)
        req.last_node, req.own_pages = node, []
        req.copy_src = req.copy_dst = None
        req.input_logprobs_done = req.input_logprobs_done or not req.wants_input_logprobs
        # Copied, never written into: a match's tail inside a tree page, or a short match whole
        shared_tail = len(prefix) if len(prefix) < COPY_PREFIX_BELOW else len(prefix) % size
        if shared_tail:
            start, count = len(prefix) - shared_tail, -(-shared_tail // size)
            future = req.seq_len + req.remaining_new_tokens() - start - count * size
            pages = self.alloc_pages(count, req, future)
            if pages is None:
                return False
            req.own_pages = pages
            dst = (np.array(pages, dtype=I64)[:, None] * size + np.arange(size)).ravel()
            req.copy_src, req.copy_dst = prefix[start:].copy(), dst[:shared_tail]
            req.set_slots(start, req.copy_dst)
        if not self.grow(req, chunk):
            self.pool.decref(req.own_pages)
            req.own_pages, req.copy_src = [], None
            return False
        return True

    def grow(self, req: Req, count: int) -> bool:
        """Allocate slots for positions kv_len .. kv_len+count-1 (evicting if needed).

        Own pages are position-aligned: position p sits at offset p % page_size, so the tail
        page (own_pages[-1]) continues wherever kv_len is not on a page boundary."""
        size = self.pool.page_size
        start = req.kv_len
        offset = start % size
        in_tail = min(size - offset, count) if offset else 0
        future = req.seq_len + req.remaining_new_tokens() - start - count
        pages = self.alloc_pages(-(-(count - in_tail) // size), req, future)
        if pages is None:
            return False
        parts = []
        if in_tail:
            assert req.own_pages, f"{req.rid}: kv_len {start} mid-page without a tail page"
            parts.append(req.own_pages[-1] * size + np.arange(offset, offset + in_tail, dtype=I64))
        parts += [page * size + np.arange(size, dtype=I64) for page in pages]
        req.set_slots(start, np.concatenate(parts)[:count] if parts else np.zeros(0, I64))
        req.own_pages.extend(pages)
        req.extend_target = start + count
        return True

    def alloc_pages(self, count: int, req: Req, future: int) -> list[int] | None:
        # continuing req's run, with room for `future` more slots behind a new run (run_hint)
        if count == 0:
            return []
        short = count - self.pool.num_free_pages
        if short > 0:
            self.metrics.evicted(self.tree.evict(short * self.pool.page_size))
        return self.pool.alloc_pages(count, *run_hint(req.own_pages, future, self.pool.page_size))

    def alloc_decode_slot(self, req: Req) -> int:
        """The slot for position kv_len: in its own last page, or a new one (one is free)."""
        size = self.pool.page_size
        if req.kv_len % size:
            slot = req.own_pages[-1] * size + req.kv_len % size
        else:
            hint = run_hint(req.own_pages, req.remaining_new_tokens(), size)
            pages = self.pool.alloc_pages(1, *hint)
            assert pages is not None, f"no page for decode: free={self.pool.num_free_pages}"
            req.own_pages.extend(pages)
            slot = pages[0] * size
        req.set_slots(req.kv_len, np.array([slot], dtype=I64))
        return slot

    def cache_computed(self, req: Req) -> None:
        """Insert the computed prefix into the tree, adopt the tree's slots, move the lock."""
        if self.tree.disabled:
            return
        keys = req.cache_key(req.kv_len)
        present = self.tree.insert(keys, req.slots[: req.kv_len])
        slots, node = self.tree.match_prefix(keys)
        assert len(slots) == req.kv_len, f"{len(slots)=} {req.kv_len=}"
        if self.tiers is not None:
            self.tiers.computed(keys, slots, req.prefix_len)
        # someone else's duplicates: adopt the tree's slots, but a short head keeps its own
        if req.prefix_len < present and present >= COPY_PREFIX_BELOW:
            req.set_slots(req.prefix_len, slots[req.prefix_len : present])
        self.tree.lock(node)
        self.tree.unlock(req.last_node)
        req.last_node, req.prefix_len = node, req.kv_len
        self.drop_unused_pages(req)

    def drop_unused_pages(self, req: Req) -> None:
        """Release own pages the slot table no longer points into."""
        if not req.own_pages:
            return
        in_use = set((req.slots[: req.kv_len] // self.pool.page_size).tolist())
        if req.kv_len % self.pool.page_size:  # the tail page the next token is written into
            in_use.add(req.own_pages[-1])
        unused = [p for p in req.own_pages if p not in in_use]
        if unused:
            req.own_pages = [p for p in req.own_pages if p in in_use]
            self.pool.decref(unused)

    def release(self, req: Req, keep_in_tree: bool) -> None:
        """Give back everything `req` holds; its computed KV stays in the tree (evictable)."""
        if req.last_node is None and not req.own_pages:
            return
        if keep_in_tree and not self.tree.disabled and req.kv_len > req.prefix_len:
            keys = req.cache_key(req.kv_len)
            self.tree.insert(keys, req.slots[: req.kv_len])
            if self.tiers is not None:
                self.tiers.computed(keys, req.slots[: req.kv_len], req.prefix_len)
        if req.last_node is not None:
            self.tree.unlock(req.last_node)
        self.pool.decref(req.own_pages)
        req.own_pages, req.last_node = [], None
        req.slots = np.zeros(0, dtype=I64)
        req.kv_len = req.prefix_len = 0
