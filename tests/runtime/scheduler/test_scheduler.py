"""Scheduler tests with a fake model that checks every KV read (no torch, fast).

The fake runner stores in each written slot (position, hash of the sequence up to it) and, on
every forward, checks that each request's KV indices form one unbroken chain of its own
sequence. Its "next token" is a hash of the whole sequence, so any wrong reuse of KV changes
the output, and the expected output of every request is computable without a scheduler.
"""

from __future__ import annotations

import numpy as np
import pytest

from radixflow.runtime.cache.kv_pool import KVPool
from radixflow.runtime.config import ServerConfig
from radixflow.runtime.protocol.plan import BatchPlan, StepResult
from radixflow.runtime.protocol.sampling import SamplingParams
from radixflow.runtime.scheduler.request import Req
from radixflow.runtime.scheduler.scheduler import Scheduler

VOCAB = 50
MOD = (1 << 61) - 1


def chain(h: int, token: int) -> int:
    return (h * 1_000_003 + token + 1) % MOD


def expected_output(prompt: list[int], n: int) -> list[int]:
    h = 0
    for t in prompt:
        h = chain(h, t)
    out = []
    for _ in range(n):
        token = 1 + h % (VOCAB - 1)
        out.append(token)
        h = chain(h, token)
    return out


class FakeRunner:
    def __init__(self) -> None:
        self.store: dict[int, tuple[int, int]] = {}  # slot -> (position, sequence hash)
        self.tokens_computed = 0
        self.row_hashes: list[int] = []

    def _chain_hash(self, kv: np.ndarray) -> int:
        for pos, slot in enumerate(kv.tolist()):
            assert slot in self.store, f"read of unwritten slot {slot}"
            assert self.store[slot][0] == pos, f"slot {slot} holds position {self.store[slot][0]}"
        return self.store[int(kv[-1])][1] if len(kv) else 0

    def _check_links(self, kv: np.ndarray, hashes: list[int]) -> None:
        """Recompute nothing we cannot: the stored hashes must be the request's own chain."""
        got = [self.store[int(s)][1] for s in kv]
        assert got == hashes[: len(kv)], "KV of another sequence was read"

    def forward(self, plan: BatchPlan) -> StepResult:
        for src, dst in zip(plan.copy_src.tolist(), plan.copy_dst.tolist()):
            self.store[dst] = self.store[src]
        self.tokens_computed += plan.num_tokens
        row_hash: list[int] = []
        qo, kv = plan.extend_qo_indptr, plan.extend_kv_indptr
        for b in range(len(qo) - 1):
            prefix = plan.extend_kv_indices[kv[b] : kv[b + 1]]
            h = self._chain_hash(prefix)
            for r in range(qo[b], qo[b + 1]):
                h = chain(h, int(plan.input_ids[r]))
                self.store[int(plan.out_slots[r])] = (int(plan.positions[r]), h)
                row_hash.append(h)
        dkv = plan.decode_kv_indptr
        for j in range(len(dkv) - 1):
            r = plan.num_extend_tokens + j
            kvs = plan.decode_kv_indices[dkv[j] : dkv[j + 1]]
            h = self._chain_hash(kvs[:-1])
            h = chain(h, int(plan.input_ids[r]))
            assert int(kvs[-1]) == int(plan.out_slots[r])
            self.store[int(plan.out_slots[r])] = (int(plan.positions[r]), h)
            self._chain_hash(kvs)
            row_hash.append(h)
        rows = [row_hash[int(r)] for r in plan.logit_rows]
        self.row_hashes = rows  # of the logit rows: subclasses derive more from them
        next_ids = [1 + rows[int(i)] % (VOCAB - 1) for i in plan.sample_rows]
        return StepResult(next_ids, [0.0] * len(next_ids), np.zeros(len(rows)))


def make_scheduler(**config) -> tuple[Scheduler, FakeRunner]:
    cfg = ServerConfig(**{"self_check": True, "max_total_tokens": 4096, **config})
    runner = FakeRunner()
    pool = KVPool(cfg.max_total_tokens, cfg.page_size)
    sched = Scheduler(
        cfg,
        runner,
        pool,
        eos_token_ids=(0,),
        context_len=100_000,
        vocab_size=VOCAB,
        decode=lambda ids: " ".join(map(str, ids)),
    )
    return sched, runner


def make_req(rid: str, prompt: list[int], n: int, **sampling) -> Req:
    params = SamplingParams.from_dict({"max_new_tokens": n, "temperature": 0, **sampling})
    return Req(rid=rid, input_ids=list(prompt), sampling=params)


