"""RadixCache: a radix tree from token sequences to the KV slots that hold them (torch-free).

Each edge holds a run of token ids (`key`) and the slot of each (`value`). Matching splits an
edge when a match ends inside it, so the matched prefix always ends on a node boundary and
locking that node protects exactly the matched tokens. A lock walks to the root; a locked node
is never evicted. Accounting: `evictable_size + protected_size` is the number of tokens in the
tree, protected meaning "on a path some request has locked".

A lower tier (tiered.py) sees every leaf before it is deleted (`on_evict`).

Keys may carry a namespace above the token id (NAMESPACE_SHIFT): one tree, disjoint per
namespace.

Pages: every node holds one pool reference on each distinct page its slots live in, so a page
split between two nodes stays live until both are gone.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

import numpy as np

from radixflow.runtime.cache.kv_pool import KVPool

EMPTY = np.zeros(0, dtype=np.int64)
# Keys are token ids moved into a namespace: id + (namespace << NAMESPACE_SHIFT). A LoRA
# adapter's requests key under its own (scheduler/request.py `cache_key`), so no match ever
# crosses from one adapter's KV to another's; namespace 0 is the base model's plain ids.
NAMESPACE_SHIFT = 48  # image keys (server/images.py: up to vocab + 2**40) stay in namespace 0
TOKEN_MASK = (1 << NAMESPACE_SHIFT) - 1


class Node:
    __slots__ = ("key", "value", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: np.ndarray, value: np.ndarray, parent: Node | None) -> None:
        self.key = key
        self.value = value
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class RadixCache:
    def __init__(self, pool: KVPool, disabled: bool = False) -> None:
        self.pool = pool
        self.disabled = disabled
        self._clock = itertools.count(1)
        self.root = Node(EMPTY, EMPTY, None)
        self.root.lock_ref = 1  # the root is never evicted
        self.evictable_size = 0
        self.protected_size = 0
        self.on_evict: Callable[[Node], None] | None = None  # a lower tier's write-back

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def match_prefix(self, key: np.ndarray) -> tuple[np.ndarray, Node]:
        """Longest cached prefix of `key`: (its slots, the node it ends on). Splits an edge
        when the match ends inside it. Touches the path for LRU."""
        if self.disabled or len(key) == 0:
            return EMPTY, self.root
        node, values, now = self.root, [], next(self._clock)
        node.last_access = now
        while len(key) and int(key[0]) in node.children:
            child = node.children[int(key[0])]
            child.last_access = now
            n = common_prefix_len(child.key, key)
            split = n < len(child.key)
            if split:
                child = self._split(child, n)
            values.append(child.value)
            node, key = child, key[n:]
            if split:
                break
        return (np.concatenate(values) if values else EMPTY), node

    def insert(self, key: np.ndarray, value: np.ndarray) -> int:
        """Insert `key` -> `value` (slots); return how many leading tokens were already cached.

        The caller still owns `value[:returned]` (duplicates of the tree's own slots); the
        tree takes a page reference for every slot it adopts.
        """
        assert len(key) == len(value), f"{len(key)=} {len(value)=}"
        if self.disabled:
            return 0
        node, matched, now = self.root, 0, next(self._clock)
        while matched < len(key):
            child = node.children.get(int(key[matched]))
            if child is None:
                leaf = Node(key[matched:].copy(), value[matched:].copy(), node)
                leaf.last_access = now
                node.children[int(key[matched])] = leaf
                self.pool.incref(self.pool.pages_of(leaf.value))
                self.evictable_size += len(leaf.key)
                break
            child.last_access = now
            n = common_prefix_len(child.key, key[matched:])
            if n < len(child.key):
                child = self._split(child, n)
            node, matched = child, matched + n
        return min(matched, len(key))

    def lock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "unlock of an unlocked node"
            if node.lock_ref == 1:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node.lock_ref -= 1
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Evict unlocked leaves, least recently used first, until `num_tokens` tokens are
        gone or none are left; return the number evicted."""
        heap = [(n.last_access, id(n), n) for n in self._nodes() if self._evictable_leaf(n)]
        heapq.heapify(heap)
        evicted = 0
        while heap and evicted < num_tokens:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self._delete_leaf(node)
            evicted += len(node.key)
            if self._evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return evicted

    def flush(self) -> bool:
        """Drop every node; refused (False) while any request holds a lock."""
        if self.protected_size:
            return False
        self.evict(self.total_size)
        return True

    def check(self) -> np.ndarray:
        """Verify the tree's invariants; return the page references the tree holds."""
        refs = np.zeros(self.pool.num_pages, dtype=np.int64)
        evictable = protected = 0
        seen_slots: list[np.ndarray] = []
        for node in self._nodes():
            parent = node.parent
            assert len(node.key) == len(node.value) > 0, "empty or ragged node"
            assert parent.children.get(int(node.key[0])) is node, "child under the wrong key"
            assert parent is self.root or parent.lock_ref >= node.lock_ref, "lock(parent)<child"
            if node.lock_ref > 0:
                protected += len(node.key)
            else:
                evictable += len(node.key)
            refs[self.pool.pages_of(node.value)] += 1
            seen_slots.append(node.value)
        assert (evictable, protected) == (self.evictable_size, self.protected_size), (
            f"{evictable=} {protected=} {self.evictable_size=} {self.protected_size=}"
        )
        if seen_slots:
            slots = np.concatenate(seen_slots)
            assert len(np.unique(slots)) == len(slots), "a slot is owned twice in the tree"
        return refs

    def _split(self, child: Node, n: int) -> Node:
        """Cut `child`'s edge after n tokens; return the new upper node."""
        assert 0 < n < len(child.key), f"{n=} {len(child.key)=}"
        mid = Node(child.key[:n], child.value[:n], child.parent)
        mid.lock_ref, mid.last_access = child.lock_ref, child.last_access
        mid.children = {int(child.key[n]): child}
        child.parent.children[int(child.key[0])] = mid
        child.key, child.value, child.parent = child.key[n:], child.value[n:], mid
        if self.pool.page_size > 1:  # a page on both sides of the cut gains a reference
            shared = np.intersect1d(self.pool.pages_of(mid.value), self.pool.pages_of(child.value))
            self.pool.incref(shared)
        return mid

    def _evictable_leaf(self, node: Node) -> bool:
        return node is not self.root and not node.children and node.lock_ref == 0

    def _delete_leaf(self, node: Node) -> None:
        if self.on_evict is not None:  # while its pages still hold its KV
            self.on_evict(node)
        del node.parent.children[int(node.key[0])]
        self.evictable_size -= len(node.key)
        self.pool.decref(self.pool.pages_of(node.value))

    def _nodes(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
