"""`radixflow diagnose`: which part of the scheduler limits this deployment, and what to tune.

It reads the scheduler's stats (from a live server with `--url`, or after running a named
workload on the given configuration, on the real engine or `--simulate PROFILE`) and names
exactly one primary bottleneck, with its evidence and the flag to change:

  kv       the KV pool: preemptions, admission stopped for KV at high KV use
  batching the --max-running-requests cap stops admission while KV has room
  chunked  the chunked-prefill budget: long prefills among decodes stall inter-token
           latency (chunking off or too coarse), or a small budget delays first tokens
  radix    the radix cache: the hit rate is far below what the prompts allow (cache off,
           or a varying head such as a timestamp in front of a shared prompt)
  none     no scheduler bottleneck: the load itself (a faster device, or more replicas)

Scores are rough severities (>= THRESHOLD counts); the largest wins. SLOs (`--ttft-slo`,
`--itl-slo`, seconds) sharpen the latency findings and give goodput: output tokens/s of the
requests meeting both.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from radixflow import RuntimeEndpoint
from radixflow.lab.cases import config_with_file, run_case
from radixflow.runtime.config.cli import add_config_arguments

THRESHOLD = 0.3
STALL_TOKENS = 256  # a prefill this large beside decodes stalls them (on any device)


@dataclass
class Finding:
    bottleneck: str
    score: float
    evidence: str
    action: str


@dataclass
class Diagnosis:
    primary: Finding
    others: list[Finding]
    figures: dict[str, Any]
    ignored: list[str] = field(default_factory=list)

    def text(self) -> str:
        p = self.primary
        lines = [f"primary bottleneck: {p.bottleneck}", f"  {p.evidence}", f"  -> {p.action}"]
        for f in self.others:
            lines.append(f"also ({f.bottleneck}, score {f.score:.2f}): {f.evidence} -> {f.action}")
        g = self.figures
        lines.append(
            f"figures: {g['requests']} requests, {g['steps']} steps; TTFT p50/p99 "
            f"{_s(g['ttft_p50_s'])}/{_s(g['ttft_p99_s'])}, ITL p50/p99 {_s(g['itl_p50_s'])}/"
            f"{_s(g['itl_p99_s'])}; KV use peak {g['kv_use_peak']:.0%}, waste "
            f"{g['kv_waste_fraction']:.1%}; hit rate {g['cache_hit_rate']:.0%}"
        )
        if g.get("goodput_tokens_per_s") is not None:
            lines.append(
                f"goodput {g['goodput_tokens_per_s']:.1f} of {g['throughput_tokens_per_s']:.1f} "
                f"tokens/s ({g['slo_met']:.0%} of requests meet the SLOs)"
            )
        lines += [f"ignored: {item}" for item in self.ignored]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


def goodput(stats: dict[str, Any], ttft_slo: float | None, itl_slo: float | None) -> dict:
    """Tokens/s of the stats' recent requests, all and those meeting both SLOs."""
    recent = stats.get("recent_requests") or []  # [ttft, itl_p99, tokens, arrival, finish]
    if not recent:
        return {"throughput_tokens_per_s": None, "goodput_tokens_per_s": None, "slo_met": None}
    span = max(r[4] for r in recent) - min(r[3] for r in recent) or 1e-9
    good = [
        r
        for r in recent
        if (ttft_slo is None or r[0] <= ttft_slo)
        and (itl_slo is None or r[1] is None or r[1] <= itl_slo)
    ]
    return {
        "throughput_tokens_per_s": sum(r[2] for r in recent) / span,
        "goodput_tokens_per_s": sum(r[2] for r in good) / span,
        "slo_met": len(good) / len(recent),
    }


def kv_finding(s: dict[str, Any]) -> Finding:
    requests = max(s.get("finished_requests", 0), 1)
    steps = max(s.get("steps_recorded", 0), 1)
    per_1000 = 1000 * s.get("preemptions", 0) / requests
    kv_share = s.get("admission_stop_kv", 0) / steps
    peak = s.get("kv_use_peak", 0.0)
    score = max(per_1000 / 50, kv_share * (2.0 if peak > 0.7 else 0.5))
    return Finding(
        "kv",
        score,
        f"KV: {per_1000:.0f} preemptions per 1,000 requests ({s.get('recomputed_tokens', 0)} "
        f"tokens recomputed) at {peak:.0%} peak KV use; admission stopped for KV in "
        f"{kv_share:.0%} of steps",
        "raise --mem-fraction-static (or --max-total-tokens) or lower --max-running-requests",
    )


