"""`radixflow bench`: the SGLang-style workloads on radixflow and its baselines, in one run.

    radixflow bench [--quick] [--json PATH] [--plot PATH] [--workloads a,b] [--systems x,y]
    radixflow bench --from-json docs/bench-results.json --plot docs/bench-results.png
    radixflow bench --workloads json_decode --systems radixflow,vllm --repeats 3
    radixflow bench --workloads agent_restart [--quick]   (bench/agent_restart.py)

Workloads are bench/workloads.py: rounds of calls with fixed token counts (greedy, EOS
ignored), each round built from the previous round's outputs, so every system does equal work.
Systems: radixflow (the Engine through its public API, default config); radixflow-dsl (the
same workloads as `@function` programs over a live server: frontend and wire included; every
workload but long_mix); radixflow-nocache (radix cache off); radixflow-nojump (jump-forward
decoding off: what it saves on constrained workloads); transformers (`generate` per
round, batched with left padding, no reuse: a naive server); transformers-cb (transformers'
continuous batching manager, block sharing on); llama.cpp and vllm through a worker in their
own virtual environment (`BENCH_LLAMA_CPP_PYTHON`, `BENCH_VLLM_PYTHON` = that venv's python),
skipped when unset. On long_mix it also compares the scheduler modes: static batching
(waves), continuous, continuous + chunked prefill.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
from pathlib import Path
from typing import Any

import torch
import transformers
from tqdm import tqdm

from radixflow.bench import agent_restart, baselines
from radixflow.bench import report as out
from radixflow.bench.dsl import DslSystem
from radixflow.bench.engine import SCHEDULER_MODES, RadixflowSystem
from radixflow.bench.harness import run_workload, wait_until_quiet, warm_up
from radixflow.bench.roofline import best_of, compute_roofline
from radixflow.bench.rounds import BenchError
from radixflow.bench.workloads import WORKLOADS, Workload, server_codec
from radixflow.runtime.engine import Engine
from radixflow.runtime.models.loader import (
    BUILTIN_MODELS,
    builtin_gguf,
    resolve_model_dir,
    weight_files,
)
from radixflow.runtime.tokenizer import load_tokenizer

SYSTEMS = (
    "radixflow",
    "radixflow-dsl",
    "radixflow-nocache",
    "radixflow-nojump",
    "transformers",
    "transformers-cb",
    "llama.cpp",
    "vllm",
)
WORKER_ENV = {"llama.cpp": "BENCH_LLAMA_CPP_PYTHON", "vllm": "BENCH_VLLM_PYTHON"}


class Models:
    """Loads each stack once, on first use, and frees it when no later system needs it."""

    def __init__(self, model: str, model_dir: Path, threads: int) -> None:
        self.model, self.model_dir, self.threads = model, model_dir, threads
        self.engine: Any = None
        self.hf: Any = None

    def radixflow(self) -> Any:
        if self.engine is None:
            self.engine = Engine(model=self.model)
        return self.engine

    def fp32_dir(self) -> Path:
        """The model's directory with safetensors weights, for peers that read only those
        (transformers, vLLM): radixflow keeps a GGUF in its blocks and writes no fp32 copy
        unless asked, so a fresh machine's directory has none until this call."""
        weight_files(self.model_dir)
        return self.model_dir

    def transformers(self) -> tuple[Any, int]:
        if self.hf is None:
            transformers.logging.set_verbosity_error()
            transformers.utils.logging.disable_progress_bar()
            self.hf = transformers.AutoModelForCausalLM.from_pretrained(
                self.fp32_dir(), dtype=torch.float32
            ).eval()
        pad = self.hf.generation_config.pad_token_id
        return self.hf, pad if pad is not None else 0

    def release(self, remaining: list[str]) -> None:

        needs_engine = {"radixflow", "radixflow-nocache", "radixflow-nojump"} & set(remaining)
        if not needs_engine and self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if not any(s.startswith("transformers") for s in remaining):
            self.hf = None
        gc.collect()


