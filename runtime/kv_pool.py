"""KVPool: which KV slots are free, torch-free.

The pool hands out pages of `page_size` consecutive slots (slot = page * page_size + offset).
Page 0 is reserved: its slots are the dummy target of padded rows. A page is live while it has
at least one reference: each radix-tree node holding any of its slots is one reference, and a
request that allocated it holds one until it lets go. When the last reference goes, the page
is free again. Writers only write into pages they allocated themselves; a request that needs to
continue a page shared through the tree copies it first (copy on write).
"""

from __future__ import annotations

from collections import deque

import numpy as np


class KVPool:
    def __init__(self, num_slots: int, page_size: int) -> None:
        self.page_size = page_size
        self.num_pages = num_slots // page_size + 1  # + the reserved page 0
        self.num_slots = self.num_pages * page_size  # what the model must allocate
        self.refs = np.zeros(self.num_pages, dtype=np.int32)
        self.refs[0] = 1
        self._free: deque[int] = deque(range(1, self.num_pages))

    @property
    def capacity_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_free_slots(self) -> int:
        return len(self._free) * self.page_size

    def alloc_pages(self, count: int) -> list[int] | None:
        """Take `count` free pages with one reference each, or None (nothing taken)."""
        if count > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(count)]
        self.refs[pages] = 1
        return pages

    def incref(self, pages: np.ndarray | list[int]) -> None:
        self.refs[np.asarray(pages, dtype=np.int64)] += 1

    def decref(self, pages: np.ndarray | list[int]) -> None:
        """Drop one reference from each page (pages must be distinct); free the unreferenced."""
        pages = np.asarray(pages, dtype=np.int64)
        if pages.size == 0:
            return
        self.refs[pages] -= 1
        assert (self.refs[pages] >= 0).all(), f"page over-released: {pages[self.refs[pages] < 0]}"
        self._free.extend(int(p) for p in pages[self.refs[pages] == 0])

    def pages_of(self, slots: np.ndarray) -> np.ndarray:
        """Distinct pages holding `slots`, in first-seen order."""
        pages = np.asarray(slots, dtype=np.int64) // self.page_size
        if self.page_size == 1:
            return pages
        _, first = np.unique(pages, return_index=True)
        return pages[np.sort(first)]

    def free_page_set(self) -> set[int]:
        return set(self._free)
