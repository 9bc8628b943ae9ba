"""The runner's choice of when small quantized matmuls split over threads (split.py): made
from decode steps' own times, kept once made, and without effect on any result."""

from __future__ import annotations

import pytest
import torch

from radixflow.kernels.cpu import quant as native_quant
from radixflow.runtime.model_executor import split


@pytest.fixture
def restore_split():
    threads = torch.get_num_threads()
    yield
    native_quant.set_fused_split(0)
    torch.set_num_threads(threads)


def timed(monkeypatch, tuner: split.SplitTuner, seconds: dict[int, float], steps: int) -> None:
    """`steps` one-row decode steps, each taking seconds[the threshold the kernel has]."""
    now = [0.0]
    monkeypatch.setattr(split.time, "perf_counter", lambda: now[0])
    for _ in range(steps):
        tuner.start(1, True)
        now[0] += seconds[native_quant.set_fused_split(-1)]
        tuner.stop()


def test_the_faster_threshold_is_kept(monkeypatch, restore_split) -> None:
    torch.set_num_threads(2)
    default = native_quant.set_fused_split(0)
    assert default > 0, "the quantized kernels did not build"
    for fast in split.CANDIDATES:
        tuner = split.SplitTuner(samples=3)
        seconds = {c or default: 0.008 if c == fast else 0.010 for c in split.CANDIDATES}
        timed(monkeypatch, tuner, seconds, 5)
        assert tuner.chosen is None, "decided before every candidate had its samples"
        timed(monkeypatch, tuner, seconds, 1)
        assert tuner.chosen == fast and native_quant.set_fused_split(-1) == (fast or default)
        timed(monkeypatch, tuner, dict.fromkeys(seconds, 1.0), 4)  # decided: nothing changes
        assert tuner.chosen == fast and all(len(t) == 3 for t in tuner.times.values())
        native_quant.set_fused_split(0)


def test_only_small_decode_steps_on_several_threads_are_timed(restore_split) -> None:
    tuner = split.SplitTuner(samples=1)
    torch.set_num_threads(2)
    for rows, decode_only in ((5, True), (1, False), (64, True)):
        tuner.start(rows, decode_only)
        tuner.stop()
    torch.set_num_threads(1)
    tuner.start(1, True)
    tuner.stop()
    assert all(not t for t in tuner.times.values()) and tuner.chosen is None


def test_the_engine_decides_from_its_steps_and_outputs_do_not_change(
    engine, monkeypatch, restore_split
) -> None:
    """SmolLM2's runner times its first single-stream decode steps (two threads, the governor
    held off) and keeps a threshold; the same greedy tokens come out under either one."""
    runner = engine.scheduler.runner
    assert runner.split is not None  # quantized weights on CPU
    tuner = split.SplitTuner(samples=3)
    monkeypatch.setattr(runner, "split", tuner)
    monkeypatch.setattr(runner, "governor", None)
    torch.set_num_threads(2)
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    prompt = "List three colours:"
    engine.flush_cache()
    first = engine.generate(prompt, params)["output_ids"]
    assert tuner.chosen in split.CANDIDATES and all(len(t) == 3 for t in tuner.times.values())
    for threshold in split.CANDIDATES:
        native_quant.set_fused_split(threshold)
        engine.flush_cache()
        assert engine.generate(prompt, params)["output_ids"] == first