def run_all(sched: Scheduler, max_steps: int = 10_000) -> int:
    steps = 0
    while sched.has_work:
        sched.step()
        steps += 1
        assert steps < max_steps, "scheduler did not finish"
    sched.check_invariants()
    return steps


def workload(seed: int, num: int = 24) -> list[tuple[list[int], int]]:
    """Prompts sharing a few prefixes (fork- and chat-shaped), mixed lengths."""
    rng = np.random.default_rng(seed)
    stems = [rng.integers(1, VOCAB, size=int(n)).tolist() for n in (37, 90, 5)]
    out = []
    for _ in range(num):
        stem = stems[int(rng.integers(0, len(stems)))]
        tail = rng.integers(1, VOCAB, size=int(rng.integers(0, 30))).tolist()
        out.append((stem + tail, int(rng.integers(1, 40))))
    return out


CONFIGS = [
    {},
    {"disable_radix_cache": True},
    {"chunked_prefill_size": 16},
    {"chunked_prefill_size": 64},
    {"chunked_prefill_size": -1},
    {"page_size": 4},
    {"page_size": 16, "chunked_prefill_size": 16},
    {"schedule_policy": "fcfs"},
    {"schedule_policy": "dfs-weight"},
    # a small pool and an optimistic decode estimate force preemption
    {"max_total_tokens": 400, "schedule_conservativeness": 0.05},
    {"max_total_tokens": 400, "schedule_conservativeness": 0.05, "page_size": 16},
    {
        "max_total_tokens": 400,
        "schedule_conservativeness": 0.05,
        "disable_radix_cache": True,
        "chunked_prefill_size": 32,
    },
    {"max_running_requests": 3, "max_prefill_tokens": 50},
]


@pytest.mark.parametrize("config", CONFIGS, ids=[str(c) for c in CONFIGS])
def test_outputs_exact_under_every_config(config: dict) -> None:
    sched, _ = make_scheduler(**config)
    reqs = []
    for i, (prompt, n) in enumerate(workload(seed=1)):
        req = make_req(f"r{i}", prompt, n, ignore_eos=True)
        reqs.append(req)
        sched.add_request(req)
        if i % 6 == 5:
            sched.step()  # arrivals during decoding
    run_all(sched)
    for req in reqs:
        assert req.error is None, req.error
        assert req.output_ids == expected_output(req.input_ids, req.sampling.max_new_tokens)
    if config.get("max_total_tokens") == 400:
        assert sched.counters["preemptions"] > 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_fork_prefix_computed_once(page_size: int) -> None:
    sched, runner = make_scheduler(page_size=page_size)
    prefix = np.random.default_rng(3).integers(1, VOCAB, size=300).tolist()
    branches = [prefix + [i + 1, i + 2] for i in range(8)]
    reqs = [make_req(f"b{i}", p, 32, ignore_eos=True) for i, p in enumerate(branches)]
    for req in reqs:
        sched.add_request(req)
    run_all(sched)
    distinct = len(prefix) + 2 * len(branches)
    assert sched.counters["prefill_tokens_computed"] == distinct
    for req in reqs:
        assert req.output_ids == expected_output(req.input_ids, 32)


def test_parallel_identical_prompts_share_prompt() -> None:
    sched, _ = make_scheduler()
    prompt = list(range(1, 41))
    reqs = [make_req(f"n{i}", prompt, 4, ignore_eos=True) for i in range(4)]
    for req in reqs:
        sched.add_request(req)
    run_all(sched)
    # the first computes 40 tokens, the others only their last prompt token
    assert sched.counters["prefill_tokens_computed"] == 40 + 3
    assert sched.counters["cached_tokens"] == 3 * 39


def test_cold_request_is_not_starved() -> None:
    sched, _ = make_scheduler(max_running_requests=2, schedule_policy="lpm")
    hot = np.random.default_rng(5).integers(1, VOCAB, size=200).tolist()
    cold = make_req("cold", [7] * 30, 4, ignore_eos=True)
    sched.add_request(make_req("h0", hot + [1], 4, ignore_eos=True))
    sched.step()
    sched.add_request(cold)
    for step in range(400):
        sched.add_request(make_req(f"h{step + 1}", hot + [2 + step % 40], 4, ignore_eos=True))
        sched.step()
        if cold.finished:
            break
    assert cold.finished, "the cold request starved behind hot ones"
    assert step < 60
    for req in list(sched.waiting):
        sched.abort(req.rid)
    run_all(sched)


