"""Data-parallel replicas behind sglang-router: routing policies side by side, in one run.

    python -m radixflow.bench.router [--quick] [--programs 8] [--json out.json]
                                     [--policies cache_aware,round_robin]
                                     [--workloads few_shot,agent,multi_turn]

Setups, one after the other on this machine: one replica (all cores) behind sglang-router,
then, per policy, `--dp-size 2` replicas (1 thread each) behind it. Every setup runs the
`radixflow bench` program workloads (bench/workloads.py's programs through bench/dsl.py's
@function, greedy; the first `--programs` programs of each, full size unless `--quick`)
through the router URL with `RuntimeEndpoint`, one client thread per program, from a cold
cache (the router fans /flush_cache out). The single replica sits behind the router too, so
every setup sends the same requests (select scores through /generate there as well). The
digest is a hash of the programs' outputs (texts and chosen options): equal digests, equal outputs.

Figures per (setup, workload): wall time and output tokens/s; the cache hit rate as the
replicas count it, cached / prompt tokens summed over every replica's /server_info (these
count every request the programs sent, select's scoring requests included); prefill tokens
computed; and the share of requests each replica served.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from typing import Any

import httpx

import radixflow as sgl
from radixflow.bench import dsl, workloads
from radixflow.runtime.config import ServerConfig
from radixflow.runtime.distributed.data_parallel import DataParallel
from radixflow.runtime.models.loader import resolve_model_dir
from radixflow.runtime.tokenizer import load_tokenizer

WORKLOADS = ("few_shot", "agent", "multi_turn")
COUNTERS = ("prompt_tokens", "cached_tokens", "prefill_tokens_computed", "request_generate")


def worker_urls(router_url: str, api_key: str = "") -> list[str]:
    """The replicas the router has registered (its /workers route)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    workers = httpx.get(f"{router_url}/workers", headers=headers, timeout=10).json()["workers"]
    return sorted(w["url"] for w in workers)


def replica_counters(urls: list[str], api_key: str = "") -> list[dict[str, int]]:
    """Per replica: prompt, cached and computed prefill tokens, generate requests so far."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out = []
    for url in urls:
        info = httpx.get(f"{url}/server_info", headers=headers, timeout=10).json()
        stats = info["internal_states"][0]
        server = stats.get("server", {})
        out.append({k: int(stats.get(k, server.get(k, 0)) or 0) for k in COUNTERS})
    return out


def run_workload(
    url: str,
    name: str,
    quick: bool,
    api_key: str = "",
    replicas: list[str] | None = None,
    num_programs: int = 0,
    timeout: float = 900.0,
) -> dict[str, Any]:
    """Run one bench workload's programs (the first `num_programs`; 0 = all) through `url`
    (a router, or one server with `replicas=[url]`); its row, with `per_program`: what each
    program returned, round by round."""
    codec = workloads.server_codec(load_tokenizer(resolve_model_dir("smollm2")))
    programs = workloads.WORKLOADS[name](codec, quick).programs
    programs = programs[:num_programs] if num_programs else programs
    endpoint = sgl.RuntimeEndpoint(url, api_key=api_key or None, timeout=timeout)
    urls = worker_urls(url, api_key) if replicas is None else replicas
    try:
        endpoint.flush_cache()
        before = replica_counters(urls, api_key)
        start = time.perf_counter()
        states = dsl.run_programs(programs, endpoint)
        wall = time.perf_counter() - start
        after = replica_counters(urls, api_key)
    finally:
        endpoint.close()
    errors = [repr(s.error()) for s in states if s.error() is not None]
    if errors:
        raise RuntimeError(f"{name}: {len(errors)} programs failed, first: {errors[0]}")
    per_program = [s.ret_value for s in states]
    outputs = [o for program in per_program for step in program for o in step]
    output_tokens = sum(o["tokens"] for o in outputs if isinstance(o, dict))
    delta = [{k: a[k] - b[k] for k in COUNTERS} for a, b in zip(after, before)]
    prompt = sum(d["prompt_tokens"] for d in delta)
    requests = sum(d["request_generate"] for d in delta) or 1
    return {
        "workload": name,
        "programs": len(programs),
        "wall_s": wall,
        "output_tokens": output_tokens,
        "tokens_per_s": output_tokens / wall,
        "programs_per_s": len(programs) / wall,
        "server_hit_rate": sum(d["cached_tokens"] for d in delta) / prompt if prompt else 0.0,
        "prompt_tokens": prompt,
        "prefill_tokens": sum(d["prefill_tokens_computed"] for d in delta),
        "request_share": [round(d["request_generate"] / requests, 3) for d in delta],
        "output_digest": hashlib.sha256(json.dumps(per_program).encode()).hexdigest()[:16],
        "per_program": per_program,
    }


def start_setup(replicas: int, policy: str, threads: int) -> DataParallel:
    config = ServerConfig(
        port=0,
        dp_size=replicas,
        router_policy=policy,
        threads_per_replica=threads,
        max_total_tokens=16384,
    )
    supervisor = DataParallel(config, "warning")
    supervisor.start()
    return supervisor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the bench's quick sizes")
    parser.add_argument("--policies", default="cache_aware,round_robin")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--programs", type=int, default=8, help="programs per workload; 0 = all")
    parser.add_argument("--json", default="", help="also write the rows here")
    args = parser.parse_args(argv)
    cores = os.cpu_count() or 1
    setups = [("1 replica", 1, "cache_aware", cores)]
    setups += [(f"2 x {p}", 2, p, max(1, cores // 2)) for p in args.policies.split(",")]
    rows: list[dict[str, Any]] = []
    for label, replicas, policy, threads in setups:
        print(f"starting {label} ({threads} thread(s) per replica)", file=sys.stderr, flush=True)
        supervisor = start_setup(replicas, policy, threads)
        try:
            for name in args.workloads.split(","):
                row = run_workload(supervisor.url, name, args.quick, num_programs=args.programs)
                row.update(setup=label, policy=policy, replicas=replicas)
                rows.append(row)
                print(format_row(row), file=sys.stderr, flush=True)
        finally:
            supervisor.stop()
    report(rows)
    if args.json:
        meta = {"load_average": os.getloadavg(), "cores": cores, "quick": args.quick}
        clean = [{k: v for k, v in r.items() if k != "per_program"} for r in rows]
        with open(args.json, "w") as f:
            json.dump({"machine": meta, "rows": clean}, f, indent=1)
    return 0


def format_row(row: dict[str, Any]) -> str:
    return (
        f"| {row['setup']} | {row['workload']} | {row['wall_s']:.1f} | "
        f"{row['tokens_per_s']:.1f} | {100 * row['server_hit_rate']:.1f}% | "
        f"{row['prefill_tokens']} | {row['request_share']} | {row['output_digest'][:8]} |"
    )


def report(rows: list[dict[str, Any]]) -> None:
    single = {r["workload"]: r for r in rows if r["replicas"] == 1}
    print("| setup | workload | wall s | out tok/s | hit rate | prefill | requests/replica | out |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- | --- |")
    for row in rows:
        base = single.get(row["workload"])
        same = " (reference)" if base is row else ""
        if base is not None and base is not row:
            same = " (= 1 replica)" if row["output_digest"] == base["output_digest"] else " (!=)"
        print(format_row(row).rstrip(" |") + same + " |")
    print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    raise SystemExit(main())
