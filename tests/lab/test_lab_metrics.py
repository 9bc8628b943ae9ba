"""What the scheduler records (runtime/scheduler/stats.py) and the tree picture (lab/tree.py),
on the real Scheduler driven in virtual time (torch-free, fast)."""

from __future__ import annotations

import numpy as np
import pytest

from radixflow.bench.workloads import Codec
from radixflow.lab.cases import lab_workload
from radixflow.lab.profiles import LinearProfile
from radixflow.lab.simulate import (
    VirtualClock,
    bench_workload,
    drive,
    sim_scheduler,
    word_codec,
)
from radixflow.lab.tree import eviction_order, render_png, render_text
from radixflow.runtime.cache.tree_dump import dump_tree
from radixflow.runtime.config import ServerConfig
from radixflow.runtime.scheduler.stats import STOP_REASONS, shared_run

TOY = LinearProfile("toy", 0.01, 0.001, 0.002, 1e-6, 0.0)


def run(name: str, quick: bool = True, **config) -> tuple[dict, dict, object]:
    clock, codec = VirtualClock(), word_codec()
    scheduler = sim_scheduler(ServerConfig(self_check=True, **config), TOY, codec, clock)
    workload = lab_workload(name, Codec(codec.encode, codec.decode), quick)
    row = drive(scheduler, workload, clock.now)
    return scheduler.stats(), row, scheduler


def test_latency_percentiles_are_the_requests_own() -> None:
    stats, row, scheduler = run("small_chat")
    steps = [t for _, t in scheduler.runner.shapes]
    assert stats["steps_recorded"] == len(steps)
    assert stats["step_time_p50_s"] == pytest.approx(float(np.percentile(steps, 50)))
    # 3 requests admitted together: every TTFT is the first step, every ITL a decode step
    assert stats["ttft_p50_s"] == pytest.approx(steps[0])
    gaps = np.repeat(steps[1:], 3)  # each decode step is a gap of all three
    assert stats["itl_p99_s"] == pytest.approx(float(np.percentile(gaps, 99)))
    assert stats["latency_window_requests"] == 3 and len(stats["recent_requests"]) == 3
    assert stats["admission_stop_nothing_waiting"] == len(steps)


def test_admission_stops_say_why() -> None:
    capped, _, _ = run("long_outputs", max_running_requests=2)
    assert capped["admission_stop_running_cap"] > capped["steps_recorded"] / 2
    small, _, _ = run("long_outputs", max_total_tokens=256)
    assert small["admission_stop_kv"] > 0 and small["kv_use_peak"] > 0.8
    budget, _, _ = run("long_outputs", chunked_prefill_size=-1, max_prefill_tokens=64)
    assert budget["admission_stop_token_budget"] > 0
    assert set(STOP_REASONS) <= {k.removeprefix("admission_stop_") for k in capped}


def test_preemption_counts_recomputed_tokens_and_evictions() -> None:
    stats, _, _ = run("long_outputs", max_total_tokens=200, schedule_conservativeness=0.1)
    assert stats["preemptions"] > 0
    assert stats["recomputed_tokens"] > 0
    assert stats["prefill_tokens_computed"] >= stats["prompt_tokens"] + stats["recomputed_tokens"]


def test_kv_waste_grows_with_the_page_size() -> None:
    """Allocated but unwritten slots: none at page 1; the tails of partly filled pages at
    16 and 64 (each request wastes under one page)."""
    waste = {}
    for page in (1, 16, 64):
        stats, _, scheduler = run("long_outputs", page_size=page)
        waste[page] = stats["kv_waste_fraction"]
        assert stats["kv_waste_peak_fraction"] >= waste[page]
    assert waste[1] == 0.0 and 0 < waste[16] < waste[64]


def test_prefix_probe_sees_a_varying_head() -> None:
    a = np.array([1, 2, 9, 9, 5] + list(range(100, 160)))
    b = np.array([1, 2, 8, 7, 5] + list(range(100, 160)))
    assert shared_run(a, b) == (2, 61, 4)
    stats, _, _ = run("timestamp_prefix")
    assert stats["cache_hit_rate"] < 0.1
    assert stats["prefix_hit_rate_head_moved_est"] > 0.5
    assert 10 <= stats["prefix_varying_head_tokens"] <= 30


def test_tree_dump_shows_shared_runs(tmp_path) -> None:
    clock, codec = VirtualClock(), word_codec()
    scheduler = sim_scheduler(ServerConfig(self_check=True), TOY, codec, clock)
    drive(scheduler, bench_workload("tree_of_thought", codec, True), clock.now)
    dump = scheduler.stats()["radix_tree"]
    nodes = dump["nodes"]
    assert dump["tokens"] == scheduler.tree.total_size == sum(n["tokens"] for n in nodes)
    root_children = [n for n in nodes if n["parent"] == 0]
    assert len(root_children) == 1 and root_children[0]["text"].startswith("Solve the problem")
    # 2 approaches x 2 steps: 4 leaves, all evictable at idle, LRU order by last access
    leaves = [n for n in nodes if n["leaf"]]
    assert len(leaves) == 4 and all(n["ref"] == 0 for n in nodes)
    order = eviction_order(dump)
    accesses = [next(n["last_access"] for n in nodes if n["id"] == i) for i in order]
    assert accesses == sorted(accesses)
    text = render_text(dump)
    assert text.splitlines()[0].startswith(f"radix tree: {dump['tokens']} tokens")
    assert "evict#1" in text and "Solve the problem" in text
    pytest.importorskip("matplotlib")
    render_png(dump, str(tmp_path / "tree.png"))
    assert (tmp_path / "tree.png").read_bytes()[:4] == b"\x89PNG"


def test_tree_dump_locks_and_truncates() -> None:
    clock, codec = VirtualClock(), word_codec()
    scheduler = sim_scheduler(ServerConfig(), TOY, codec, clock)
    drive(scheduler, bench_workload("few_shot", codec, True), clock.now)
    slots, node = scheduler.tree.match_prefix(np.asarray(codec.encode("The following"), np.int64))
    scheduler.tree.lock(node)
    dump = dump_tree(scheduler.tree, codec.decode, max_nodes=3)
    assert dump["truncated"] and len(dump["nodes"]) == 3
    assert dump["nodes"][1]["ref"] == 1  # the locked path
    scheduler.tree.unlock(node)