def make_system(name: str, models: Models) -> Any:
    """The system `name`; raises BenchError (with the reason) when it cannot run here."""

    if name == "radixflow":
        return RadixflowSystem(name, models.radixflow(), owned=False)
    if name == "radixflow-dsl":
        return DslSystem(models.model, models.threads)
    if name in ("radixflow-nocache", "radixflow-nojump"):
        off = "disable_radix_cache" if name == "radixflow-nocache" else "disable_jump_forward"
        return RadixflowSystem(name, models.radixflow().with_config(**{off: True}), owned=True)
    if name == "transformers":
        return baselines.TransformersSystem(*models.transformers())
    if name == "transformers-cb":
        try:
            return baselines.TransformersCBSystem(*models.transformers())
        except ImportError as e:
            raise BenchError(f"skipped: this transformers has no continuous batching ({e})") from e
    python = os.environ.get(WORKER_ENV[name])
    if not python:
        raise BenchError(f"skipped: not installed (set {WORKER_ENV[name]} to its venv's python)")
    if name == "llama.cpp":
        if models.model not in BUILTIN_MODELS and not models.model.endswith(".gguf"):
            raise BenchError("skipped: llama.cpp needs a GGUF model")
        gguf = builtin_gguf(models.model) if models.model in BUILTIN_MODELS else models.model
        threads = models.threads or os.cpu_count()
        args = {"model_path": str(gguf), "n_ctx": 8192, "threads": threads}
        return baselines.WorkerSystem(name, python, args)
    args = {"model_path": str(models.fp32_dir()), "max_model_len": 8192}
    return baselines.WorkerSystem(name, python, args)


def run_scheduler_modes(engine: Any, make: Any) -> list[dict[str, Any]]:
    """long_mix under static batching (waves), continuous, and continuous + chunked prefill."""

    rows = []
    for mode, changes in SCHEDULER_MODES.items():
        engine_for_mode = engine.with_config(**changes)
        system = RadixflowSystem(mode, engine_for_mode, owned=True, static_waves=mode == "static")
        try:
            rows.append(run_workload(system, make("long_mix"), {}))
        finally:
            system.close()
    return rows


def run_system(
    system: Any, workloads: list[str], make: Any, references: dict, progress: Any
) -> tuple[list[dict[str, Any]], list[str]]:
    """One system on every workload it has a form for -> (rows, workloads it skipped)."""

    rows, skipped = [], []
    for name in workloads:
        progress.set_postfix_str(name)
        row = run_one(system, make(name), references)
        if row is None:
            skipped.append(name)
        else:
            rows.append(row)
        progress.update()
    return rows, skipped


def run_one(system: Any, workload: Workload, references: dict) -> dict[str, Any] | None:
    """One workload on one system; None where the DSL system has no program form for it."""
    if system.name != "radixflow-dsl":
        return run_workload(system, workload, references)
    # a program form: the DSL runs the same definition
    return system.run_workload(workload) if workload.programs else None


def warm_system(system: Any, warm: Any) -> None:
    """One tiny untimed call (the DSL system: its own warm-up program)."""
    if system.name == "radixflow-dsl":
        system.warm_up()
    else:
        warm_up(system, dataclasses.replace(warm, max_new_tokens=4))


def run_all(
    systems: list[str], workloads: list[str], models: Models, make: Any, with_modes: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, str]]]:
    """Every system on every workload, one system at a time (its stack loaded once), with a
    progress bar. -> (rows, scheduler-mode rows, skipped systems with the reason)."""

    modes = with_modes and "radixflow" in systems and "long_mix" in workloads
    rows, mode_rows, skipped, references = [], [], [], {}
    progress = tqdm(total=len(systems) * len(workloads) + 3 * modes, file=sys.stderr)
    warm = make("few_shot").rounds.send(None)[0]  # a first call: untimed warm-up
    for k, name in enumerate(systems):
        progress.set_description(name)
        try:
            system = make_system(name, models)
        except BenchError as e:
            skipped.append({"system": name, "reason": str(e)})
            progress.update(len(workloads))
            continue
        try:
            warm_system(system, warm)
            done, without = run_system(system, workloads, make, references, progress)
            rows += done
            if without:
                reason = f"no program form for {', '.join(without)} (see bench/dsl.py)"
                skipped.append({"system": name, "reason": reason})
            if name == "radixflow" and modes:
                progress.set_postfix_str("scheduler modes")
                mode_rows = run_scheduler_modes(system.engine, make)
                progress.update(3)
        except BenchError as e:
            skipped.append({"system": name, "reason": f"failed: {e}"})
        finally:
            system.close()
            models.release(systems[k + 1 :])
    progress.close()
    return rows, mode_rows, skipped


