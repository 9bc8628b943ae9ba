"""The report: result and speedup tables, the notes under them, the machine, the PNG chart."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch
import transformers

from radixflow.bench.roofline import roofline_note

COLUMNS = (
    ("workload", "workload", "{}"),
    ("system", "system", "{}"),
    ("wall_s", "wall s", "{:.2f}"),
    ("output_tokens", "out tok", "{}"),
    ("tokens_per_s", "tok/s", "{:.1f}"),
    ("programs_per_s", "prog/s", "{:.2f}"),
    ("ttft_mean_s", "ttft s", "{:.3f}"),
    ("ttft_p99_s", "ttft p99", "{:.3f}"),
    ("itl_p99_s", "itl p99", "{:.3f}"),
    ("prefill_tokens", "prefill", "{}"),
    ("cache_hit_rate", "hit", "{:.2f}"),
    ("best_hit_rate", "best", "{:.2f}"),
    ("peak_rss_mb", "rss MB", "{:.0f}"),
)


def format_table(header: list[str], body: list[list[str]]) -> str:
    widths = [max(len(row[k]) for row in [header, *body]) for k in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in [header, *body]]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def results_table(rows: list[dict[str, Any]]) -> str:
    body = [
        ["-" if row[key] is None else fmt.format(row[key]) for key, _, fmt in COLUMNS]
        for row in rows
    ]
    return format_table([title for _, title, _ in COLUMNS], body)


def speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """radixflow's speedup over each baseline: baseline wall time / radixflow wall time (the
    work is equal, so this is also the ratio of output tokens/s and programs/s)."""
    ours = {r["workload"]: r for r in rows if r["system"] == "radixflow"}
    return [
        {
            "workload": r["workload"],
            "baseline": r["system"],
            "speedup": r["wall_s"] / ours[r["workload"]]["wall_s"],
        }
        for r in rows
        if r["system"] != "radixflow" and r["workload"] in ours
    ]


def chunking_note(continuous: dict[str, Any], chunked: dict[str, Any]) -> str:
    """The issue's long_mix target: chunked ITL p99 <= 1/3 of unchunked at >= 90% throughput."""
    itl = chunked["itl_p99_s"] / continuous["itl_p99_s"]
    throughput = chunked["tokens_per_s"] / continuous["tokens_per_s"]
    return (
        f"chunked vs continuous: ITL p99 x{itl:.2f} (target <= 0.33), "
        f"throughput x{throughput:.2f} (target >= 0.90)"
    )


def speedup_table(ratios: list[dict[str, Any]]) -> str:
    baselines = list(dict.fromkeys(r["baseline"] for r in ratios))
    workloads = list(dict.fromkeys(r["workload"] for r in ratios))
    value = {(r["workload"], r["baseline"]): r["speedup"] for r in ratios}
    body = [
        [w] + [f"{value[w, b]:.2f}x" if (w, b) in value else "-" for b in baselines]
        for w in workloads
    ]
    return format_table(["radixflow vs", *baselines], body)


def plot_speedups(ratios: list[dict[str, Any]], path: str, title: str) -> str:
    """A PNG bar chart of the speedups (log scale); returns what happened."""
    try:
        import matplotlib  # noqa: PLC0415 (optional: the bench extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415 (optional: the bench extra)
        import matplotlib.ticker  # noqa: PLC0415 (optional: the bench extra)
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    baselines = list(dict.fromkeys(r["baseline"] for r in ratios))
    workloads = list(dict.fromkeys(r["workload"] for r in ratios))
    value = {(r["workload"], r["baseline"]): r["speedup"] for r in ratios}
    width = 0.8 / max(len(baselines), 1)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for k, baseline in enumerate(baselines):
        xs = [i + k * width for i, w in enumerate(workloads) if (w, baseline) in value]
        ys = [value[w, baseline] for w in workloads if (w, baseline) in value]
        ax.bar(xs, ys, width, label=baseline)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    for axis_format in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        axis_format(matplotlib.ticker.FormatStrFormatter("%gx"))
    ax.set_title(title, fontsize=9)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))], workloads, rotation=15)
    ax.set_ylabel("radixflow speedup (baseline wall / radixflow wall)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot written to {path}"


def machine_info(model: str, quick: bool) -> dict[str, Any]:

    cpuinfo = Path("/proc/cpuinfo")
    names = [
        line.split(":", 1)[1].strip()
        for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
        if line.startswith("model name")
    ]
    return {
        "cpu": names[0] if names else platform.processor(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "load_average": list(os.getloadavg()),
        "model": model,
        "quick": quick,
    }


def agreement_note(rows: list[dict[str, Any]]) -> str | None:
    """Per workload, the systems whose outputs (texts, chosen options) equal radixflow's."""
    ours = {r["workload"]: r["output_digest"] for r in rows if r["system"] == "radixflow"}
    parts = []
    for workload, digest in ours.items():
        same = [
            r["system"]
            for r in rows
            if r["workload"] == workload and r["system"] != "radixflow"
            if r.get("output_digest") == digest
        ]
        parts.append(f"{workload}: {', '.join(same) or 'none'}")
    return "outputs identical to radixflow's: " + "; ".join(parts) if parts else None


def report(args: Any, machine: dict[str, Any], runs: tuple) -> None:
    """Print the tables; write the JSON and the chart when asked."""

    rows, mode_rows, skipped = runs
    ratios = speedups(rows)
    print(results_table(rows))
    for entry in skipped:
        print(f"{entry['system']}: {entry['reason']}")
    for note in (
        speedup_table(ratios) if ratios else None,
        roofline_note(rows, machine),
        agreement_note(rows),
    ):
        if note:
            print("\n" + note)
    if mode_rows:
        print("\nscheduler modes on long_mix (static = waves of the short requests)")
        print(results_table(mode_rows))
        print(chunking_note(*mode_rows[1:]))
    machine["load_average_end"] = list(os.getloadavg())
    print(f"\nmachine: {json.dumps(machine)}")
    busiest = max(machine["load_average"][0], machine["load_average_end"][0])
    if busiest > 0.75 * (machine["cores"] or 1):
        print(f"warning: load average {busiest:.1f}: the machine was busy, timings are noisy")
    if args.json:
        document = {"machine": machine, "results": rows, "speedups": ratios}
        document.update({"scheduler_modes": mode_rows, "skipped": skipped})
        Path(args.json).write_text(json.dumps(document, indent=2))
    if args.plot:
        title = f"radixflow bench{' --quick' if args.quick else ''}: {machine['cpu']}, "
        title += f"{machine['cores']} cores, {machine['date']}"
        print(plot_speedups(ratios, args.plot, title) if ratios else "plot skipped: no speedups")


def replot(json_path: str, plot_path: str | None) -> int:
    """Draw the chart of a saved run (its title says which run and that it was redrawn)."""
    if not plot_path:
        print("radixflow bench: --from-json needs --plot PATH", file=sys.stderr)
        return 2
    document = json.loads(Path(json_path).read_text())
    machine = document["machine"]
    title = f"radixflow bench{' --quick' if machine.get('quick') else ''}: {machine['cpu']}, "
    title += f"{machine['cores']} cores, {machine['date']} (drawn from {Path(json_path).name})"
    print(plot_speedups(document["speedups"], plot_path, title))
    return 0
