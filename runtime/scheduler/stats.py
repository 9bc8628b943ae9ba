"""SchedulerStats: what the scheduler records about itself, always on, torch-free.

Per step: its wall time (the scheduler's clock, virtual under `radixflow simulate`), decode
rows, prefill tokens, and why admission stopped. Counters: evicted and recomputed tokens
(a preempted request prefills its sequence again). Rolling windows of the last requests:
TTFT, inter-token latency (ITL) and end-to-end percentiles. KV: slots used by requests,
evictable, free, and waste (allocated but unwritten slots, the tails of partly filled pages
when page_size > 1). A prefix probe compares each prompt with the recent ones to estimate
the hit rate a perfect cache could reach, as sent and with a varying head (a timestamp, an
id) moved behind the shared part. `stats()` flattens all of it into the scheduler's stats.

Cost per step: O(running requests); per new prompt: O(PROBE_PEERS) numpy comparisons.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import TYPE_CHECKING, Any

import numpy as np

from radixflow.runtime.cache.tree_dump import dump_tree

if TYPE_CHECKING:
    from radixflow.runtime.protocol.plan import BatchPlan
    from radixflow.runtime.scheduler.request import Req
    from radixflow.runtime.scheduler.scheduler import Scheduler

STOP_REASONS = (
    "token_budget",  # the step's prefill token budget is spent (or chunking is off)
    "kv",  # the next request's KV (prompt + reserved output) does not fit
    "running_cap",  # max_running_requests reached
    "grammar_queue",  # nothing admissible: requests wait for their grammar
    "nothing_waiting",
    "prefix_dedup",  # the rest share an uncached prefix with one admitted this step
)
CONFIG_FIELDS = (  # in the stats, so `radixflow diagnose --url` knows what to tune
    "max_running_requests",
    "chunked_prefill_size",
    "max_prefill_tokens",
    "page_size",
    "disable_radix_cache",
    "mem_fraction_static",
)
STEP_WINDOW = 2048
REQUEST_WINDOW = 512
PROBE_PEERS = 16  # a new prompt is compared with this many recent ones
PROBE_TOKENS = 4096  # of each prompt's head
MAX_HEAD = 64  # a varying head longer than this is not "a head"
MIN_SHARED = 16  # shared runs shorter than this are noise


def percentiles(values: Any, prefix: str) -> dict[str, float | None]:
    """{prefix_p50_s, _p90_s, _p99_s, _mean_s} of `values` (None when empty)."""
    data = np.asarray(list(values), dtype=np.float64)
    keys = ("p50", "p90", "p99")
    if data.size == 0:
        return {f"{prefix}_{k}_s": None for k in (*keys, "mean")}
    points = np.percentile(data, [50, 90, 99])
    out = {f"{prefix}_{k}_s": float(v) for k, v in zip(keys, points)}
    out[f"{prefix}_mean_s"] = float(data.mean())
    return out


def shared_run(a: np.ndarray, b: np.ndarray) -> tuple[int, int, int]:
    """(common prefix length, shared run, head): the run is the tokens equal position by
    position after a differing head of at most MAX_HEAD tokens (0 when there is no such run
    of at least MIN_SHARED tokens, or it is no longer than the common prefix)."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    if diff.size == 0:
        return n, n, 0
    prefix = int(diff[0])
    head = diff[diff < MAX_HEAD]
    start = int(head[-1]) + 1 if head.size else 0
    later = diff[diff >= start]
    end = int(later[0]) if later.size else n
    run = end - start if end - start >= MIN_SHARED and end - start > prefix else 0
    return prefix, run, start