def run_interleaved(
    systems: list[str], workloads: list[str], models: Models, make: Any, repeats: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, str]]]:
    """Every system loaded and warmed at once, then `repeats` passes, each running every
    workload on every system in turn (the order rotating by pass), so a slow minute of the
    machine lands on all of them; each row is the repeat with the median wall time, with every
    repeat's wall in `runs_wall_s`. Before each run it waits for a quiet machine (at least a
    second), so the last system's spinning threads (OpenMP, vLLM's worker, llama.cpp's pool)
    are idle first (`wait_until_quiet`)."""

    made, skipped, references = {}, [], {}
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    progress = tqdm(total=len(systems) * (1 + repeats * len(workloads)), file=sys.stderr)
    warm = make("few_shot").rounds.send(None)[0]
    try:
        for name in systems:
            progress.set_description(f"load {name}")
            progress.update()
            try:
                system = make_system(name, models)
            except BenchError as e:
                skipped.append({"system": name, "reason": str(e)})
                continue
            try:
                warm_system(system, warm)
            except BenchError as e:
                system.close()
                skipped.append({"system": name, "reason": f"failed: {e}"})
                continue
            made[name] = system
        order = list(made)
        for rep in range(repeats):
            turn = order[rep % len(order) :] + order[: rep % len(order)] if order else []
            for name in turn:
                progress.set_description(f"{name} {rep + 1}/{repeats}")
                for workload_name in workloads:
                    workload = make(workload_name)
                    waited = wait_until_quiet()
                    if waited > 5.0:
                        print(f"waited {waited:.1f} s for a quiet machine", file=sys.stderr)
                    row = run_one(made[name], workload, references)
                    if row is not None:
                        runs.setdefault((workload_name, name), []).append(row)
                    progress.update()
    finally:
        for system in made.values():
            system.close()
        models.release([])
        progress.close()
    rows = []
    for key in sorted(runs, key=lambda k: (workloads.index(k[0]), systems.index(k[1]))):
        repeated = runs[key]
        walls = [r["wall_s"] for r in repeated]
        row = sorted(repeated, key=lambda r: r["wall_s"])[len(repeated) // 2]
        rows.append({**row, "runs_wall_s": [round(w, 3) for w in walls]})
    return rows, [], skipped


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixflow bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI smoke sizes")
    parser.add_argument("--json", metavar="PATH", help="write machine info and results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG bar chart of the speedups")
    parser.add_argument("--workloads", default="all", help="comma-separated names, or all")
    parser.add_argument("--systems", default="all", help=f"comma-separated: {', '.join(SYSTEMS)}")
    parser.add_argument("--model", default="smollm2", help="model name or path (default smollm2)")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads; 0 = all cores")
    parser.add_argument(
        "--scheduler-modes",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also compare scheduler modes on long_mix (when long_mix and radixflow run)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="N > 1: all systems loaded at once, N interleaved passes, the median row each "
        "(scheduler modes are not run then)",
    )
    parser.add_argument(
        "--from-json", metavar="PATH", help="run nothing: redraw --plot from a saved --json"
    )
    return parser


def pick(value: str, known: list[str] | tuple[str, ...], what: str) -> list[str]:
    names = list(known) if value == "all" else [v.strip() for v in value.split(",") if v.strip()]
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise SystemExit(f"radixflow bench: unknown {what} {unknown}; known: {', '.join(known)}")
    return [k for k in known if k in names]  # canonical order: radixflow first


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "agent_restart" in " ".join(argv):  # restarts servers: its own driver, its own flags
        return agent_restart.main(
            [
                a
                for a in argv
                if a not in ("--workloads", "agent_restart", "--workloads=agent_restart")
            ]
        )
    args = build_parser().parse_args(argv)
    if args.from_json:
        return out.replot(args.from_json, args.plot)

    if args.threads:  # on a shared machine, fewer threads than cores avoids OpenMP stalls
        torch.set_num_threads(args.threads)
    workloads = pick(args.workloads, tuple(WORKLOADS), "workload")
    systems = pick(args.systems, SYSTEMS, "system")
    model_dir = resolve_model_dir(args.model)
    codec = server_codec(load_tokenizer(model_dir))

    def make(name: str) -> Workload:
        return WORKLOADS[name](codec, args.quick)

    machine = out.machine_info(args.model, args.quick)
    roofline = not args.quick and "independent" in workloads
    if roofline:
        machine.update(compute_roofline(model_dir))
    models = Models(args.model, model_dir, args.threads)
    if args.repeats < 1:
        raise SystemExit("radixflow bench: --repeats must be at least 1")
    if args.repeats > 1:
        runs = run_interleaved(systems, workloads, models, make, args.repeats)
    else:
        runs = run_all(systems, workloads, models, make, args.scheduler_modes)
    if roofline:  # measured again, the engines released: the best of both (best_of)
        machine.update(best_of(machine, compute_roofline(model_dir)))
    out.report(args, machine, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
