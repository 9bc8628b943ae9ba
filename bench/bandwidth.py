"""The memory roofline of one decode stream: the bytes of weights a token reads over this
machine's streaming read rate, measured here with the same threads.

    python -m radixflow.bench.bandwidth [--model FILE.gguf] [--threads N] [--repeats 5]

- read rate: a sum over as many bytes as the file holds, twice: in anonymous memory (filled
  first) and over the file's memory map (its pages in the page cache, as the model maps
  them); the median of `--repeats` passes each, GB/s (10^9 bytes).
- bytes a token: every tensor of the file once, except the token embedding (a token reads one
  of its rows), which counts only where no output matrix exists (the head reads it whole).
- roofline: bytes a token / the anonymous read rate, tokens/s; a decode faster than it would
  read less than its weights.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import math
import statistics
import time
from pathlib import Path

import gguf
import torch

from radixflow.kernels.cpu import native
from radixflow.runtime.models import gguf_file
from radixflow.runtime.models.loader import BUILTIN_MODELS, builtin_gguf


def token_bytes(path: Path) -> int:
    """Bytes of the file's tensors one decode token reads (module docstring)."""
    tensors = gguf_file.read_layout(path).tensors
    names = {t.name for t in tensors}
    tied = "output.weight" not in names
    total = 0
    for tensor in tensors:
        if tensor.name == "token_embd.weight" and not tied:
            continue
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(tensor.qtype)]
        total += math.prod(tensor.dims) // block * size
    return total


@functools.cache
def _probe() -> ctypes.CDLL:
    flags = ["-O3", "-march=native", "-shared", "-fPIC"]
    signature = {
        "rf_stream_read": (ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int])
    }
    lib = native.build(Path(__file__).with_name("stream_read.c"), "stream_read", flags, signature)
    if lib is None:
        raise SystemExit("the bandwidth probe needs a C compiler (bench/stream_read.c)")
    return lib


def read_rate(data: torch.Tensor, repeats: int) -> float:
    """GB/s of reading `data` (uint8, its length a multiple of 8) once per pass, on torch's
    thread count (stream_read.c); the median of `repeats` passes after one that faults the
    pages in."""
    lib, threads = _probe(), torch.get_num_threads()
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        lib.rf_stream_read(data.data_ptr(), data.numel() // 8, threads)
        times.append(time.perf_counter() - start)
    return data.numel() / statistics.median(times[1:]) / 1e9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m radixflow.bench.bandwidth")
    parser.add_argument("--model", default="smollm2", help="a GGUF file or a built-in model")
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = Path(builtin_gguf(args.model) if args.model in BUILTIN_MODELS else args.model)
    size = path.stat().st_size // 8 * 8
    anonymous = torch.ones(size, dtype=torch.uint8)
    anon_rate = read_rate(anonymous, args.repeats)
    del anonymous
    mapped = torch.from_numpy(gguf_file.map_file(path)[:size])
    mapped_rate = read_rate(mapped, args.repeats)
    per_token = token_bytes(path)
    print(
        json.dumps(
            {
                "model": path.name,
                "threads": torch.get_num_threads(),
                "read_gb_s": round(anon_rate, 1),
                "mapped_read_gb_s": round(mapped_rate, 1),
                "weight_bytes_per_token": per_token,
                "roofline_tokens_per_s": round(anon_rate * 1e9 / per_token, 2),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
