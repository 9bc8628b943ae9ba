"""`python -m radixflow.bench.gpu_check --dry-run`: the GPU check's every part but CUDA, on
CPU (a tiny random Llama with SmolLM2's tokenizer, the Triton kernels in the interpreter,
decode graphs through the "record" backend), in its own process."""

import json
import operator
import os
import subprocess
import sys

import pytest

from conftest import die_with_parent


# slow: 13-27 s, and its Triton kernels are held to their references by tests/kernels; run it
# (`-m slow`) before a session with a lent GPU, whose minutes the real check spends
@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "gpu_check.json"
    # as a user runs it: the dry run itself must choose the Triton interpreter (not inherit
    # it from tests/kernels/test_kernels.py's import in this process)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TOKENIZERS_PARALLELISM"] = "false"
    cmd = [sys.executable, "-m", "radixflow.bench.gpu_check", "--dry-run", "--out", str(out)]
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env=env, preexec_fn=die_with_parent()
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["dry_run"]
    checks = {c["name"]: c for c in report["checks"]}
    names = ["kernel_tests", "kernels", "host_layout", "transformers", "cuda_graph", "throughput"]
    assert list(checks) == [*names, "jump_forward"]
    jump = checks["jump_forward"]  # forced JSON text appended: fewer steps than without it
    assert jump["jumped_tokens"] > 0 and jump["forward_steps_on"] < jump["forward_steps_off"]
    assert all(ms > 0 for ms in checks["host_layout"]["best_of_5_ms"].values())
    assert checks["kernel_tests"]["skipped"]  # CUDA only
    kernels = checks["kernels"]
    assert kernels["shared_groups"] == 3  # one problem run, two branch runs
    assert set(kernels["max_abs_error"]) == {"decode", "shared_prefix", "graph_layout", "extend"}
    assert max(kernels["max_abs_error"].values()) <= kernels["tolerance"]
    assert checks["transformers"]["prompts_equal"] == "4/4"
    graphs = checks["cuda_graph"]
    assert graphs["prompts_equal"] == "8/8" and graphs["graph_replays"] > 0
    rows = [r for r in report["throughput"] if "skipped" not in r]
    names = [r["workload"] for r in rows]
    assert names == ["few_shot", "tree_of_thought", "independent x1", "independent x4",
                     "independent x8", "few_shot", "tree_of_thought"]  # fmt: skip
    assert all(r["tokens_per_s"] > 0 and r["output_tokens"] > 0 for r in rows)
    cached, uncached = rows[0], rows[5]  # few_shot with and without the radix cache
    assert cached["radix_cache"] and not uncached["radix_cache"]
    assert cached["cache_hit_rate"] > 0.3 and uncached["cache_hit_rate"] == 0
    assert all(0 < r["share_of_roofline"] < 1 for r in rows if "roofline_tokens_per_s" in r)
    # every (radix cache, shared prefix, graphs) configuration has a row; on CPU those with
    # the shared-prefix switch off or graphs on are skipped, saying why, and only those
    configs = {(c, s, g) for c in (True, False) for s in (True, False) for g in (True, False)}
    label = operator.itemgetter("radix_cache", "shared_prefix", "cuda_graph")
    skipped = [r for r in report["throughput"] if "skipped" in r]
    assert {label(r) for r in skipped} == {k for k in configs if not k[1] or k[2]}
    assert len(skipped) == 6 and all("CUDA graphs" in r["skipped"] for r in skipped)
    assert [label(r) for r in rows] == [(True, True, False)] * 5 + [(False, True, False)] * 2
