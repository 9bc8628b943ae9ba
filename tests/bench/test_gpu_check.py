"""`python -m radixflow.runtime.gpu_check --dry-run`: the GPU check's every part but CUDA, on
CPU (a tiny random Llama with SmolLM2's tokenizer, the Triton kernels in the interpreter,
decode graphs through the "record" backend), in its own process."""

import json
import os
import subprocess
import sys


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "radixflow.runtime.gpu_check", "--dry-run", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["dry_run"]
    checks = {c["name"]: c for c in report["checks"]}
    names = ["kernel_tests", "kernels", "host_layout", "transformers", "cuda_graph", "throughput"]
    assert list(checks) == names
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
    assert len(report["throughput"]) - len(rows) == 6  # shared-prefix off / graphs on: CUDA
