"""The `radixflow` command: `serve` (radixflow.runtime.cli), `bench` (radixflow.bench.cli) and
the scheduler lab's commands, `simulate`, `diagnose` and `tree`.

    radixflow simulate --profile h100-llama-3.3-70b-fp8 --workload long_mix
    radixflow simulate --calibrate ~/.cache/radixflow/profile.json
    radixflow simulate --profile profile.json --compare bench.json   # vs `radixflow bench --json`
    radixflow diagnose --url tcp://127.0.0.1:30001 --ttft-slo 1 --itl-slo 0.2
    radixflow diagnose --workload long_mix --chunked-prefill-size -1 --itl-slo 0.5 [--simulate P]
    radixflow tree --url tcp://127.0.0.1:30001 --png tree.png

Every ServerConfig knob is a flag of `simulate` and `diagnose` (the configuration to run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from radixflow.lab.diagnose import diagnose_main, diagnose_parser
from radixflow.lab.profiles import RooflineProfile, load_profile, save_profile
from radixflow.lab.simulate import MODES, calibrate, simulate_modes
from radixflow.lab.tree import tree_main, tree_parser
from radixflow.runtime.config import DEFAULT_POOL_TOKENS, ServerConfig
from radixflow.runtime.config.cli import add_config_arguments, config_from_args

LAB_COMMANDS = ("simulate", "diagnose", "tree")
USAGE = """usage: radixflow COMMAND [options]   (radixflow COMMAND --help for each)

  serve      run the runtime server (the default: `radixflow --model-path smollm2`)
  bench      the benchmark suite: radixflow and its peers on the same workloads
  diagnose   name the scheduler's bottleneck on a live server or a workload
  simulate   the real scheduler against a cost model, in virtual time
  tree       a picture of a live server's radix tree"""


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    cells = [columns] + [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells)


def explicit_changes(args: argparse.Namespace) -> dict[str, Any]:
    """Config fields the user set (differ from the defaults)."""
    defaults = ServerConfig()

    def given(name: str) -> Any:  # argparse gives lists where the config holds tuples
        value = getattr(args, name)
        return tuple(value) if isinstance(value, list) else value

    return {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(ServerConfig)
        if given(f.name) != getattr(defaults, f.name)
    }


# ---- simulate -------------------------------------------------------------------------------


def simulate_parser(commands: Any) -> None:
    p = commands.add_parser("simulate", help="the real scheduler against a cost model")
    p.add_argument(
        "--profile",
        default="h100-llama-3.3-70b-fp8",
        help="a named profile or a JSON file from --calibrate",
    )
    p.add_argument("--calibrate", metavar="PATH", help="measure this machine, write PATH, stop")
    p.add_argument("--workload", default="long_mix", help="a radixflow bench workload")
    p.add_argument("--quick", action="store_true", help="the workload's CI size")
    p.add_argument("--modes", default="static,continuous,continuous+chunked")
    p.add_argument("--radix", default="on,off", help="radix cache settings to run: on,off")
    p.add_argument("--compare", metavar="BENCH_JSON", help="errors vs `radixflow bench --json`")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    add_config_arguments(p)


def simulate_main(args: argparse.Namespace) -> int:

    if args.calibrate:
        changes = explicit_changes(args)
        profile = calibrate(**changes)
        save_profile(profile, args.calibrate)
        print(json.dumps(dataclasses.asdict(profile), indent=1))
        return 0
    profile = load_profile(args.profile)
    config = config_from_args(args)
    if isinstance(profile, RooflineProfile) and "max_total_tokens" not in explicit_changes(args):
        config = config.replace(max_total_tokens=profile.kv_pool_tokens)
    elif not config.max_total_tokens:  # a simulated machine has no memory to size from
        config = config.replace(max_total_tokens=DEFAULT_POOL_TOKENS)
    modes = tuple(m for m in args.modes.split(",") if m)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        print(f"radixflow simulate: unknown mode(s) {unknown}; known: {list(MODES)}")
        return 2
    radix = tuple(v == "on" for v in args.radix.split(","))
    rows = simulate_modes(profile, args.workload, config, args.quick, modes, radix)
    print(f"simulated {args.workload} on {profile.name} (virtual time; {profile.notes})")
    print(
        f"config: KV {config.max_total_tokens} tokens, chunk {config.chunked_prefill_size}, "
        f"max running {config.max_running_requests}, page {config.page_size}"
    )
    columns = [
        "mode",
        "radix",
        "tokens_per_s",
        "ttft_mean_s",
        "ttft_p99_s",
        "itl_p99_s",
        "wall_s",
        "prefill_tokens",
        "cache_hit_rate",
        "preemptions",
    ]
    print(table(rows, columns))
    if args.compare:
        print(compare(rows, args.compare))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"profile": dataclasses.asdict(profile), "rows": rows}, f, indent=1)
    return 0


def compare(rows: list[dict[str, Any]], bench_json: str) -> str:
    """Relative error of the simulated modes (radix on) against a bench run's mode rows."""
    with open(bench_json) as f:
        real = {r["system"]: r for r in json.load(f).get("scheduler_modes", [])}
    lines = ["simulated vs measured (radixflow bench scheduler modes):"]
    for row in rows:
        measured = real.get(row["mode"])
        if not row["radix"] or measured is None:
            continue
        parts = []
        for key in ("tokens_per_s", "ttft_mean_s", "itl_p99_s"):
            sim, got = row.get(key), measured.get(key)
            if sim is not None and got:
                parts.append(f"{key} {sim:.3g} vs {got:.3g} ({100 * (sim - got) / got:+.0f}%)")
        lines.append(f"  {row['mode']}: " + ", ".join(parts))
    return "\n".join(lines)


# ---- entry ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixflow", description="the scheduler lab")
    commands = parser.add_subparsers(dest="command", required=True)
    simulate_parser(commands)
    diagnose_parser(commands)
    tree_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`radixflow COMMAND ...`: the lab's commands here, `bench` and `serve` (the default)
    handed to their own parsers."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if argv and argv[0] == "bench":
        from radixflow.bench import cli as bench_cli  # noqa: PLC0415 (torch: the bench loads it)

        return bench_cli.main(argv[1:])
    if not argv or argv[0] not in LAB_COMMANDS:
        # (torch, transformers: the server's tokenizer; the lab plans on a laptop without them)
        from radixflow.runtime import cli as runtime_cli  # noqa: PLC0415 (torch: see above)

        return runtime_cli.main(argv)
    return lab_main(argv)


def lab_main(argv: list[str]) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.command != "diagnose":
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        if args.command != "tree":
            config_from_args(args)
    except ValueError as e:
        print(f"radixflow {args.command}: {e}", file=sys.stderr)
        return 2
    if args.command == "simulate":
        return simulate_main(args)
    if args.command == "diagnose":
        return diagnose_main(args, unknown)
    return tree_main(args)
