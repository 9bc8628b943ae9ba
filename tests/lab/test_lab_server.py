"""`radixflow diagnose --url` and `radixflow tree --url` against a live server (slow: it
starts its own server and loads the model)."""

from __future__ import annotations

import pytest

from radixflow.lab.cli import main as lab_main

pytestmark = pytest.mark.slow


SERVER = dict(max_total_tokens=4096, max_running_requests=2)  # conftest's `runtime`


def test_diagnose_and_tree_over_zeromq(runtime, capsys, tmp_path) -> None:
    shared = "You are a careful assistant. Answer in one short sentence. " * 4
    prompts = [f"{shared}Question {i}: name a colour." for i in range(6)]
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    for text in prompts:  # one client, sequential: no batching pressure
        runtime.endpoint.generate(text, params)
    assert lab_main(["diagnose", "--url", runtime.address]) == 0
    out = capsys.readouterr().out
    assert out.startswith("primary bottleneck: none"), out
    png = tmp_path / "tree.png"
    assert lab_main(["tree", "--url", runtime.address, "--png", str(png)]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[1]  # the shared system text, one run under the root
    assert "You are a careful" in first and out.count("evict#") == 6
    assert png.read_bytes()[:4] == b"\x89PNG"
