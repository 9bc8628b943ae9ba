"""The scheduler over a disk tier, with test_scheduler's fake runner: its KV of a slot is
(position, hash of the sequence up to it), and it fails any read of KV that is not the
request's own. A first scheduler fills the store; a second one (a new pool and runner: a
restart) serves the same workload loading from disk, under chunking, paging, preemption and
both write policies, and every output stays exact."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_scheduler import (
    VOCAB,
    FakeRunner,
    expected_output,
    make_req,
    run_all,
    workload,
)

from radixflow.runtime.cache.disk_store import DiskStore
from radixflow.runtime.cache.kv_pool import KVPool
from radixflow.runtime.cache.radix_cache import RadixCache
from radixflow.runtime.cache.tiered import DiskTier
from radixflow.runtime.config import ServerConfig
from radixflow.runtime.scheduler.scheduler import Scheduler


class RunnerPages:
    """The fake runner's KV as rows of bytes: (position, hash) as two int64 per slot."""

    def __init__(self, runner: FakeRunner) -> None:
        self.runner = runner

    def read(self, slots: np.ndarray) -> np.ndarray:
        pairs = np.array([self.runner.store[int(s)] for s in slots], dtype=np.int64)
        return pairs.view(np.uint8).reshape(len(slots), 16)

    def write(self, slots: np.ndarray, rows: np.ndarray) -> None:
        pairs = np.ascontiguousarray(rows).view(np.int64).reshape(len(slots), 2)
        for slot, (position, h) in zip(slots.tolist(), pairs.tolist()):
            self.runner.store[slot] = (position, h)


def tiered_scheduler(root: Path, policy: str, **config) -> tuple[Scheduler, FakeRunner]:
    cfg = ServerConfig(**{"self_check": True, "max_total_tokens": 4096, **config})
    runner, pool = FakeRunner(), KVPool(cfg.max_total_tokens, cfg.page_size)
    store = DiskStore(root, b"F" * 16, 1 << 30, {})
    block = max(8, cfg.page_size)
    tier = DiskTier(RadixCache(pool), pool, store, RunnerPages(runner), policy, block)
    sched = Scheduler(
        cfg, runner, pool, eos_token_ids=(0,), context_len=100_000, vocab_size=VOCAB,
        decode=lambda ids: " ".join(map(str, ids)), tiers=tier,
    )  # fmt: skip
    return sched, runner


def serve(sched: Scheduler) -> list:
    reqs = []
    for i, (prompt, n) in enumerate(workload(seed=2)):
        req = make_req(f"r{i}", prompt, n, ignore_eos=True)
        reqs.append(req)
        sched.add_request(req)
        if i % 6 == 5:
            sched.step()  # arrivals during decoding
    run_all(sched)
    for req in reqs:
        assert req.error is None, req.error
        assert req.output_ids == expected_output(req.input_ids, req.sampling.max_new_tokens)
    return reqs


CONFIGS = [
    {},
    {"chunked_prefill_size": 16},
    {"page_size": 4},
    {"page_size": 16, "chunked_prefill_size": 16},
    {"max_total_tokens": 400, "schedule_conservativeness": 0.05},  # evicts and preempts
    {"max_total_tokens": 400, "schedule_conservativeness": 0.05, "page_size": 16},
]


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("config", CONFIGS, ids=[str(c) for c in CONFIGS])
def test_restart_loads_exact_kv(tmp_path: Path, policy: str, config: dict) -> None:
    first, _ = tiered_scheduler(tmp_path, policy, **config)
    serve(first)
    first.kv.tiers.close()
    computed_cold = first.counters["prefill_tokens_computed"]
    second, _ = tiered_scheduler(tmp_path, policy, **config)
    reqs = serve(second)
    stats = second.stats()
    assert stats["hicache_hit_tokens"] > 0 and stats["hicache_blocks_bad"] == 0
    assert second.counters["prefill_tokens_computed"] < computed_cold
    assert sum(r.cached_tokens_disk for r in reqs) > 0  # reported per request
    second.kv.tiers.close()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_preempted_requests_kv_comes_back_from_disk(tmp_path: Path, policy: str) -> None:
    """A pool too small for the load preempts; the victim's KV (prompt and generated tokens)
    goes to the tree, then to disk as the pool evicts it, and its resumption loads it from
    there instead of computing it again; outputs stay exact (serve checks them)."""
    sched, _ = tiered_scheduler(
        tmp_path, policy, max_total_tokens=400, schedule_conservativeness=0.05
    )
    match, resumed = sched.kv.match, []

    def recording_match(req):
        before = sched.kv.tiers.counters["hit_tokens"]
        prefix, node = match(req)
        loaded = sched.kv.tiers.counters["hit_tokens"] - before
        if loaded and req.num_preemptions and len(prefix) > len(req.input_ids):
            resumed.append((req.rid, loaded))  # its own generated tokens' KV, from disk
        return prefix, node

    sched.kv.match = recording_match
    serve(sched)
    assert sched.counters["preemptions"] > 0
    assert resumed, "no preempted request loaded its KV from disk"
    sched.kv.tiers.close()
