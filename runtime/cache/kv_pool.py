"""KVPool: which KV slots are free, torch-free.

The pool hands out pages of `page_size` consecutive slots (slot = page * page_size + offset).
Page 0 is reserved: its slots are the dummy target of padded rows. A page is live while it has
at least one reference: each radix-tree node holding any of its slots is one reference, and a
request that allocated it holds one until it lets go. When the last reference goes, the page
is free again. Writers only write into pages they allocated themselves; a request that needs to
continue a page shared through the tree copies it first (copy on write).

Placement keeps each request's KV in a few runs of consecutive slots, so attention can read
views of the pool instead of gathering copies: `alloc_pages(count, after=page)` continues a
run right after `page` when those pages are free, and a new run is placed next-fit after a
cursor with `gap` free pages left behind it, so the request can grow into them. The gap is
not reserved: every free page stays allocatable, and a full pool hands out scattered pages.

A new run with a gap starts on a multiple of its footprint (count + gap, rounded up to a
power of two): requests admitted together with alike footprints then sit at one stride, and
the CPU decode reads the whole batch's keys as one strided view of the pool (a grid,
radixflow.kernels.cpu.grid) instead of gathering them. The pages skipped to align stay
free for anyone.
"""

from __future__ import annotations

import numpy as np

MAX_GAP_SLOTS = 1024  # room left after a new run for the slots its request will still write
SEARCH_WINDOW = 8192  # pages scanned past the cursor for a run before any free page will do


class KVPool:
    def __init__(self, num_slots: int, page_size: int) -> None:
        self.page_size = page_size
        self.num_pages = num_slots // page_size + 1  # + the reserved page 0
        self.num_slots = self.num_pages * page_size  # what the model must allocate
        self.refs = np.zeros(self.num_pages, dtype=np.int32)
        self.refs[0] = 1
        self._is_free = np.ones(self.num_pages, dtype=bool)
        self._is_free[0] = False
        self._num_free = self.num_pages - 1
        self._cursor = 1  # where the next new run is looked for

    @property
    def capacity_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return self._num_free

    @property
    def num_free_slots(self) -> int:
        return self._num_free * self.page_size

    def alloc_pages(self, count: int, after: int | None = None, gap: int = 0) -> list[int] | None:
        """Take `count` free pages with one reference each, or None (nothing taken).

        The pages continue the run ending at page `after` as far as those are free; the rest
        form a new run, placed where `gap` more free pages follow it when the pool has such a
        place near the cursor, else wherever pages are free (fragmented, never refused)."""
        if count > self._num_free:
            return None
        pages: list[int] = []
        if after is not None:
            end = min(after + 1 + count, self.num_pages)
            free = self._is_free[after + 1 : end]
            run = len(free) if free.all() else int(np.argmin(free))
            pages = list(range(after + 1, after + 1 + run))
            self._is_free[pages] = False
        if len(pages) < count:
            rest = self._new_run(count - len(pages), gap)
            self._is_free[rest] = False
            pages += rest
        self.refs[pages] = 1
        self._num_free -= count
        return pages

    def _new_run(self, count: int, gap: int) -> list[int]:
        """`count` free pages: consecutive with `gap` free pages after them if a window past
        the cursor has room, else consecutive, else the first free pages from the cursor."""
        for want in (count + gap, count) if gap else (count,):
            align = 1 << (want - 1).bit_length() if want > count else 1  # footprint: pow2
            first = self._find_run(want, align)
            if first >= 0:
                self._cursor = first + want if first + want < self.num_pages else 1
                return list(range(first, first + count))
        order = np.concatenate(
            [np.arange(self._cursor, self.num_pages), np.arange(1, self._cursor)]
        )
        picked = order[self._is_free[order]][:count]
        self._cursor = int(picked[-1]) + 1 if int(picked[-1]) + 1 < self.num_pages else 1
        return picked.tolist()

    def _find_run(self, length: int, align: int = 1) -> int:
        """First page, a multiple of `align`, of `length` free pages in a row within
        SEARCH_WINDOW pages from the cursor (wrapping to the start once), or -1."""
        for lo in (self._cursor, 1):
            hi = min(lo + max(SEARCH_WINDOW, 2 * length + align), self.num_pages)
            free = np.concatenate([[False], self._is_free[lo:hi], [False]]).astype(np.int8)
            edges = np.diff(free)
            begins = lo + np.flatnonzero(edges == 1)
            ends = lo + np.flatnonzero(edges == -1)
            starts = -(-begins // align) * align
            fits = np.flatnonzero(ends - starts >= length)
            if fits.size:
                return int(starts[fits[0]])
        return -1

    def incref(self, pages: np.ndarray | list[int]) -> None:
        self.refs[np.asarray(pages, dtype=np.int64)] += 1

    def decref(self, pages: np.ndarray | list[int]) -> None:
        """Drop one reference from each page (pages must be distinct); free the unreferenced."""
        pages = np.asarray(pages, dtype=np.int64)
        if pages.size == 0:
            return
        self.refs[pages] -= 1
        assert (self.refs[pages] >= 0).all(), f"page over-released: {pages[self.refs[pages] < 0]}"
        freed = pages[self.refs[pages] == 0]
        self._is_free[freed] = True
        self._num_free += len(freed)

    def pages_of(self, slots: np.ndarray) -> np.ndarray:
        """Distinct pages holding `slots`, in first-seen order."""
        pages = np.asarray(slots, dtype=np.int64) // self.page_size
        if self.page_size == 1:
            return pages
        _, first = np.unique(pages, return_index=True)
        return pages[np.sort(first)]

    def free_page_set(self) -> set[int]:
        return set(np.flatnonzero(self._is_free).tolist())


def run_hint(own_pages: list[int], future_slots: int, page_size: int) -> tuple[int | None, int]:
    """`alloc_pages`'s (after, gap) for a request's next pages: continue its last own page,
    and leave room behind a new run for the `future_slots` it will still write (capped)."""
    gap = -(-min(max(future_slots, 0), MAX_GAP_SLOTS) // page_size)
    return (own_pages[-1] if own_pages else None), gap
