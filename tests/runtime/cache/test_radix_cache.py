"""Model-based tests of RadixCache + KVPool: random operation sequences against a dict model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixflow.runtime.cache.kv_pool import KVPool
from radixflow.runtime.cache.radix_cache import RadixCache

TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=12)  # small alphabet: many shares


class TreeMachine(RuleBasedStateMachine):
    """The model: `slots[prefix]` = slot of the prefix's last token, for every cached prefix.

    Tree slots never move once inserted (a later duplicate insert keeps the first), so every
    match must return exactly the model's slots; locked prefixes must survive any eviction.
    """

    page_size = 1

    def __init__(self) -> None:
        super().__init__()
        self.pool = KVPool(64 * self.page_size, self.page_size)
        self.tree = RadixCache(self.pool)
        self.slots: dict[tuple[int, ...], int] = {}
        self.locks: list[tuple[tuple[int, ...], object]] = []

    def _alloc(self, n: int) -> tuple[np.ndarray, list[int]] | None:
        pages = self.pool.alloc_pages(-(-n // self.page_size))
        if pages is None:
            return None
        slots = np.concatenate([p * self.page_size + np.arange(self.page_size) for p in pages])
        return slots[:n].astype(np.int64), pages

    @rule(key=TOKENS)
    def insert(self, key: list[int]) -> None:
        got = self._alloc(len(key))
        if got is None:
            self.tree.evict(len(key) * self.page_size)
            self._forget_evicted()
            got = self._alloc(len(key))
            if got is None:
                return
        values, pages = got
        arr = np.array(key, dtype=np.int64)
        present = self.tree.insert(arr, values)
        expected_present = max(
            (n for n in range(len(key) + 1) if tuple(key[:n]) in self.slots or n == 0), default=0
        )
        assert present == expected_present
        for n in range(present + 1, len(key) + 1):
            self.slots[tuple(key[:n])] = int(values[n - 1])
        self.pool.decref(pages)  # the "request" lets go; the tree keeps what it adopted

    @rule(key=TOKENS)
    def match(self, key: list[int]) -> None:
        slots, node = self.tree.match_prefix(np.array(key, dtype=np.int64))
        n = len(slots)
        assert tuple(key[:n]) in self.slots or n == 0
        assert n == len(key) or tuple(key[: n + 1]) not in self.slots
        assert [self.slots[tuple(key[: i + 1])] for i in range(n)] == slots.tolist()

    @rule(key=TOKENS)
    def lock(self, key: list[int]) -> None:
        slots, node = self.tree.match_prefix(np.array(key, dtype=np.int64))
        if len(slots):
            self.tree.lock(node)
            self.locks.append((tuple(key[: len(slots)]), node))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i: int) -> None:
        _, node = self.locks.pop(i % len(self.locks))
        self.tree.unlock(node)

    @rule(n=st.integers(1, 40))
    def evict(self, n: int) -> None:
        before = self.tree.evictable_size
        evicted = self.tree.evict(n)
        assert evicted >= min(n, before) or self.tree.evictable_size == 0
        assert self.tree.evictable_size == before - evicted
        self._forget_evicted()

    def _forget_evicted(self) -> None:
        """Drop evicted prefixes from the model: keep those still matchable in full."""
        for prefix in sorted(self.slots, key=len):
            if prefix[:-1] and prefix[:-1] not in self.slots:
                del self.slots[prefix]
                continue
            slots, _ = self.tree.match_prefix(np.array(prefix, dtype=np.int64))
            if len(slots) < len(prefix):
                del self.slots[prefix]
        for prefix, _ in self.locks:
            assert prefix in self.slots, "a locked prefix was evicted"

    @precondition(lambda self: not self.locks)
    @rule()
    def flush(self) -> None:
        assert self.tree.flush()
        self.slots.clear()
        assert self.tree.total_size == 0
        assert self.pool.num_free_pages == self.pool.capacity_pages

    @invariant()
    def consistent(self) -> None:
        refs = self.tree.check()
        refs[0] += 1
        assert (refs == self.pool.refs).all()
        assert self.tree.total_size == len(self.slots)
        free = self.pool.free_page_set()
        assert all(self.pool.refs[p] == 0 for p in free)
        assert (self.pool.refs[1:] == 0).sum() == len(free)


class PagedTreeMachine(TreeMachine):
    page_size = 4


TestTree = TreeMachine.TestCase
TestTree.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestPagedTree = PagedTreeMachine.TestCase
TestPagedTree.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


def test_split_keeps_locks_and_counters() -> None:
    pool = KVPool(32, 1)
    tree = RadixCache(pool)
    pages = pool.alloc_pages(6)
    tree.insert(np.arange(6), np.array(pages, dtype=np.int64))
    pool.decref(pages)
    _, node = tree.match_prefix(np.arange(6))
    tree.lock(node)
    slots, mid = tree.match_prefix(np.array([0, 1, 2, 9]))  # splits the locked edge
    assert len(slots) == 3 and mid.lock_ref == 1
    assert tree.protected_size == 6 and tree.evictable_size == 0
    assert tree.evict(10) == 0
    tree.unlock(node)
    assert tree.evictable_size == 6
    tree.check()


def test_disabled_cache_matches_nothing() -> None:
    pool = KVPool(16, 1)
    tree = RadixCache(pool, disabled=True)
    assert tree.insert(np.arange(3), np.arange(1, 4)) == 0
    slots, node = tree.match_prefix(np.arange(3))
    assert len(slots) == 0 and node is tree.root


@pytest.mark.parametrize("page_size", [1, 4])
def test_paged_split_shares_page_reference(page_size: int) -> None:
    pool = KVPool(32, page_size)
    tree = RadixCache(pool)
    pages = pool.alloc_pages(-(-6 // page_size))
    slots = np.concatenate([p * page_size + np.arange(page_size) for p in pages])[:6]
    tree.insert(np.arange(6), slots)
    pool.decref(pages)
    tree.match_prefix(np.array([0, 1, 7]))  # split after 2 tokens, inside the first page
    refs = tree.check()
    refs[0] += 1
    assert (refs == pool.refs).all()
    assert tree.evict(100) == 6
    assert pool.num_free_pages == pool.capacity_pages
