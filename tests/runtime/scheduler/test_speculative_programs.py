"""The six programs in programs/ give the same results with speculative decoding on as off
(greedy; one real server each, SmolLM2). Slow: two servers and six programs on 2 cores."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import pytest

import radixflow as sgl
from conftest import Server

PROGRAMS = Path(__file__).resolve().parents[3] / "programs"
sys.path.insert(0, str(PROGRAMS))

pytestmark = pytest.mark.slow


def _run_all(backend: Any) -> dict[str, Any]:
    """Each program's model-dependent output (not its timings or cache counters)."""
    run = lambda name, **kw: importlib.import_module(name).main(backend, **kw)
    chat = run("multi_turn_chat", max_tokens=24)
    qa = run("few_shot_qa", num_questions=8, progress_bar=False)
    tree = run("tree_of_thought", width=2, max_tokens=12)
    sot = run("skeleton_of_thought", num_points=3, max_tokens=24)
    return {
        "multi_turn_chat": chat["answers"],
        "few_shot_qa": qa["answers"],
        "tree_of_thought": [tree["approaches"], tree["steps"], tree["verdicts"]],
        "agent": run("agent"),
        "json_extraction": run("json_extraction"),
        "skeleton_of_thought": [sot["points"], sot["expansions"]],
    }


def test_six_programs_equal_with_and_without_speculation() -> None:
    results, stats = {}, {}
    for label, extra in (
        ("off", {}),
        ("on", {"speculative_algorithm": "ngram", "speculative_disable_by_batch_size": 0}),
    ):
        # the machine's 2 cores may be shared
        runtime = Server(max_total_tokens=8192, endpoint_timeout=600.0, **extra)
        try:
            results[label] = _run_all(runtime)
            stats[label] = sgl.get_server_info(runtime)
        finally:
            runtime.shutdown()
    for name in results["off"]:
        assert results["on"][name] == results["off"][name], name
    assert stats["on"]["spec_accepted"] > 0, stats["on"]
    assert stats["off"]["spec_proposed"] == 0
