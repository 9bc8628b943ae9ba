"""`radixflow bench --quick` in-process on a small subset: the report's structure and sane
values (equal work across systems, hit rates, prefix reuse). No assertions on speed."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

from radixflow.runtime.bench import (
    Arrivals,
    compute_roofline,
    main,
    percentile,
    plan_batches,
    roofline_note,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "programs"))

import workloads  # noqa: E402

KEYS = {
    "workload", "system", "wall_s", "output_tokens", "tokens_per_s", "ttft_mean_s",
    "ttft_p99_s", "itl_p99_s", "prefill_tokens", "cache_hit_rate", "best_hit_rate",
    "peak_rss_mb",
}  # fmt: skip
SYSTEMS = ("radixflow", "radixflow-nocache", "transformers")
WORKLOADS = ("few_shot", "independent")


def test_quick_bench_writes_a_sane_report(tmp_path: Path) -> None:
    import torch

    path = tmp_path / "out.json"
    argv = ["--quick", "--json", str(path), "--workloads", ",".join(WORKLOADS)]
    threads = torch.get_num_threads()
    try:  # one thread: on a shared machine, OpenMP stalls would make this take minutes
        assert main([*argv, "--systems", ",".join(SYSTEMS), "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(path.read_text())
    assert {"cpu", "cores", "torch", "date"} <= set(report["machine"])
    rows = {(r["workload"], r["system"]): r for r in report["results"]}
    assert set(rows) == {(w, s) for w in WORKLOADS for s in SYSTEMS}
    for row in rows.values():
        assert KEYS <= set(row)
        assert row["output_tokens"] > 0 and row["wall_s"] > 0 and row["tokens_per_s"] > 0
        assert 0 < row["ttft_mean_s"] <= row["ttft_p99_s"] <= row["wall_s"]
        assert 0.0 <= row["cache_hit_rate"] <= row["best_hit_rate"] + 1e-9 <= 1.0 + 1e-9
        assert row["peak_rss_mb"] > 0
    for workload in WORKLOADS:  # equal work: same token counts on every system
        assert len({rows[workload, s]["output_tokens"] for s in SYSTEMS}) == 1
    ours, ablation = rows["few_shot", "radixflow"], rows["few_shot", "radixflow-nocache"]
    assert ours["prefill_tokens"] < ablation["prefill_tokens"]
    assert ours["cache_hit_rate"] >= 0.9 * ours["best_hit_rate"] > 0
    assert ablation["cache_hit_rate"] == rows["few_shot", "transformers"]["cache_hit_rate"] == 0
    speedups = {(s["workload"], s["baseline"]) for s in report["speedups"]}
    assert speedups == {(w, s) for w in WORKLOADS for s in SYSTEMS[1:]}


def test_best_hit_rate_counts_the_token_trie() -> None:
    shared = (1, 2, 3, 4)
    assert workloads.best_hit_rate([([shared + (5,), shared + (6,)], [])]) == 1 - 6 / 10
    assert workloads.best_hit_rate([([(7, 8)], [(7, 8, 9)]), ([(7, 8, 9, 10)], [])]) == 0.5
    assert workloads.best_hit_rate([([(1,), (2,)], [])]) == 0.0


def test_workloads_are_deterministic_and_replayable() -> None:
    def encode(text: str) -> list[int]:
        return [ord(c) % 50 for c in text]

    for name in workloads.WORKLOADS:
        first, again = (workloads.describe(name, encode, quick=True) for _ in range(2))
        assert first == again and first["prompt_tokens"] > 0 and first["new_tokens"] > 0


def test_late_calls_arrive_when_the_lead_has_enough_tokens() -> None:
    calls = [SimpleNamespace(after_tokens=n) for n in (0, 0, 2, 5)]
    arrivals = Arrivals(calls, start=10.0)
    assert arrivals.due([], False) == [0, 1] and not arrivals.complete
    assert arrivals.due([11.0, 12.0, 13.0], False) == [2] and arrivals.times[2] == 12.0
    assert arrivals.due([11.0, 12.0, 13.0], True) == [3] and arrivals.times[3] == 13.0
    assert arrivals.complete


def test_naive_batches_respect_kind_rows_and_tokens() -> None:
    def call(length: int, new: int = 4, options: tuple = ()) -> SimpleNamespace:
        return SimpleNamespace(input_ids=(1,) * length, max_new_tokens=new, options=options)

    calls = [call(10)] * 70 + [call(10, new=8)] + [call(10, new=0, options=((1,), (2,)))] * 2
    batches = plan_batches(calls, list(range(len(calls))))
    assert [len(b) for b in batches] == [64, 6, 1, 2]
    assert [len(b) for b in plan_batches([call(20000), call(20000)], [0, 1])] == [1, 1]
    assert percentile([3.0, 1.0, 2.0], 0.99) == 3.0 and percentile([], 0.5) is None


def test_roofline_is_measured_on_the_models_shapes_and_stated_as_a_share() -> None:
    """A tiny Llama config: the rate is positive, the token bound is batch / pass time, and
    the note states radixflow's `independent` throughput as a share of it."""
    import tempfile

    config = {
        "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 100,
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        machine = compute_roofline(Path(tmp), batch=16)
    assert machine["roofline_batch"] == 16
    assert machine["fp32_matmul_gflops"] > 0 and machine["roofline_tokens_per_s"] > 0
    rate = machine["roofline_tokens_per_s"]
    rows = [{"workload": "independent", "system": "radixflow", "tokens_per_s": rate / 4}]
    assert "= 25% of the fp32 compute roofline" in roofline_note(rows, machine)
    assert roofline_note(rows, {}) is None
    assert roofline_note([{**rows[0], "system": "vllm"}], machine) is None
