"""Tiny requests through the server's three doors and the offline Engine, side by side, in one run.

    python -m radixflow.bench.server [--requests 1000] [--threads 16] [--max-new-tokens 8]
                                     [--doors zmq,http,chat] [--no-engine]

One server; per door, `--threads` client threads send `--requests` greedy requests (distinct
prompts) and latency is per request as the client sees it: `zmq` through one shared
RuntimeEndpoint (radixflow's ZeroMQ protocol), `http` as POST /generate and `chat` as POST
/v1/chat/completions (the prompt as one user message, so the chat template adds its system
prompt: longer prompts than the other doors) through one shared httpx client. The radix cache
is flushed before each door's turn, so none finds another's prompts cached; the doors take
turns (`--rounds` slices of the prompts each), so drifting background load weighs on all.
Engine: the same requests in one `generate` list call; its latency is each request's
e2e_latency (arrival in the scheduler to finish). The server is shut down before the Engine
loads, so the two never share the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from radixflow import Runtime
from radixflow.runtime import Engine

TOPICS = "rivers stones clouds music paper light bridges trains gardens oceans".split()


def make_prompts(count: int) -> list[str]:
    return [f"Request {i}: one fact about {TOPICS[i % len(TOPICS)]} is" for i in range(count)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(name: str, wall: float, latencies: list[float], tokens: int) -> dict[str, Any]:
    return {
        "name": name,
        "requests": len(latencies),
        "wall_s": wall,
        "requests_per_s": len(latencies) / wall,
        "output_tokens_per_s": tokens / wall,
        "p50_latency_s": statistics.median(latencies),
        "p99_latency_s": percentile(latencies, 0.99),
    }


def door_call(door: str, runtime: Runtime, http: httpx.Client, params: dict) -> Any:
    """A function prompt -> (output ids or text, completion tokens) for one door."""
    if door == "zmq":

        def zmq(prompt: str) -> tuple[Any, int]:
            out = runtime.endpoint.generate(prompt, params)
            return out["output_ids"], out["meta_info"]["completion_tokens"]

        return zmq
    if door == "http":

        def native(prompt: str) -> tuple[Any, int]:
            response = http.post("/generate", json={"text": prompt, "sampling_params": params})
            response.raise_for_status()
            out = response.json()
            return out["output_ids"], out["meta_info"]["completion_tokens"]

        return native

    def chat(prompt: str) -> tuple[Any, int]:
        body = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": params["max_new_tokens"],
            "temperature": 0,
            "ignore_eos": True,
        }
        response = http.post("/v1/chat/completions", json=body)
        response.raise_for_status()
        out = response.json()
        return out["choices"][0]["message"]["content"], out["usage"]["completion_tokens"]

    return chat


def bench_server(
    prompts: list[str], params: dict, threads: int, config: dict, doors: list[str], rounds: int
) -> tuple[list[dict[str, Any]], list[Any]]:
    """The doors take turns, `rounds` slices of the prompts each, so a machine whose
    background load drifts during the run weighs on every door alike."""
    limits = httpx.Limits(max_connections=threads, max_keepalive_connections=threads)
    walls = {d: 0.0 for d in doors}
    results: dict[str, list[tuple[float, Any, int]]] = {d: [] for d in doors}
    steps = {d: 0 for d in doors}
    size = -(-len(prompts) // rounds)
    with (
        Runtime(log_level="warning", **config) as runtime,
        httpx.Client(base_url=runtime.url, timeout=600, limits=limits) as http,
    ):
        calls = {d: door_call(d, runtime, http, params) for d in doors}
        for call in calls.values():
            call("warm up")
        for first in range(0, len(prompts), size):
            for door in doors:
                runtime.endpoint.flush_cache()  # no door finds another's prompts cached

                def one(prompt: str, call: Any = calls[door]) -> tuple[float, Any, int]:
                    start = time.perf_counter()
                    out, tokens = call(prompt)
                    return time.perf_counter() - start, out, tokens

                before = runtime.endpoint.stats()["forward_steps"]
                start = time.perf_counter()
                with ThreadPoolExecutor(threads) as pool:
                    results[door] += pool.map(one, prompts[first : first + size])
                walls[door] += time.perf_counter() - start
                steps[door] += runtime.endpoint.stats()["forward_steps"] - before
            done = min(first + size, len(prompts))
            so_far = "  ".join(
                f"{d} {len(results[d]) / walls[d]:.2f} req/s p50 "
                f"{statistics.median(r[0] for r in results[d]):.2f}s"
                for d in doors
            )
            print(f"after {done} requests per door: {so_far}", file=sys.stderr, flush=True)
    rows = []
    for door in doors:
        latencies = [r[0] for r in results[door]]
        tokens = sum(r[2] for r in results[door])
        row = summarize(f"server {door} ({threads} clients)", walls[door], latencies, tokens)
        row["forward_steps"] = steps[door]
        rows.append(row)
    zmq_ids = [out for _, out, _ in results.get("zmq", [])]
    return rows, zmq_ids


def bench_engine(prompts: list[str], params: dict, config: dict) -> tuple:
    with Engine(**config) as engine:
        engine.generate("warm up", params)
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        wall = time.perf_counter() - start
        steps = engine.stats()["forward_steps"]
    latencies = [out["meta_info"]["e2e_latency"] for out in outs]
    tokens = sum(out["meta_info"]["completion_tokens"] for out in outs)
    row = summarize("engine (one list call)", wall, latencies, tokens)
    row["forward_steps"] = steps
    return row, [out["output_ids"] for out in outs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--max-total-tokens", type=int, default=32768)
    parser.add_argument(
        "--num-threads", type=int, default=1, help="torch threads (0 = torch's default)"
    )
    parser.add_argument("--doors", default="zmq,http,chat", help="comma-separated: zmq,http,chat")
    parser.add_argument("--rounds", type=int, default=10, help="turns the doors take")
    parser.add_argument("--no-engine", action="store_true", help="skip the offline Engine row")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    prompts = make_prompts(args.requests)
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}
    config = {"max_total_tokens": args.max_total_tokens, "num_threads": args.num_threads}
    load_before = os.getloadavg()[0]
    doors = args.doors.split(",")
    rows, server_ids = bench_server(prompts, params, args.threads, config, doors, args.rounds)
    same = None
    if not args.no_engine:
        engine_row, engine_ids = bench_engine(prompts, params, {"model": "smollm2", **config})
        rows.append(engine_row)
        if server_ids:
            same = sum(a == b for a, b in zip(server_ids, engine_ids))
    if args.json:
        print(json.dumps({"rows": rows, "identical_outputs": same, **config}, indent=2))
        return 0
    print(
        f"{args.requests} requests, {args.max_new_tokens} new tokens each, greedy, "
        f"num_threads={args.num_threads}, load average {load_before:.1f} -> "
        f"{os.getloadavg()[0]:.1f}"
    )
    print(f"{'':30} {'req/s':>8} {'tok/s':>8} {'p50 s':>8} {'p99 s':>8} {'wall s':>8} {'steps':>6}")
    for r in rows:
        print(
            f"{r['name']:30} {r['requests_per_s']:8.1f} {r['output_tokens_per_s']:8.1f} "
            f"{r['p50_latency_s']:8.3f} {r['p99_latency_s']:8.3f} {r['wall_s']:8.1f} "
            f"{r['forward_steps']:6d}"
        )
    if same is not None:
        print(f"identical outputs (zmq vs engine): {same}/{args.requests}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