def batching_finding(s: dict[str, Any]) -> Finding:
    steps = max(s.get("steps_recorded", 0), 1)
    share = s.get("admission_stop_running_cap", 0) / steps
    peak = s.get("kv_use_peak", 0.0)
    cap = s.get("max_running_requests")
    fit = s.get("requests_fit_avg_context")
    room = f"; KV holds about {fit:.0f} requests of the average context" if fit else ""
    return Finding(
        "batching",
        2 * share * max(0.0, 1 - peak / 0.8),
        f"batching cap: admission stopped at --max-running-requests {cap} in {share:.0%} of "
        f"steps while KV use peaked at {peak:.0%} ({s.get('decode_rows_mean') or 0:.1f} decode "
        f"rows per step){room}",
        "raise --max-running-requests",
    )


def chunked_finding(s: dict[str, Any], ttft_slo: float | None, itl_slo: float | None) -> Finding:
    chunk = s.get("chunked_prefill_size", 0)
    stall = s.get("mixed_prefill_tokens_max", 0)
    p50, p99 = s.get("itl_p50_s"), s.get("itl_p99_s")
    ratio = p99 / p50 if p50 and p99 else 0.0
    over = itl_slo is not None and p99 is not None and p99 > itl_slo
    if stall >= STALL_TOKENS and (ratio > 4 or over):
        score = min(ratio / 10, 1.5) + (0.5 if over else 0.0)
        if chunk is not None and chunk <= 0:
            action = "turn chunked prefill on: --chunked-prefill-size 512"
            how = "chunking off"
        else:
            action = f"lower --chunked-prefill-size (now {chunk}), e.g. to {max(chunk // 2, 64)}"
            how = f"chunks of {chunk}"
        slo = f", over the --itl-slo {itl_slo}s" if over else ""
        return Finding(
            "chunked",
            score,
            f"chunked prefill: ITL p99 {p99:.3f}s is {ratio:.0f}x the median {p50:.3f}s{slo}; "
            f"steps carried up to {stall} prefill tokens beside decodes ({how})",
            action,
        )
    steps = max(s.get("steps_recorded", 0), 1)
    budget_share = s.get("admission_stop_token_budget", 0) / steps
    ttft_p99 = s.get("ttft_p99_s")
    late = ttft_slo is not None and ttft_p99 is not None and ttft_p99 > ttft_slo
    itl_ok = itl_slo is None or (p99 is not None and p99 <= itl_slo / 2)
    return Finding(
        "chunked",
        budget_share * (1.5 if late else 0.3) if itl_ok else 0.0,
        f"prefill budget: admission stopped on the token budget in {budget_share:.0%} of steps"
        + (f"; TTFT p99 {ttft_p99:.3f}s is over the --ttft-slo {ttft_slo}s" if late else ""),
        "raise --chunked-prefill-size and --max-prefill-tokens (ITL has room)",
    )


def radix_finding(s: dict[str, Any], best: float | None) -> Finding:
    hit = s.get("cache_hit_rate", 0.0)
    possible = max(s.get("prefix_hit_rate_possible_est", 0.0), best or 0.0)
    moved = s.get("prefix_hit_rate_head_moved_est", 0.0)
    head = s.get("prefix_varying_head_tokens", 0)
    if s.get("disable_radix_cache") and possible > 0.1:
        return Finding(
            "radix",
            2 * possible,
            f"radix cache off: {possible:.0%} of prompt tokens could come from the cache",
            "drop --disable-radix-cache",
        )
    if moved - max(hit, possible) > 0.2:
        return Finding(
            "radix",
            2 * (moved - hit),
            f"radix cache: hit rate {hit:.0%} (best possible as sent {possible:.0%}), but "
            f"{moved:.0%} of prompt tokens repeat after a varying head of ~{head} tokens (a "
            "timestamp or id in front of a shared prompt)",
            "move per-request content (timestamps, ids) after the shared part of the prompt",
        )
    return Finding(
        "radix",
        2 * (possible - hit - 0.15),
        f"radix cache: hit rate {hit:.0%} of {possible:.0%} possible; "
        f"{s.get('evicted_tokens', 0)} tokens evicted",
        "raise --mem-fraction-static so shared prefixes stay cached",
    )


