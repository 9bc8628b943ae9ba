"""Throughput beside a busy process: each system quiet and with one core taken, on the two
loads issue 35 names, interleaved round by round.

    python -m radixflow.bench.contention [--systems radixflow,radixflow-fixed,llama.cpp]
        [--programs 32] [--streams 32] [--new-tokens 64] [--pool 3072] [--repeats 3]
        [--conditions quiet,hog] [--loads programs,independent]

- `programs`: 32 chats of 4 turns (bench/workloads.py's multi_turn, 32 new tokens a turn)
  run as `@function` programs through the DSL against a live server with a 3,072-token KV
  pool, so the pool runs full and requests are preempted, as in the issue's report. The
  client has no timeout (the DSL's default): a program that fails is counted, not retried.
- `independent`: `--streams` unrelated prompts, `--new-tokens` greedy tokens each, through
  the same server.
- Systems: radixflow (the GGUF's blocks, the default settings, so `--num-threads auto`),
  radixflow-fixed (the same with `--num-threads` fixed at the core count: the default before
  issue 35), radixflow-fp32 (the file dequantised to fp32, `--dequantize-weights`, fixed
  threads: the path the issue measured collapsing), llama.cpp (its worker in its own venv,
  `BENCH_LLAMA_CPP_PYTHON`, with the same thread count; it runs the programs' rounds, the
  same prompts and token counts, since it has no DSL).
- A further lever: radixflow-passive (fixed threads, the server started with
  `OMP_WAIT_POLICY=PASSIVE`).
- Conditions: quiet, and `hog`: one `python -c "while True: pass"` started 2 s before the
  timed pass and stopped after it. Each repeat runs every (condition, load, system) once,
  the systems in a rotated order; round 0 warms every system up and is not counted. Rows
  report the median tokens/s, the share of the quiet median kept, and failed programs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any

from radixflow.bench.harness import Hog, run_workload
from radixflow.bench.quantized import _cpu
from radixflow.bench.workloads import (
    Workload,
    independent,
    multi_turn,
    program_workload,
    server_codec,
)

SYSTEMS = ("radixflow", "radixflow-fixed", "llama.cpp")


class ServerSystem:
    """A `radixflow serve` process driven through the DSL (bench/dsl.py's programs)."""

    def __init__(self, name: str, model: str, threads: int, **options: Any) -> None:
        from radixflow.bench.dsl import DslSystem  # noqa: PLC0415 (torch: only when it runs)

        self.name = name
        self.dsl = DslSystem(model, threads, name=name, log_level="warning", **options)

    def run(self, workload: Workload) -> tuple[int, int, float]:
        """-> (output tokens, failed programs, wall seconds), from a cold cache."""
        from radixflow.bench.dsl import run_programs  # noqa: PLC0415 (torch: only when it runs)

        self.dsl.endpoint.flush_cache()
        start = time.perf_counter()
        states = run_programs(workload.programs, self.dsl.runtime)
        wall = time.perf_counter() - start
        tokens, failed = 0, 0
        for state in states:
            if state.error() is not None:
                failed += 1
                continue
            tokens += sum(r["tokens"] for round_ in state.ret_value for r in round_)
        return tokens, failed, wall

    def warm_up(self) -> None:
        self.dsl.warm_up()

    def close(self) -> None:
        self.dsl.close()


class WorkerRounds:
    """A peer's worker replaying the programs' rounds (the harness's token-level form)."""

    def __init__(self, system: Any) -> None:
        self.name, self.system = system.name, system

    def run(self, workload: Workload) -> tuple[int, int, float]:
        row = run_workload(self.system, workload, {})
        return row["output_tokens"], 0, row["wall_s"]

    def warm_up(self) -> None:
        pass  # round 0 of the bench warms it

    def close(self) -> None:
        self.system.close()


def make_systems(args: argparse.Namespace, threads: int) -> dict[str, Any]:
    from radixflow.bench import baselines  # noqa: PLC0415 (torch: only when the bench runs)
    from radixflow.runtime.models.loader import BUILTIN_MODELS, builtin_gguf  # noqa: PLC0415 (torch)

    pool = {"max_total_tokens": args.pool}
    systems: dict[str, Any] = {}
    for name in args.systems.split(","):
        if name == "radixflow":  # the defaults: --num-threads auto
            systems[name] = ServerSystem(name, args.model, 0, **pool)
        elif name == "radixflow-fixed":  # every core, whatever else runs
            systems[name] = ServerSystem(name, args.model, threads, **pool)
        elif name == "radixflow-passive":  # OpenMP threads sleep at once when they wait
            os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
            try:
                systems[name] = ServerSystem(name, args.model, threads, **pool)
            finally:
                del os.environ["OMP_WAIT_POLICY"]
        elif name == "radixflow-fp32":
            systems[name] = ServerSystem(name, args.model, threads, dequantize_weights=True, **pool)
        elif name == "llama.cpp" and os.environ.get("BENCH_LLAMA_CPP_PYTHON"):
            gguf = builtin_gguf(args.model) if args.model in BUILTIN_MODELS else args.model
            worker_args = {"model_path": str(gguf), "n_ctx": 8192, "threads": threads}
            python = os.environ["BENCH_LLAMA_CPP_PYTHON"]
            systems[name] = WorkerRounds(baselines.WorkerSystem(name, python, worker_args))
        else:
            print(f"skipped {name}: unknown, or BENCH_LLAMA_CPP_PYTHON unset", flush=True)
    return systems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m radixflow.bench.contention")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--loads", default="programs,independent")
    parser.add_argument("--programs", type=int, default=32, help="chats in the programs load")
    parser.add_argument("--streams", type=int, default=32, help="prompts in independent")
    parser.add_argument("--new-tokens", type=int, default=64, help="per independent stream")
    parser.add_argument("--pool", type=int, default=3072, help="the servers' KV pool, tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="0: every core")
    parser.add_argument("--conditions", default="quiet,hog", help="quiet, hog or both")
    parser.add_argument("--json", metavar="PATH", help="also write the rows here")
    args = parser.parse_args(argv)

    from radixflow.runtime.models.loader import resolve_model_dir  # noqa: PLC0415 (torch)
    from radixflow.runtime.tokenizer import load_tokenizer  # noqa: PLC0415 (torch)

    threads = args.threads or os.cpu_count() or 1
    codec = server_codec(load_tokenizer(resolve_model_dir(args.model)))

    def make(load: str) -> Workload:  # a fresh generator of rounds for every pass
        if load == "programs":
            return multi_turn(codec, False, num_chats=args.programs)
        workload = independent(codec, False, num_prompts=args.streams)
        steps = [
            (text, dataclasses.replace(gen, new=args.new_tokens)) for text, gen in workload.programs
        ]
        return program_workload(workload.name, steps, codec)

    loads = args.loads.split(",")
    systems = make_systems(args, threads)
    print(json.dumps({"cpu": _cpu(), "threads": threads, "load_average": os.getloadavg()}))
    conditions = tuple(args.conditions.split(","))
    runs: dict[tuple[str, str, str], list[tuple[int, int, float]]] = {}
    hog = Hog()
    try:
        for system in systems.values():
            system.warm_up()
        for repeat in range(args.repeats + 1):  # repeat 0 warms up, quiet only
            for condition in conditions if repeat else ("quiet",):
                hog.set(condition == "hog")
                for load in loads:
                    for name, system in rotated(list(systems.items()), repeat):
                        result = system.run(make(load))
                        print(json.dumps({"repeat": repeat, "condition": condition,
                                          "load": load, "system": name,
                                          "tokens": result[0], "failed": result[1],
                                          "wall_s": round(result[2], 2)}), flush=True)  # fmt: skip
                        if repeat:
                            runs.setdefault((load, name, condition), []).append(result)
                hog.set(False)
    finally:
        hog.set(False)
        for system in systems.values():
            system.close()
    rows = summarise(runs)
    for row in rows:
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": _cpu(), "threads": threads, "rows": rows}, f, indent=1)
    return 0


def rotated(items: list, by: int) -> list:
    """The systems in a different order each repeat, so none always runs first."""
    by %= max(1, len(items))
    return items[by:] + items[:by]


def summarise(runs: dict[tuple[str, str, str], list[tuple[int, int, float]]]) -> list[dict]:
    """Per (load, system, condition): median tokens/s over the repeats, failed programs
    summed, and the share of the quiet median kept."""
    rows = []
    for (load, name, condition), results in runs.items():
        rates = [tokens / wall for tokens, _, wall in results]
        row = {
            "load": load,
            "system": name,
            "condition": condition,
            "tokens_per_s": round(statistics.median(rates), 1),
            "runs_tokens_per_s": [round(r, 1) for r in rates],
            "failed_programs": sum(f for _, f, _ in results),
        }
        quiet = runs.get((load, name, "quiet"))
        if condition != "quiet" and quiet:
            quiet_rate = statistics.median(t / w for t, _, w in quiet)
            row["share_of_quiet"] = round(row["tokens_per_s"] / quiet_rate, 2)
        rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(main())