@pytest.mark.parametrize("when", ["waiting", "chunking", "decoding"])
def test_abort_frees_everything(when: str) -> None:
    sched, _ = make_scheduler(chunked_prefill_size=16, max_running_requests=1)
    blocker = make_req("blocker", list(range(1, 20)), 30, ignore_eos=True)
    victim = make_req("victim", list(range(1, 60)), 30, ignore_eos=True)
    sched.add_request(blocker if when == "waiting" else victim)
    sched.add_request(victim if when == "waiting" else blocker)
    sched.step()
    if when == "decoding":
        while victim.kv_len < victim.seq_len - 1 or not victim.output_ids:
            sched.step()
    assert sched.abort("victim") is victim
    assert sched.abort("victim") is None  # idempotent
    assert victim.finish_reason["type"] == "abort"
    sched.check_invariants()
    run_all(sched)
    assert blocker.output_ids == expected_output(blocker.input_ids, 30)


def test_request_too_big_for_pool_fails_cleanly() -> None:
    sched, _ = make_scheduler(max_total_tokens=64)
    big = make_req("big", list(range(1, 50)), 40)
    ok = make_req("ok", list(range(1, 10)), 5, ignore_eos=True)
    sched.add_request(big)
    sched.add_request(ok)
    run_all(sched)
    assert big.error and "pool" in big.error
    assert ok.output_ids == expected_output(ok.input_ids, 5)


@pytest.mark.parametrize("when", ["prefill", "mid-chunk", "decode"])
def test_a_failing_step_fails_its_batch_and_leaks_nothing(when: str) -> None:
    """A forward that raises (a bad request, a kernel bug) costs the requests of that step:
    they finish with an error, their KV goes back, the tree holds nothing of the step, and
    requests queued behind them still get exact outputs."""
    sched, runner = make_scheduler(chunked_prefill_size=16, max_running_requests=2)
    first = make_req("first", list(range(1, 40)), 8, ignore_eos=True)
    second = make_req("second", list(range(2, 30)), 8, ignore_eos=True)
    later = make_req("later", list(range(3, 25)), 6, ignore_eos=True)
    for req in (first, second, later):
        sched.add_request(req)
    steps = {"prefill": 1, "mid-chunk": 2, "decode": 6}[when]
    for _ in range(steps - 1):
        sched.step()
    forward = runner.forward

    def broken(plan: BatchPlan) -> StepResult:
        raise RuntimeError("kernel exploded")

    runner.forward = broken
    failed = sched.step()
    runner.forward = forward
    assert failed and all(r.finished for r in failed)
    assert all("kernel exploded" in r.error for r in failed), [r.error for r in failed]
    sched.check_invariants()
    run_all(sched)
    for req in (first, second, later):
        if req not in failed:
            assert req.output_ids == expected_output(req.input_ids, len(req.output_ids))
            assert len(req.output_ids) == req.sampling.max_new_tokens
    assert later not in failed


def test_stats_count_cached_tokens_once() -> None:
    sched, _ = make_scheduler(chunked_prefill_size=8)
    prompt = list(range(1, 50))
    first = make_req("a", prompt, 2, ignore_eos=True)
    sched.add_request(first)
    run_all(sched)
    second = make_req("b", prompt + [9, 9], 2, ignore_eos=True)
    sched.add_request(second)
    run_all(sched)
    assert second.cached_tokens == 49
    stats = sched.stats()
    assert stats["cached_tokens"] == 49 and stats["prompt_tokens"] == 49 + 51
    assert stats["prefill_tokens_computed"] == 49 + 2
    assert stats["evictable_tokens"] == stats["tokens_in_tree"] > 0


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_short_cached_prefix_copied_into_own_run(page_size: int) -> None:
    """A cached prefix shorter than COPY_PREFIX_BELOW is copied into the request's own run
    (one run per request is what the CPU decode's grid reads fastest), still counted as
    cached and not recomputed; a longer one stays shared. Requests prefilled together keep
    their own copy of a short common head instead of adopting each other's slots."""
    from radixflow.runtime.scheduler.request_kv import COPY_PREFIX_BELOW

    sched, runner = make_scheduler(page_size=page_size)
    short, long = [7, 8, 9], list(range(1, COPY_PREFIX_BELOW + 5))
    for rid, stem in (("a", short), ("b", long)):
        sched.add_request(make_req(rid, stem + [30, 31], 4, ignore_eos=True))
    run_all(sched)
    later = [
        make_req(r, s + [40, 41, 42], 30, ignore_eos=True) for r, s in (("c", short), ("d", long))
    ]
    together = [
        make_req(r, [11, 12, i, 44, 45], 30, ignore_eos=True) for i, r in ((5, "e"), (6, "f"))
    ]
    for req in later + together:
        sched.add_request(req)
    computed = runner.tokens_computed
    sched.step()  # all four prefilled in one step
    c, d, e, f = later + together
    assert runner.tokens_computed - computed == 3 + 3 + 5 + 5  # cached prefixes not recomputed
    assert (c.cached_tokens, d.cached_tokens) == (len(short), len(long))
    tree_short = sched.tree.match_prefix(np.array(short))[0]
    tree_long = sched.tree.match_prefix(np.array(long))[0]
    assert not set(c.slots[: len(short)].tolist()) & set(tree_short.tolist())  # a copy
    whole_pages = len(long) // page_size * page_size
    assert (d.slots[:whole_pages] == tree_long[:whole_pages]).all()  # shared
    assert not set(e.slots[:2].tolist()) & set(f.slots[:2].tolist())  # each its own head
    for req in (c, d, e, f):
        assert (np.diff(req.slots[: req.kv_len]) == 1).all() or req is d, req.rid  # one run
    run_all(sched)
    for req in later + together:
        assert req.output_ids == expected_output(req.input_ids, 30)