def diagnose(
    stats: dict[str, Any],
    ttft_slo: float | None = None,
    itl_slo: float | None = None,
    best_hit_rate: float | None = None,
    ignored: list[str] | None = None,
) -> Diagnosis:
    """Name the primary bottleneck of the scheduler whose `stats` these are."""
    findings = [
        kv_finding(stats),
        batching_finding(stats),
        chunked_finding(stats, ttft_slo, itl_slo),
        radix_finding(stats, best_hit_rate),
    ]
    findings.sort(key=lambda f: -f.score)
    figures = {
        "requests": stats.get("finished_requests", 0),
        "steps": stats.get("steps_recorded", 0),
        **{k: stats.get(k) for k in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")},
        "kv_use_peak": stats.get("kv_use_peak", 0.0),
        "kv_waste_fraction": stats.get("kv_waste_fraction", 0.0),
        "cache_hit_rate": stats.get("cache_hit_rate", 0.0),
        "best_hit_rate": best_hit_rate,
        "scores": {f.bottleneck: round(f.score, 3) for f in findings},
        **goodput(stats, ttft_slo, itl_slo),
    }
    real = [f for f in findings if f.score >= THRESHOLD]
    if not real:
        step = stats.get("step_time_p50_s")
        rows = stats.get("decode_rows_mean") or 0.0
        none = Finding(
            "none",
            0.0,
            "no scheduler bottleneck: admission was never held back for long, no "
            f"preemptions, no stalls; the load itself sets the pace (step p50 {_s(step)}, "
            f"{rows:.1f} decode rows per step)",
            "for more speed: a faster device, or more replicas (--dp-size)",
        )
        return Diagnosis(none, [], figures, ignored or [])
    return Diagnosis(real[0], real[1:], figures, ignored or [])


# ---- the command ----------------------------------------------------------------------------


def diagnose_parser(commands: Any) -> None:

    p = commands.add_parser("diagnose", help="name the scheduler's bottleneck and what to tune")
    p.add_argument("--url", help="a live server: tcp://HOST:PORT or http://HOST:PORT")
    # --api-key (a config flag) is also the live server's key; --api-key-url is its old name
    p.add_argument("--api-key-url", dest="api_key", help=argparse.SUPPRESS)
    p.add_argument("--workload", help="run this workload (bench or lab case) on the config")
    p.add_argument("--quick", action="store_true", help="the workload's CI size")
    p.add_argument("--simulate", metavar="PROFILE", help="run the workload in simulate")
    p.add_argument("--config", metavar="JSON", help="a serving config file (SGLang names)")
    p.add_argument("--ttft-slo", type=float, help="seconds")
    p.add_argument("--itl-slo", type=float, help="seconds")
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    add_config_arguments(p)


def diagnose_main(args: argparse.Namespace, unknown: list[str]) -> int:

    flags: list[str] = []
    for token in unknown:  # "--flag value" pairs stay together
        if token.startswith("-") or not flags:
            flags.append(token)
        else:
            flags[-1] += f" {token}"
    ignored = [f"{flag} (radixflow has no such setting)" for flag in flags]
    if args.url:
        stats = read_stats(args.url, args.api_key)
        best = None
    elif args.workload:
        config, more = config_with_file(args)
        ignored += more
        stats, best = run_case(args.workload, config, args.quick, args.simulate)
    else:
        print("radixflow diagnose: give --url or --workload")
        return 2
    result = diagnose(stats, args.ttft_slo, args.itl_slo, best, ignored)
    print(json.dumps(result.as_dict(), indent=1) if args.json else result.text())
    return 0


def read_stats(url: str, api_key: str = "") -> dict[str, Any]:
    """The scheduler stats of a live server: ZeroMQ `stats` (tcp://), or HTTP /server_info's
    internal_states (http://, where the frontend speaks it)."""

    endpoint = RuntimeEndpoint(url, api_key=api_key) if api_key else RuntimeEndpoint(url)
    try:
        return endpoint.stats()
    finally:
        endpoint.close()
