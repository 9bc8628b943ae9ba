"""The self-check (`--self-check`, tests): every KV page's references add up after a step."""

from __future__ import annotations

from typing import Any

import numpy as np

from radixflow.runtime.protocol.plan import I64


def check_ownership(sched: Any) -> None:
    """Slot/page ownership adds up; tree counters and locks are consistent. `sched` is a
    Scheduler (its tree, pool and live requests)."""
    refs = sched.tree.check()
    live = [r for r in sched.live_requests() if r.own_pages or r.last_node is not None]
    private: list[np.ndarray] = []
    for req in live:
        refs[np.asarray(req.own_pages, dtype=I64)] += 1
        assert req.last_node is None or req.last_node.lock_ref > 0, f"{req.rid} lock lost"
        private.append(req.slots[req.prefix_len : req.kv_len])
    refs[0] += 1  # the reserved page
    assert (refs == sched.pool.refs).all(), (
        f"page refs differ at {np.flatnonzero(refs != sched.pool.refs)[:8]}"
    )
    free = sched.pool.free_page_set()
    assert len(free) == sched.pool.num_free_pages, "a page is free twice"
    assert free == set(np.flatnonzero(sched.pool.refs == 0).tolist()), "free != unreferenced"
    if private:
        slots = np.concatenate(private)
        assert len(np.unique(slots)) == len(slots), "a private slot is owned twice"
    if not sched.has_work:
        assert sched.tree.protected_size == 0, f"idle with {sched.tree.protected_size} locked"
        tree_pages = int((refs[1:] > 0).sum())
        assert tree_pages + sched.pool.num_free_pages == sched.pool.capacity_pages, "idle leak"
