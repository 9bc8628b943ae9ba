"""Decode step time of tensor parallelism: tp=1 against tp=N through the offline Engine.

    python -m radixflow.bench.tp_step [--model smollm2] [--tp 2] [--batch 1 64] [--steps 20]
    python -m radixflow.bench.tp_step --collectives-only     (the bare gloo all-reduce)

For each tensor-parallel size and batch: `batch` prompts are submitted, stepped until every
one decodes, then `steps` decode steps are timed one by one (median). Rank 0's time inside
the collectives (the layers' all-reduces, the logits gather, the plan broadcast) is timed
around `TensorParallel`'s calls: it is transfer plus waiting for the slower rank. The bare
all-reduce latency at the step's shapes (two processes doing nothing else) separates the two.
One torch thread per rank (`--threads`), so tp=N uses N cores where tp=1 uses one.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from radixflow.runtime import Engine
from radixflow.runtime.distributed.tensor_parallel import TensorParallel

PROMPT = "Write a long story about a robot who learns to paint. Chapter {}:"


def _timed(calls: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            calls[name] = calls.get(name, 0.0) + time.perf_counter() - start

    return wrapper


def measure(model: str, tp: int, batches: list[int], steps: int, threads: int) -> list[dict]:

    rows = []
    engine = Engine(model=model, tp_size=tp, num_threads=threads, max_total_tokens=16384)
    calls: dict[str, float] = {}
    group = engine._loaded.tp  # rank 0's TensorParallel (None at tp=1)
    if group is not None:  # instance attributes shadow the methods the shards call
        for name in ("all_reduce", "gather", "send_plan"):
            setattr(group, name, _timed(calls, name, getattr(group, name)))
    try:
        for batch in batches:
            params = {"max_new_tokens": steps + 8, "temperature": 0, "ignore_eos": True}
            handles = engine.submit([PROMPT.format(i) for i in range(batch)], params)
            while not all(h.num_output_tokens >= 2 for h in handles):
                engine.step()
            times = []
            calls.clear()
            for _ in range(steps):
                start = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - start)
            comm = {k: 1000 * v / steps for k, v in calls.items()}
            rows.append({"tp": tp, "batch": batch, "step_ms": 1000 * statistics.median(times),
                         "mean_ms": 1000 * statistics.mean(times),
                         "collective_ms": comm})  # fmt: skip
            while engine.step():
                pass
    finally:
        engine.shutdown()
    return rows


def collective_latency(rank: int, addr: str, shapes: list[tuple[int, int]], reps: int) -> dict:
    """Two ranks all-reduce (rows, hidden) fp32 back to back: ms per call, by shape."""

    torch.set_num_threads(1)
    listen = None
    if rank == 0:
        listener = socket.create_server(("127.0.0.1", 0))
        addr = f"127.0.0.1:{listener.getsockname()[1]}"
        listen = listener.detach()
        peer = subprocess.Popen([sys.executable, "-m", "radixflow.bench.tp_step",
                                 "--collectives-only", "--rank", "1", "--addr", addr])  # fmt: skip
    group = TensorParallel.join(rank, 2, addr, 60.0, torch.device("cpu"), listen)
    out = {}
    for rows, hidden in shapes:
        tensor = torch.ones(rows, hidden)
        for _ in range(10):
            group.all_reduce(tensor)
        start = time.perf_counter()
        for _ in range(reps):
            group.all_reduce(tensor)
        out[f"{rows}x{hidden}"] = 1000 * (time.perf_counter() - start) / reps
    group.close(stop=False)
    if rank == 0:
        peer.wait(60)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixflow.bench.tp_step", description=__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--hidden", type=int, default=576, help="all-reduce width")
    parser.add_argument("--collectives-only", action="store_true")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--addr", default="")
    args = parser.parse_args(argv)
    if args.collectives_only:
        shapes = [(b, args.hidden) for b in args.batch]
        result = collective_latency(args.rank, args.addr, shapes, 200)
        if args.rank == 0:
            print(json.dumps({"allreduce_ms": result}))
        return 0
    for tp in sorted({1, args.tp}):
        for row in measure(args.model, tp, args.batch, args.steps, args.threads):
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
