"""agent_restart: a local agent's long prompt (system prompt, tool list, few-shot block)
re-sent by every run of the agent, each run a new server process.

    radixflow bench --workloads agent_restart [--quick] [--systems radixflow,llama.cpp]
    python -m radixflow.bench.agent_restart [--quick] [--runs 4] [--json PATH]

Per system, `--runs` process lifetimes: each starts the server (or peer) fresh, sends one task
(the shared prefix plus a task of its own, greedy, `NEW_TOKENS` tokens) and stops it. The first
run is cold; later runs come after a restart. Reported per system: time to first token cold
and after restart (median of the later runs), prompt tokens, prefill tokens computed and
saved after restart. Systems:
- radixflow: `radixflow serve --enable-hierarchical-cache` on a fresh directory (stopped with
  SIGTERM between runs), through its public endpoint; TTFT is the server's (meta_info.ttft).
- radixflow-nohicache: the same server without the disk tier (a restart forgets the cache).
- llama.cpp (BENCH_LLAMA_CPP_PYTHON = a venv's python with llama-cpp-python): a fresh worker
  (bench/peers.py) per run; it keeps no cache across processes, so it recomputes.
Machine-dependent figures: run on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from typing import Any

from radixflow import Runtime
from radixflow.bench import baselines
from radixflow.bench.workloads import WORDS, Call, server_codec
from radixflow.runtime.models.loader import builtin_gguf, resolve_model_dir
from radixflow.runtime.tokenizer import load_tokenizer

SYSTEMS = ("radixflow", "radixflow-nohicache", "llama.cpp")
NEW_TOKENS = 16


def agent_prompts(codec: Any, runs: int, quick: bool) -> list[list[int]]:
    """The shared prefix (about 2,000 tokens; 400 quick) and one task per run, as ids."""
    tools = [
        f"- tool_{i}({WORDS[i % len(WORDS)]}: string, {WORDS[(3 * i) % len(WORDS)]}: int): "
        f"looks up the {WORDS[(7 * i) % len(WORDS)]} of a {WORDS[(11 * i) % len(WORDS)]}."
        for i in range(12 if quick else 60)
    ]
    shots = [
        f"Example {i}: user asks about the {WORDS[i % len(WORDS)]}; assistant calls "
        f"tool_{i % 12} and answers in one sentence."
        for i in range(8 if quick else 40)
    ]
    prefix = (
        "<|im_start|>system\nYou are a local agent. Use the tools below when they help.\n"
        + "\n".join(tools + shots)
        + "<|im_end|>\n"
    )
    tasks = [
        f"<|im_start|>user\nRun {r}: find the {WORDS[(5 * r) % len(WORDS)]} of the "
        f"{WORDS[(13 * r) % len(WORDS)]}.<|im_end|>\n<|im_start|>assistant\n"
        for r in range(runs)
    ]
    return [codec.encode(prefix + task) for task in tasks]


def run_radixflow(model: str, prompts: list[list[int]], hicache: bool) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="radixflow-agent-restart-") as store:
        config = {"enable_hierarchical_cache": True, "hicache_storage_dir": store}
        for ids in prompts:
            with Runtime(model, log_level="warning", **(config if hicache else {})) as rt:
                sampling = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
                meta = rt.endpoint.generate(input_ids=ids, sampling_params=sampling)["meta_info"]
            rows.append(
                {
                    "ttft": meta["ttft"],
                    "prompt_tokens": len(ids),
                    "cached_tokens": meta["cached_tokens"],
                    "cached_tokens_disk": meta.get("cached_tokens_disk", 0),
                }
            )
    return rows


def run_llama_cpp(model: str, prompts: list[list[int]]) -> list[dict[str, Any]]:
    python = os.environ.get("BENCH_LLAMA_CPP_PYTHON")
    if not python:
        raise SystemExit("llama.cpp: set BENCH_LLAMA_CPP_PYTHON to its venv's python")
    args = {"model_path": str(builtin_gguf(model)), "n_ctx": 8192, "threads": os.cpu_count()}
    rows = []
    for ids in prompts:
        peer = baselines.WorkerSystem("llama.cpp", python, args)  # a fresh process per run
        try:
            peer.start_workload()
            result = peer.run_round([Call(tuple(ids), NEW_TOKENS)])
        finally:
            peer.close()
        rows.append(
            {
                "ttft": result.ttfts[0],
                "prompt_tokens": len(ids),
                "cached_tokens": result.cached_tokens,
                "cached_tokens_disk": 0,
            }
        )
    return rows


def summary(name: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    later = rows[1:]
    saved = statistics.median(r["cached_tokens"] for r in later) if later else 0
    return {
        "system": name,
        "ttft_cold_s": rows[0]["ttft"],
        "ttft_after_restart_s": statistics.median(r["ttft"] for r in later) if later else None,
        "prompt_tokens": rows[0]["prompt_tokens"],
        "prefill_tokens_saved_after_restart": saved,
        "from_disk_after_restart": statistics.median(r["cached_tokens_disk"] for r in later)
        if later
        else 0,
        "runs": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixflow bench --workloads agent_restart")
    parser.add_argument("--quick", action="store_true", help="a 400-token prefix, 2 runs")
    parser.add_argument("--runs", type=int, default=0, help="process lifetimes (default 4)")
    parser.add_argument("--systems", default="all", help=f"comma-separated: {SYSTEMS}")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    args = parser.parse_args(argv)
    names = list(SYSTEMS) if args.systems == "all" else args.systems.split(",")
    if "llama.cpp" in names and not os.environ.get("BENCH_LLAMA_CPP_PYTHON"):
        print("llama.cpp: skipped (set BENCH_LLAMA_CPP_PYTHON)", file=sys.stderr)
        names.remove("llama.cpp")
    codec = server_codec(load_tokenizer(resolve_model_dir(args.model)))
    prompts = agent_prompts(codec, args.runs or (2 if args.quick else 4), args.quick)
    results = []
    for name in names:
        if name == "llama.cpp":
            rows = run_llama_cpp(args.model, prompts)
        elif name in ("radixflow", "radixflow-nohicache"):
            rows = run_radixflow(args.model, prompts, hicache=name == "radixflow")
        else:
            raise SystemExit(f"agent_restart: unknown system {name!r}; known: {SYSTEMS}")
        results.append(summary(name, rows))
    print(f"{'system':<22}{'ttft cold':>11}{'ttft restart':>14}{'prompt':>8}{'saved':>8}")
    for r in results:
        after = r["ttft_after_restart_s"]
        print(
            f"{r['system']:<22}{r['ttft_cold_s']:>10.3f}s"
            f"{(f'{after:.3f}s' if after is not None else '-'):>14}"
            f"{r['prompt_tokens']:>8}{r['prefill_tokens_saved_after_restart']:>8}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
