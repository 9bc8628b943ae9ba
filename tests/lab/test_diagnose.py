"""radixflow diagnose names the right bottleneck: four constructed cases and a healthy one,
on the real engine (SmolLM2, tiny token counts) and in simulate; the CLI reports settings it
does not have as ignored."""

from __future__ import annotations

import json

import pytest

from radixflow.lab.cases import run_case
from radixflow.lab.cli import main as lab_main
from radixflow.lab.diagnose import diagnose
from radixflow.runtime.config import ServerConfig

# (workload, config changes, SLOs, expected primary bottleneck, a flag the advice names)
CASES = {
    "kv_pool_too_small": (
        "long_outputs",
        {"max_total_tokens": 128},
        {},
        "kv",
        "--mem-fraction-static",
    ),
    "running_cap_2": (
        "long_outputs",
        {"max_running_requests": 2},
        {},
        "batching",
        "--max-running-requests",
    ),
    "chunking_off": (
        "long_prompts_mix",
        {"chunked_prefill_size": -1},
        {"itl_slo": 0.5},
        "chunked",
        "--chunked-prefill-size",
    ),
    "timestamp_head": ("timestamp_prefix", {}, {}, "radix", "timestamps"),
    "healthy": ("small_chat", {}, {}, "none", "replicas"),  # SLOs would time the CPU
}


@pytest.mark.parametrize("case", CASES)
def test_diagnose_real_engine(make_engine, case: str) -> None:
    workload, changes, slos, expected, flag = CASES[case]
    engine = make_engine(**changes)
    stats, best = run_case(workload, engine.config, engine=engine)
    result = diagnose(stats, best_hit_rate=best, **slos)
    print(f"\n[{case}]\n{result.text()}")  # shown with -s
    assert result.primary.bottleneck == expected, result.text()
    assert flag in result.primary.action
    if expected == "none":
        assert result.others == [] and result.figures["slo_met"] == 1.0  # no SLOs given


@pytest.mark.parametrize("case", CASES)
def test_diagnose_simulated(case: str) -> None:
    workload, changes, slos, expected, _ = CASES[case]
    stats, best = run_case(workload, ServerConfig(**changes), simulate="h100-llama-3.3-70b-fp8")
    assert diagnose(stats, best_hit_rate=best, **slos).primary.bottleneck == expected


def test_evidence_figures_are_the_stats() -> None:
    stats = {
        "finished_requests": 1000,
        "preemptions": 37,
        "kv_use_peak": 0.97,
        "steps_recorded": 100,
        "admission_stop_kv": 40,
        "recomputed_tokens": 5000,
    }
    result = diagnose(stats)
    assert result.primary.bottleneck == "kv"
    assert result.primary.evidence.startswith("KV: 37 preemptions per 1,000 requests")
    assert "at 97% peak KV use" in result.primary.evidence


def test_goodput_counts_only_requests_meeting_both_slos() -> None:
    # [ttft, itl_p99, tokens, arrival, finish]
    recent = [[0.1, 0.05, 10, 0.0, 1.0], [2.0, 0.05, 10, 0.0, 2.0], [0.1, 0.9, 10, 1.0, 2.0]]
    result = diagnose({"recent_requests": recent}, ttft_slo=1.0, itl_slo=0.2)
    assert result.figures["throughput_tokens_per_s"] == pytest.approx(15.0)
    assert result.figures["goodput_tokens_per_s"] == pytest.approx(5.0)
    assert result.figures["slo_met"] == pytest.approx(1 / 3)


def test_cli_json_reports_ignored_settings(tmp_path, capsys) -> None:
    config = tmp_path / "serving.json"
    config.write_text(json.dumps({"max_running_requests": 2, "speculative_eagle_topk": 4}))
    code = lab_main(
        [
            "diagnose",
            "--workload",
            "long_outputs",
            "--simulate",
            "h100-llama-3.3-70b-fp8",
            "--config",
            str(config),
            "--json",
            "--speculative-num-steps",
            "5",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["primary"]["bottleneck"] == "batching"  # the file's cap of 2 was applied
    assert out["ignored"] == [
        "--speculative-num-steps 5 (radixflow has no such setting)",
        "speculative_eagle_topk=4 (radixflow has no such setting)",
    ]