def _preempting_run(decay_steps: int) -> tuple[Scheduler, list[list[float]], list[Req]]:
    """The tight-pool workload; -> the scheduler, the reserve ratio after each step of every
    stretch between preemptions (each starts at a step that preempted), and the requests."""
    sched, _ = make_scheduler(
        max_total_tokens=400, schedule_conservativeness=0.05,
        new_token_ratio_decay_steps=decay_steps,
    )  # fmt: skip
    reqs = [
        make_req(f"r{i}", prompt, n, ignore_eos=True)
        for i, (prompt, n) in enumerate(workload(seed=1))
    ]
    for req in reqs:
        sched.add_request(req)
    stretches: list[list[float]] = []
    for _ in range(10_000):
        if not sched.has_work:
            break
        before = sched.counters["preemptions"]
        sched.step()
        if sched.counters["preemptions"] > before:
            stretches.append([])
        if stretches and sched.has_work:
            stretches[-1].append(sched.new_token_ratio)
    assert not sched.has_work, "scheduler did not finish"
    sched.check_invariants()
    return sched, stretches, reqs


def test_new_token_ratio_decay_steps_sets_how_fast_admission_recovers() -> None:
    """A preemption raises the share of each running request's remaining tokens held in
    reserve (near 1: admission stops); each step then lowers it by (initial - floor) /
    `new_token_ratio_decay_steps`. At 1 it is back at its floor, and admitting, within a few
    dozen steps; at the default 600 it stays up for the rest of this run."""
    fast, fast_stretches, fast_reqs = _preempting_run(1)
    slow, slow_stretches, slow_reqs = _preempting_run(600)
    for req in fast_reqs + slow_reqs:
        assert req.error is None, req.error
        assert req.output_ids == expected_output(req.input_ids, req.sampling.max_new_tokens)
    assert fast_stretches and slow_stretches
    assert max(fast_stretches[0]) > 0.5 and max(slow_stretches[0]) > 0.5  # raised
    per_step = fast.init_ratio - fast.min_ratio
    floor_after = int((1.0 - fast.min_ratio) / per_step) + 2
    for ratios in fast_stretches:
        if len(ratios) > floor_after:
            assert ratios[floor_after] == pytest.approx(fast.min_ratio)
    assert any(len(r) > floor_after for r in fast_stretches)
    assert all(r > 0.5 for ratios in slow_stretches for r in ratios[:100])


@pytest.mark.parametrize("enabled", [True, False])
def test_a_high_priority_request_overtakes_the_queue(enabled: bool) -> None:
    """One request runs at a time; four wait; a later one with a higher priority is admitted
    next with --enable-priority-scheduling (and in arrival order without it)."""
    sched, _ = make_scheduler(
        max_running_requests=1, schedule_policy="fcfs", enable_priority_scheduling=enabled
    )
    finished: list[str] = []
    queue = [make_req(f"q{i}", [3 + i] * 8, 4, ignore_eos=True) for i in range(5)]
    urgent = make_req("urgent", [50] * 8, 4, ignore_eos=True)
    urgent.priority = 5
    for req in queue:
        sched.add_request(req)
    sched.step()  # q0 runs
    sched.add_request(urgent)
    for _ in range(200):
        sched.step()
        finished += [r.rid for r in [*queue, urgent] if r.finished and r.rid not in finished]
        if not sched.has_work:
            break
    expected = ["q0", "urgent", "q1", "q2", "q3", "q4"]
    assert finished == (expected if enabled else ["q0", "q1", "q2", "q3", "q4", "urgent"])
