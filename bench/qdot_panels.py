"""Kernel microbenchmark: the int8 mode's paths for a 32-block weight at 5-63 rows of x on one
thread (the integer panels of kernels/cpu/qdot_gemm32.c, AMX-INT8 tiles, the exact paths),
on 7B's layer shapes, in thread CPU time (medians of interleaved runs, the order reversed
every other run), each path's ratio to the first one's time.

    python -m radixflow.bench.qdot_panels Q4_0 7                 # rows 5, 8, 12, ... 63
    python -m radixflow.bench.qdot_panels Q8_0 7 16,32 panels,amx-int8

Weights are random blocks with small fp16 scales (the kernels' time does not depend on the
values). Needs the native library; amx-int8 times the integer row path where the CPU has
no AMX-INT8.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from radixflow.kernels import quant
from radixflow.kernels.cpu import quant as native_quant

SHAPES = ((4096, 4096), (4096, 11008), (11008, 4096))  # (K, N): 7B's q/o, up/gate, down
ROWS = (5, 8, 12, 16, 24, 32, 40, 48, 63)
PATHS = ("panels", "amx-int8", "exact")


def weight(qtype: int, n: int, k: int, gen: torch.Generator) -> quant.QuantWeight:
    """Random blocks whose fp16 d (and Q4_1's m) are small and finite."""
    base = quant.Q4_1 if qtype == quant.Q4_1R else qtype
    size, type_size = quant.BLOCK[base]
    blocks = torch.randint(0, 256, (n * k // size, type_size), dtype=torch.uint8, generator=gen)
    for at in (0, 2) if base in (quant.Q4_1, quant.Q5_1) else (0,):
        d = (torch.rand(len(blocks), generator=gen) - 0.5) * 0.02
        blocks[:, at : at + 2] = d.half().view(torch.uint8).view(-1, 2)
    w = quant.QuantWeight(base, blocks.reshape(n, -1).contiguous(), (n, k))
    return quant.repack(w) if qtype == quant.Q4_1R else w


def select(path: str) -> None:
    """Route the next int8-mode calls to `path` (defaults restored first)."""
    for reset in (native_quant.set_int_rows, native_quant.set_int_gemm_rows,
                  native_quant.set_amx_int_rows, native_quant.set_amx_bf16_rows,
                  native_quant.set_amx_rows):  # fmt: skip
        reset(0)
    if path == "panels":  # the integer panels (AMX-INT8 off)
        native_quant.set_amx_int_rows(1 << 30)
        native_quant.set_int_rows(1 << 20)
    elif path == "amx-int8":  # the integer path held to its one-pass rows
        native_quant.set_int_rows(4)
    elif path == "exact":  # fp32 panels, as int8 mode ran above 4 rows without AMX before
        native_quant.set_amx_int_rows(1 << 30)
        native_quant.set_amx_rows(1 << 30)
        native_quant.set_int_rows(4)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    qtype = {v: k for k, v in quant.NAMES.items()}[args[0] if args else "Q4_0"]
    reps = int(args[1]) if len(args) > 1 else 7
    rows = [int(r) for r in args[2].split(",")] if len(args) > 2 else ROWS
    paths = args[3].split(",") if len(args) > 3 else PATHS
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    try:
        for k, n in SHAPES:
            w = weight(qtype, n, k, gen)
            for m in rows:
                x = torch.randn((m, k), generator=gen)
                out = torch.empty((m, n))
                times: dict[str, list[float]] = {p: [] for p in paths}
                for r in range(reps + 1):  # the first round warms up
                    for p in paths if r % 2 else paths[::-1]:
                        select(p)
                        t0 = time.thread_time()
                        native_quant.linear(x, w, out=out, activations="int8")
                        if r:
                            times[p].append(time.thread_time() - t0)
                med = {p: statistics.median(v) * 1e3 for p, v in times.items()}
                cols = " ".join(
                    f"{p} {v:7.2f} ms ({v / med[paths[0]]:4.2f}x)" for p, v in med.items()
                )
                print(f"K={k:5d} N={n:5d} M={m:3d} {cols}", flush=True)
    finally:
        select("defaults")
    return 0


if __name__ == "__main__":
    sys.exit(main())
