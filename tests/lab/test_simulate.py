"""radixflow simulate: the real scheduler against a cost model in virtual time (torch-free)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from radixflow.lab.profiles import (
    PROFILES,
    LinearProfile,
    StepShape,
    load_profile,
    save_profile,
)
from radixflow.lab.simulate import (
    VirtualClock,
    WordCodec,
    bench_workload,
    drive,
    sim_scheduler,
    simulate_modes,
    word_codec,
)
from radixflow.runtime.config import ServerConfig

H100 = PROFILES["h100-llama-3.3-70b-fp8"]
TOY = LinearProfile("toy", 0.01, 0.001, 0.002, 1e-6, 0.0)


def test_word_codec_round_trips_and_counts_words() -> None:
    codec = WordCodec(["time", "year"])
    text = "Time year, time.\nYear"
    assert codec.decode(codec.encode(text)) == text
    assert len(codec.encode("time year time")) == 3


def test_virtual_time_is_the_sum_of_step_costs() -> None:
    clock, codec = VirtualClock(), word_codec()
    scheduler = sim_scheduler(ServerConfig(), TOY, codec, clock)
    row = drive(scheduler, bench_workload("independent", codec, True), clock.now)
    costs = [t for _, t in scheduler.runner.shapes]
    assert clock.now() == pytest.approx(sum(costs)) and row["wall_s"] == pytest.approx(sum(costs))
    shapes = [s for s, _ in scheduler.runner.shapes]
    assert costs[-1] == pytest.approx(
        0.01
        + 0.001 * shapes[-1].extend_tokens
        + 0.002 * shapes[-1].decode_rows
        + 1e-6 * shapes[-1].decode_kv_tokens
    )
    # 4 prompts x 8 new tokens, all through the real scheduler
    assert row["output_tokens"] == 32 and row["errors"] == []


def test_h100_profile_reproduces_the_seeds_ordering() -> None:
    """naive (static) < continuous < continuous + chunked in throughput; chunking cuts the
    ITL p99 several-fold (long prompts no longer stall the decodes)."""
    config = ServerConfig(max_total_tokens=H100.kv_pool_tokens)
    rows = {r["mode"]: r for r in simulate_modes(H100, "long_mix", config, radix=(True,))}
    static, cont, chunked = rows["static"], rows["continuous"], rows["continuous+chunked"]
    assert static["tokens_per_s"] < cont["tokens_per_s"]
    assert chunked["tokens_per_s"] > 1.03 * cont["tokens_per_s"]  # prefill hides weight reads
    assert chunked["itl_p99_s"] < cont["itl_p99_s"] / 3
    assert static["ttft_p99_s"] > cont["ttft_p99_s"]  # the late long prompts wait a wave
    assert {r["output_tokens"] for r in rows.values()} == {2112}


def test_radix_on_and_off() -> None:
    rows = simulate_modes(TOY, "few_shot", ServerConfig(), quick=True, modes=("continuous",))
    on, off = rows
    assert on["radix"] and not off["radix"]
    assert on["cache_hit_rate"] > 0.5 and off["cache_hit_rate"] == 0
    assert on["prefill_tokens"] < off["prefill_tokens"] and on["wall_s"] < off["wall_s"]


def test_linear_fit_recovers_known_costs() -> None:
    rng = np.random.default_rng(1)
    truth = LinearProfile("truth", 0.02, 0.0013, 0.004, 2e-7, 1e-9)
    shapes = [
        StepShape(int(e), int(d), int(k), float(p))
        for e, d, k, p in zip(
            rng.integers(0, 2000, 60),
            rng.integers(0, 64, 60),
            rng.integers(0, 50000, 60),
            rng.integers(0, 10**6, 60),
        )
    ]
    times = [truth.step_time(s) for s in shapes]
    fit = LinearProfile.fit("fit", shapes, times)
    for name in ("overhead_s", "per_extend_token_s", "per_decode_row_s", "per_kv_token_s"):
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=1e-3)


def test_linear_fit_tells_padded_area_from_causal_pairs() -> None:
    """A whole prompt of n tokens costs its padded n x n area (the CPU extend's dense mask),
    a chunk over a long prefix about its pairs; a fit on both recovers each coefficient."""
    truth = LinearProfile("truth", 0.05, 0.0015, 0.004, 0.0, 2e-7, 4e-7)
    shapes = []
    for n in (256, 512, 1000, 1500, 2000, 3000):
        shapes.append(StepShape(n, 0, 0, n * (n + 1) / 2, float(n * n)))  # whole
        for start in range(0, n, 512):  # chunks over the growing prefix
            c = min(512, n - start)
            shapes.append(StepShape(c, 4, 400, c * start + c * (c + 1) / 2, c * (start + c)))
    fit = LinearProfile.fit("fit", shapes, [truth.step_time(s) for s in shapes])
    assert fit.per_area_s == pytest.approx(4e-7, rel=1e-3)
    assert fit.per_pair_s == pytest.approx(2e-7, rel=1e-3)


def test_step_shape_counts_the_padded_area() -> None:
    """Two extends, 3 new over 10 cached and 5 new over none: causal pairs 3*10 + 6 + 15,
    padded area 2 x 5 x (10 + 5) (each padded to the longest in both)."""
    from radixflow.runtime.protocol.plan import BatchPlan

    i64 = np.int64
    plan = BatchPlan(
        input_ids=np.zeros(9, i64), positions=np.zeros(9, i64), out_slots=np.zeros(9, i64),
        num_extend_tokens=8,
        extend_qo_indptr=np.array([0, 3, 8], i64), extend_kv_indptr=np.array([0, 10, 10], i64),
        extend_kv_indices=np.arange(10, dtype=i64),
        decode_kv_indptr=np.array([0, 7], i64), decode_kv_indices=np.arange(7, dtype=i64),
        logit_rows=np.array([2, 7, 8], i64), logprob_targets=np.full(3, -1, i64),
        sample_rows=np.arange(3, dtype=i64),
    )  # fmt: skip
    shape = StepShape.of(plan)
    assert (shape.extend_tokens, shape.decode_rows, shape.decode_kv_tokens) == (8, 1, 7)
    assert shape.attention_pairs == 3 * 10 + 6 + 15
    assert shape.attention_area == 2 * 5 * (10 + 5)


def test_profiles_load_by_name_and_file(tmp_path) -> None:
    assert load_profile("h100-llama-3.3-70b-fp8") is H100
    assert H100.kv_bytes_per_token == 163_840
    path = tmp_path / "p.json"
    save_profile(TOY, str(path))
    assert load_profile(str(path)) == TOY
    path.write_text(json.dumps({"kind": "linear", "bogus": 1}))
    with pytest.raises(ValueError, match="not a radixflow profile"):
        load_profile(str(path))
    with pytest.raises(ValueError, match="no profile"):
        load_profile("tpu-v9")


def test_h100_step_costs_from_first_principles() -> None:
    decode = H100.step_time(StepShape(0, 1, 1000, 0))  # weight read bound: 70.6 GB / 3.35 TB/s
    assert decode == pytest.approx(0.002 + (70.6e9 + 1000 * 163_840) / 3.35e12)
    prefill = H100.step_time(StepShape(4096, 0, 0, 0))  # compute bound at MFU 0.5
    assert prefill == pytest.approx(0.002 + 2 * 70.6e9 * 4096 / (989e12 * 0.5), rel=1e-6)


def test_the_lab_runs_without_torch() -> None:
    """simulate and diagnose plan a GPU deployment on a laptop: no torch, no model."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from radixflow.lab.cli import main\n"
        "main(['diagnose', '--workload', 'small_chat', '--simulate', 'h100-llama-3.3-70b-fp8'])\n"
        "main(['simulate', '--workload', 'independent', '--quick', '--modes', 'continuous'])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    ).stdout
    assert "primary bottleneck: none" in out and "continuous" in out
    assert out.strip().splitlines()[-1] == "[]"
