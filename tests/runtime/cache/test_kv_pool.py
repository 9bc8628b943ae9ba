"""KV page placement: each request's slots form a few runs of consecutive slots (what lets
the CPU decode read views of the pool), without ever refusing a page that is free."""

from __future__ import annotations

import random

import numpy as np
import pytest

from radixflow.runtime.cache.kv_pool import KVPool, run_hint


def test_a_request_grows_its_run_into_the_gap_left_after_it() -> None:
    pool = KVPool(num_slots=1000, page_size=1)
    a = pool.alloc_pages(20, *run_hint([], future_slots=50, page_size=1))
    b = pool.alloc_pages(20, *run_hint([], future_slots=50, page_size=1))
    assert a == list(range(a[0], a[0] + 20)) and b == list(range(b[0], b[0] + 20))
    assert b[0] >= a[-1] + 1 + 50  # b was placed behind a's gap
    for _ in range(50):  # a decodes one page at a time, right after its last page
        a += pool.alloc_pages(1, *run_hint(a, future_slots=10, page_size=1))
    assert a == list(range(a[0], a[0] + 70))
    while a[-1] + 1 < b[0]:  # the alignment slack before b is free for a too
        a += pool.alloc_pages(1, *run_hint(a, future_slots=0, page_size=1))
    assert a == list(range(a[0], b[0]))
    c = pool.alloc_pages(1, *run_hint(a, 0, 1))  # a's room is used up: b's run is in the way
    assert c[0] not in b and c[0] != a[-1] + 1


@pytest.mark.parametrize("page_size", [1, 16])
def test_runs_admitted_together_sit_at_one_stride(page_size: int) -> None:
    """New runs with a gap start on multiples of their power-of-two footprint, so a batch
    of alike requests lands at one stride (the CPU decode's grid view); a run without a gap
    is not aligned."""
    pool = KVPool(num_slots=64 * 1024, page_size=page_size)
    plain = pool.alloc_pages(3)
    starts = []
    for prompt in (9, 17, 30, 25, 12):  # tokens; 128 more to come each
        pages = -(-prompt // page_size)
        got = pool.alloc_pages(pages, *run_hint([], 128, page_size))
        assert got == list(range(got[0], got[0] + pages))
        starts.append(got[0] * page_size)
    assert plain == [1, 2, 3]
    strides = np.diff(starts)
    assert (strides == strides[0]).all() and strides[0] >= 128 + 30
    assert all(start % strides[0] == 0 for start in starts)


def test_pages_scatter_when_no_run_is_free_and_are_never_refused() -> None:
    pool = KVPool(num_slots=64, page_size=4)  # 16 pages
    pages = pool.alloc_pages(16)
    pool.decref(pages[::2])  # every other page free: no two in a row
    got = pool.alloc_pages(8, after=pages[1], gap=4)
    assert sorted(got) == sorted(pages[::2]) and pool.num_free_pages == 0
    assert pool.alloc_pages(1) is None


def test_random_alloc_and_free_keep_the_books() -> None:
    rng = random.Random(3)
    pool = KVPool(num_slots=3000, page_size=2)
    held: list[list[int]] = []
    for _ in range(2000):
        if held and rng.random() < 0.45:
            pool.decref(held.pop(rng.randrange(len(held))))
        else:
            after = rng.choice(held)[-1] if held and rng.random() < 0.5 else None
            pages = pool.alloc_pages(rng.randint(1, 40), after=after, gap=rng.randint(0, 30))
            if pages is not None:
                held.append(pages)
        taken = [p for pages in held for p in pages]
        assert len(taken) == len(set(taken)) and 0 not in taken
        assert pool.free_page_set() == set(range(1, pool.num_pages)) - set(taken)
        assert pool.num_free_pages == len(pool.free_page_set())
        assert all(pool.refs[p] == 1 for p in taken)