class SchedulerStats:
    def __init__(self) -> None:
        self.steps: deque[tuple[float, int, int, str]] = deque(maxlen=STEP_WINDOW)
        self.kv: deque[tuple[float, float]] = deque(maxlen=STEP_WINDOW)  # (use, waste share)
        self.stops: Counter[str] = Counter()
        self.evicted_tokens = 0
        self.recomputed_tokens = 0
        self.ttft: deque[float] = deque(maxlen=REQUEST_WINDOW)
        self.e2e: deque[float] = deque(maxlen=REQUEST_WINDOW)
        self.itl: deque[float] = deque(maxlen=16 * REQUEST_WINDOW)
        # (arrival, finish, ttft, request's ITL p99 or None, completion tokens, context)
        self.requests: deque[tuple[float, float, float, float | None, int, int]] = deque(
            maxlen=REQUEST_WINDOW
        )
        self.recent_prompts: deque[np.ndarray] = deque(maxlen=PROBE_PEERS)
        self.probe = Counter()  # prompt tokens, best shareable as sent, best with head moved
        self.heads: Counter[int] = Counter()  # varying head lengths seen

    # ---- hooks the scheduler calls -------------------------------------------------------

    def evicted(self, num_tokens: int) -> int:
        self.evicted_tokens += num_tokens
        return num_tokens

    def arrived(self, req: Req) -> None:
        """Probe a new prompt against the recent ones (prefix-sharing potential)."""
        ids = np.asarray(req.input_ids[:PROBE_TOKENS], dtype=np.int64)
        best_sent = best_moved = head = 0
        for other in self.recent_prompts:
            prefix, run, start = shared_run(ids, other)
            best_sent = max(best_sent, prefix)
            if run > best_moved:
                best_moved, head = run, start
        self.recent_prompts.append(ids)
        self.probe["prompt_tokens"] += len(req.input_ids)
        self.probe["shareable_sent"] += best_sent
        self.probe["shareable_moved"] += max(best_sent, best_moved)
        if best_moved > best_sent:
            self.heads[head] += 1

    def stepped(
        self, scheduler: Scheduler, plan: BatchPlan, extends: list[Req], start: float
    ) -> None:
        """After a forward step: its time, rows, admission stop and the KV picture."""
        wall = scheduler.clock() - start
        decode_rows = len(plan.decode_kv_indptr) - 1
        stop = scheduler.admit_stop or (
            "prefix_dedup"
            if scheduler.waiting
            else "grammar_queue"
            if scheduler.grammar_queue
            else "nothing_waiting"
        )
        self.stops[stop] += 1
        self.steps.append((wall, decode_rows, plan.num_extend_tokens, stop))
        lengths = np.diff(plan.extend_qo_indptr)
        self.recomputed_tokens += int(
            sum(n for req, n in zip(extends, lengths.tolist()) if req.num_preemptions)
        )
        used, _, waste = self.kv_slots(scheduler)
        total = scheduler.pool.capacity_pages * scheduler.pool.page_size
        live = used - scheduler.tree.evictable_size
        self.kv.append((live / total, waste / used if used else 0.0))

    def finished(self, req: Req, now: float) -> None:
        """A request that produced output: its latencies enter the windows."""
        if req.first_token_time is None or req.error is not None:
            return
        ttft = req.first_token_time - req.arrival
        gaps = np.diff(req.token_times) if len(req.token_times) > 1 else np.zeros(0)
        self.ttft.append(ttft)
        self.e2e.append(now - req.arrival)
        self.itl.extend(gaps.tolist())
        itl_p99 = float(np.percentile(gaps, 99)) if gaps.size else None
        self.requests.append((req.arrival, now, ttft, itl_p99, len(req.output_ids), req.seq_len))

    # ---- reading -------------------------------------------------------------------------

    @staticmethod
    def kv_slots(scheduler: Scheduler) -> tuple[int, int, int]:
        """(slots in live pages, slots holding KV, waste = allocated but unwritten)."""
        pool, tree = scheduler.pool, scheduler.tree
        used = (pool.capacity_pages - pool.num_free_pages) * pool.page_size
        private = sum(max(r.kv_len - r.prefix_len, 0) for r in scheduler.live_requests())
        written = tree.total_size + private
        return used, written, max(used - written, 0)

    def goodput(self, ttft_slo: float | None, itl_slo: float | None) -> dict[str, float]:
        """Output tokens/s of the window's requests, all and those meeting both SLOs."""
        if not self.requests:
            return {"throughput_tokens_per_s": 0.0, "goodput_tokens_per_s": 0.0, "slo_met": 0.0}
        span = max(r[1] for r in self.requests) - min(r[0] for r in self.requests)
        span = span if span > 0 else 1.0
        good = [
            r
            for r in self.requests
            if (ttft_slo is None or r[2] <= ttft_slo)
            and (itl_slo is None or r[3] is None or r[3] <= itl_slo)
        ]
        return {
            "throughput_tokens_per_s": sum(r[4] for r in self.requests) / span,
            "goodput_tokens_per_s": sum(r[4] for r in good) / span,
            "slo_met": len(good) / len(self.requests),
        }

    def stats(self, scheduler: Scheduler) -> dict[str, Any]:
        """The flat stats fields (see the module docstring); None where nothing was seen."""
        total = scheduler.pool.capacity_pages * scheduler.pool.page_size
        used, _, waste = self.kv_slots(scheduler)
        live = used - scheduler.tree.evictable_size
        walls = [s[0] for s in self.steps]
        kv_use = [k[0] for k in self.kv]
        waste_share = [k[1] for k in self.kv]
        contexts = [r[5] for r in self.requests]
        probe = self.probe
        out: dict[str, Any] = {
            **{k: getattr(scheduler.config, k) for k in CONFIG_FIELDS},
            "evicted_tokens": self.evicted_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            **{f"admission_stop_{r}": self.stops[r] for r in STOP_REASONS},
            "steps_recorded": len(self.steps),
            **percentiles(walls, "step_time"),
            "decode_rows_mean": float(np.mean([s[1] for s in self.steps])) if self.steps else None,
            "prefill_tokens_per_step_max": max((s[2] for s in self.steps), default=0),
            "mixed_prefill_tokens_max": max(
                (s[2] for s in self.steps if s[1] > 0), default=0
            ),  # the largest prefill a step with decodes carried: what stalls their ITL
            **percentiles(self.ttft, "ttft"),
            **percentiles(self.itl, "itl"),
            **percentiles(self.e2e, "e2e"),
            "latency_window_requests": len(self.requests),
            "kv_used_slots": live,
            "kv_evictable_slots": scheduler.tree.evictable_size,
            "kv_free_slots": scheduler.pool.num_free_slots,
            "kv_use": live / total,
            "kv_use_mean": float(np.mean(kv_use)) if kv_use else 0.0,
            "kv_use_peak": max(kv_use, default=0.0),
            "kv_waste_slots": waste,
            "kv_waste_fraction": float(np.mean(waste_share)) if waste_share else 0.0,
            "kv_waste_peak_fraction": max(waste_share, default=0.0),
            "requests_fit_avg_context": total / float(np.mean(contexts)) if contexts else None,
            "prefix_hit_rate_possible_est": probe["shareable_sent"] / probe["prompt_tokens"]
            if probe["prompt_tokens"]
            else 0.0,
            "prefix_hit_rate_head_moved_est": probe["shareable_moved"] / probe["prompt_tokens"]
            if probe["prompt_tokens"]
            else 0.0,
            "prefix_varying_head_tokens": self.heads.most_common(1)[0][0] if self.heads else 0,
            "recent_requests": [
                [
                    round(r[2], 4),
                    None if r[3] is None else round(r[3], 4),
                    r[4],
                    round(r[0], 3),
                    round(r[1], 3),
                ]
                for r in self.requests
            ][-256:],
        }
        if scheduler.kv.tiers is not None:  # the disk tier's hicache_* counters
            out.update(scheduler.kv.tiers.stats())
        if not scheduler.has_work:  # idle: the tree picture (`radixflow tree`)
            out["radix_tree"] = dump_tree(scheduler.tree, scheduler.decode)
        return out
