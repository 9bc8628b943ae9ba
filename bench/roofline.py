"""The roofline: this CPU's fp32 matmul rate at the model's own shapes, and radixflow's
`independent` throughput as a share of the decode rate it allows."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def compute_roofline(model_dir: Path, batch: int = 64) -> dict[str, float]:
    """This CPU's fp32 matmul rate at the model's own shapes with `batch` rows (one decode
    step of `batch` streams: every layer's projections, then the LM head), and the decode
    throughput that rate allows: `batch` tokens per pass of the matmuls alone. Attention,
    norms and sampling are left out, so no engine can reach the figure."""
    import torch
    import torch.nn.functional as F

    config = json.loads((model_dir / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = (config.get("num_key_value_heads") or config["num_attention_heads"]) * head_dim
    shapes = [(hidden, q_size + 2 * kv_size), (q_size, hidden)]
    shapes += [(hidden, 2 * inter), (inter, hidden)]  # (in, out) of each layer's projections
    layer = [torch.randn(n_out, n_in) / n_in**0.5 for n_in, n_out in shapes]
    head = torch.randn(config["vocab_size"], hidden) / hidden**0.5
    inputs = [torch.randn(batch, n_in) for n_in, _ in shapes]
    x_head = torch.randn(batch, hidden)

    def one_pass() -> None:
        for _ in range(config["num_hidden_layers"]):
            for x, w in zip(inputs, layer):
                F.linear(x, w)
        F.linear(x_head, head)

    one_pass()  # warm-up
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        one_pass()
        best = min(best, time.perf_counter() - start)
    params = config["num_hidden_layers"] * sum(a * b for a, b in shapes) + head.numel()
    return {
        "roofline_batch": batch,
        # three significant digits: a tiny model on a busy CPU must not round to 0 GFLOP/s
        "fp32_matmul_gflops": float(f"{2 * params * batch / best / 1e9:.3g}"),
        "roofline_tokens_per_s": float(f"{batch / best:.3g}"),
    }


def roofline_note(rows: list[dict[str, Any]], machine: dict[str, Any]) -> str | None:
    """radixflow's throughput on `independent` (64 streams) as a share of the roofline."""
    row = next(
        (r for r in rows if r["workload"] == "independent" and r["system"] == "radixflow"), None
    )
    if row is None or "roofline_tokens_per_s" not in machine:
        return None
    share = row["tokens_per_s"] / machine["roofline_tokens_per_s"]
    return (
        f"independent: radixflow {row['tokens_per_s']:.1f} tok/s = {share:.0%} of the fp32 "
        f"compute roofline ({machine['roofline_tokens_per_s']:.0f} tok/s: the matmuls of one "
        f"{machine['roofline_batch']}-row decode step at {machine['fp32_matmul_gflops']:.0f} "
        "GFLOP/s measured on this CPU)"
    )
