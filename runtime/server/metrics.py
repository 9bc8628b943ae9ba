"""Prometheus `/metrics` for the server: counters and latency histograms of finished requests,
gauges from the scheduler's latest stats, in the text exposition format (version 0.0.4).
Names follow SGLang's (`sglang:num_running_reqs` -> `radixflow:num_running_reqs`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "radixflow:"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f"# TYPE {name} histogram"]
        out += [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum}"]
        return out + [f"{name}_count {self.count}"]


class Metrics:
    """Server-side request metrics; `stats()` gives the scheduler's latest stats dict."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.stats = stats
        self.requests: Counter[str] = Counter()  # by outcome (finish type, or "error")
        self.generation_tokens: Counter[str] = Counter()
        self.prompt_tokens = 0
        self.ttft = Histogram()
        self.e2e = Histogram()
        self.http: Counter[tuple[str, int]] = Counter()  # (route, status) of HTTP answers

    def on_http(self, route: str, status: int) -> None:
        """Count one HTTP answer by its route's pattern (not the raw path: a client's path
        names would make the label set unbounded; unrouted paths count as "unknown")."""
        self.http[(route, status)] += 1

    def on_final(self, job: Any, reply: Any) -> None:
        """Count one final reply (a Result or an Error) of a client request."""
        if reply.TAG == "error":
            self.requests["error"] += 1
            return
        data = reply.data
        outputs = data if isinstance(data, list) else [data]
        for out in outputs:
            meta = out.get("meta_info") if isinstance(out, dict) else None
            if not isinstance(meta, dict):
                continue
            outcome = (meta.get("finish_reason") or {}).get("type", "unknown")
            self.requests[outcome] += 1
            self.generation_tokens[outcome] += int(meta.get("completion_tokens") or 0)
            self.prompt_tokens += int(meta.get("prompt_tokens") or 0)
            if meta.get("ttft") is not None:
                self.ttft.observe(float(meta["ttft"]))
            if meta.get("e2e_latency") is not None:
                self.e2e.observe(float(meta["e2e_latency"]))

    def render(self) -> bytes:
        p = PREFIX
        stats = self.stats() or {}
        total = stats.get("total_slots", 0)
        free = stats.get("free_slots", 0)
        evictable = stats.get("evictable_tokens", 0)
        lines = [f"# TYPE {p}num_requests_total counter"]
        lines += [f'{p}num_requests_total{{outcome="{k}"}} {v}' for k, v in self.requests.items()]
        lines.append(f"# TYPE {p}generation_tokens_total counter")
        lines += [
            f'{p}generation_tokens_total{{outcome="{k}"}} {v}'
            for k, v in self.generation_tokens.items()
        ]
        lines += [
            f"# TYPE {p}prompt_tokens_total counter",
            f"{p}prompt_tokens_total {self.prompt_tokens}",
        ]
        lines.append(f"# TYPE {p}http_requests_total counter")
        lines += [
            f'{p}http_requests_total{{route="{route}",status="{status}"}} {v}'
            for (route, status), v in sorted(self.http.items())
        ]
        lines += self.ttft.lines(f"{p}time_to_first_token_seconds")
        lines += self.e2e.lines(f"{p}e2e_request_latency_seconds")
        counters = {
            "cached_tokens_total": stats.get("cached_tokens", 0),
            "preemptions_total": stats.get("preemptions", 0),
            "evicted_tokens_total": stats.get("evicted_tokens", 0),
            "recomputed_tokens_total": stats.get("recomputed_tokens", 0),
            "jump_forward_tokens_total": stats.get("jump_forward_tokens", 0),
            "jump_forward_steps_saved_total": stats.get("jump_forward_steps_saved", 0),
            # decode runs: calls that ran several greedy decode steps, and their tokens
            "decode_runs_total": stats.get("decode_runs", 0),
            "decode_run_tokens_total": stats.get("decode_run_tokens", 0),
            # speculative decoding: verify steps, drafts proposed and drafts kept
            "spec_verify_steps_total": stats.get("spec_verify_steps", 0),
            "spec_proposed_tokens_total": stats.get("spec_proposed", 0),
            "spec_accepted_tokens_total": stats.get("spec_accepted", 0),
        }
        if "hicache_hit_tokens" in stats:  # --enable-hierarchical-cache: the disk tier
            counters.update(hicache_counters(stats))
        for name, value in counters.items():
            lines += [f"# TYPE {p}{name} counter", f"{p}{name} {value}"]
        lines.append(f"# TYPE {p}cached_tokens_by_tier_total counter")
        disk = stats.get("hicache_hit_tokens", 0)
        for tier, value in (("device", stats.get("cached_tokens", 0) - disk), ("disk", disk)):
            lines.append(f'{p}cached_tokens_by_tier_total{{tier="{tier}"}} {value}')
        gauges = {
            "num_running_reqs": stats.get("running_requests", 0),
            "num_queue_reqs": stats.get("waiting_requests", 0),
            "cache_hit_rate": stats.get("cache_hit_rate", 0.0),
            "kv_use": stats.get("kv_use", 0.0),
            "kv_waste_fraction": stats.get("kv_waste_fraction", 0.0),
            # tokens a verify step yields (kept drafts + 1), since start (SGLang's name)
            "spec_accept_length": stats.get("spec_accept_length", 0.0),
        }
        if "hicache_disk_bytes" in stats:
            gauges["hicache_disk_bytes"] = stats["hicache_disk_bytes"]
        for name, value in gauges.items():
            lines += [f"# TYPE {p}{name} gauge", f"{p}{name} {value}"]
        lines.append(f"# TYPE {p}kv_slots gauge")
        for state, value in (
            ("used", total - free - evictable),
            ("evictable", evictable),
            ("free", free),
        ):
            lines.append(f'{p}kv_slots{{state="{state}"}} {value}')
        return ("\n".join(lines) + "\n").encode()


def hicache_counters(stats: dict[str, Any]) -> dict[str, Any]:
    """The disk tier's counters (runtime/cache/tiered.py, disk_store.py) under SGLang-like
    names; load latency as a seconds sum and a count (mean = sum / count)."""
    return {
        "hicache_bytes_read_total": stats.get("hicache_bytes_read", 0),
        "hicache_bytes_written_total": stats.get("hicache_bytes_written", 0),
        "hicache_blocks_read_total": stats.get("hicache_blocks_read", 0),
        "hicache_blocks_written_total": stats.get("hicache_blocks_written", 0),
        "hicache_blocks_bad_total": stats.get("hicache_blocks_bad", 0),
        "hicache_writes_dropped_total": stats.get("hicache_writes_dropped", 0),
        "hicache_load_seconds_total": stats.get("hicache_load_seconds", 0.0),
        "hicache_loads_total": stats.get("hicache_loads", 0),
        "hicache_shard_misses_total": stats.get("hicache_shard_misses", 0),  # --tp-size > 1
    }


def load_summary(stats: dict[str, Any], in_flight: int, tokens_per_s: float) -> str:
    """The server's periodic load log line, from the scheduler's stats."""
    total = stats.get("total_slots", 0) or 1
    used = total - stats.get("free_slots", total)
    return (
        f"running={stats.get('running_requests')} waiting={stats.get('waiting_requests')} "
        f"in_flight={in_flight} kv_used={used}/{total} ({100 * used / total:.0f}%, cache "
        f"included) hit={100 * stats.get('cache_hit_rate', 0.0):.0f}% gen={tokens_per_s:.1f} tok/s"
    )
