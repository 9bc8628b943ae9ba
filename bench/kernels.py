"""Time the Triton attention kernels against the torch reference and SDPA on one CUDA GPU.

    python -m radixflow.bench.kernels                 # 64 requests x 2048 cached tokens
    python -m radixflow.bench.kernels --dtype bf16 --splits 16 --extend 512

Decode: one new token per request over `context` pooled tokens at shuffled slots. Extend:
`extend` new tokens per request over a cached prefix of `context - extend` tokens. SDPA runs
twice: on K/V already dense per request (the best case, which a paged pool cannot have) and
with the gather from the pool included. Prints milliseconds (median of triton's do_bench),
the ratio to the Triton kernel, and the max abs difference from the torch reference.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixflow.kernels import reference

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class Shape:
    batch: int
    context: int  # KV length per request, new tokens included
    extend: int  # new tokens per request in the extend benchmark
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    splits: int


def parse_args(argv: list[str] | None) -> Shape:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="requests per launch")
    parser.add_argument("--context", type=int, default=2048, help="KV tokens per request")
    parser.add_argument("--extend", type=int, default=128, help="new tokens per extend request")
    parser.add_argument("--heads", type=int, default=9, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=3, help="key/value heads")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    parser.add_argument("--splits", type=int, default=8, help="decode num_kv_splits")
    a = parser.parse_args(argv)
    if not 0 < a.extend <= a.context:
        parser.error(f"need 0 < --extend <= --context, got {a.extend} and {a.context}")
    return Shape(
        a.batch, a.context, a.extend, a.heads, a.kv_heads, a.head_dim, DTYPES[a.dtype], a.splits
    )


def make_pool(shape: Shape, num_used: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V pools (num_slots, Hkv, D) and `num_used` shuffled slots (never the dummy slot 0)."""
    num_slots = num_used + 1
    size = (num_slots, shape.num_kv_heads, shape.head_dim)
    k_buffer = torch.randn(size, device="cuda", dtype=shape.dtype)
    v_buffer = torch.randn(size, device="cuda", dtype=shape.dtype)
    slots = 1 + torch.randperm(num_used, device="cuda")  # (num_used,) int64
    return k_buffer, v_buffer, slots


def uniform_indptr(batch: int, length: int) -> torch.Tensor:
    return torch.arange(batch + 1, device="cuda", dtype=torch.int64) * length


def dense(buffer: torch.Tensor, slots: torch.Tensor, shape: Shape) -> torch.Tensor:
    """Gather pooled rows into (B, Hkv, L, D) per-request K or V, as SDPA wants them."""
    rows = buffer[slots].view(shape.batch, -1, shape.num_kv_heads, shape.head_dim)
    return rows.transpose(1, 2).contiguous()


def sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """q (B, H, Lq, D), k/v (B, Hkv, Lk, D): grouped-query SDPA."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def decode_cases(shape: Shape) -> dict[str, Callable[[], torch.Tensor]]:
    """The decode implementations to time; each returns (B, H, D)."""
    from radixflow.kernels.triton.decode_attention import decode_attention  # noqa: PLC0415 (optional: triton, CUDA only)

    k_buffer, v_buffer, slots = make_pool(shape, shape.batch * shape.context)
    kv_indptr = uniform_indptr(shape.batch, shape.context)
    q = torch.randn((shape.batch, shape.num_heads, shape.head_dim), device="cuda").to(shape.dtype)
    args = (q, k_buffer, v_buffer, kv_indptr, slots, shape.head_dim**-0.5)
    k_dense, v_dense = dense(k_buffer, slots, shape), dense(v_buffer, slots, shape)
    q4 = q[:, :, None]  # (B, H, 1, D)

    def gather_sdpa() -> torch.Tensor:
        return sdpa(q4, dense(k_buffer, slots, shape), dense(v_buffer, slots, shape), None)[:, :, 0]

    return {
        "triton": lambda: decode_attention(*args, num_kv_splits=shape.splits),
        "torch reference": lambda: reference.decode_attention(*args),
        "sdpa, dense KV": lambda: sdpa(q4, k_dense, v_dense, None)[:, :, 0],
        "sdpa + gather": gather_sdpa,
    }


def extend_cases(shape: Shape) -> dict[str, Callable[[], torch.Tensor]]:
    """The extend implementations to time; each returns (B * extend, H, D)."""
    from radixflow.kernels.triton.extend_attention import extend_attention  # noqa: PLC0415 (optional: triton, CUDA only)

    prefix = shape.context - shape.extend
    k_buffer, v_buffer, slots = make_pool(shape, shape.batch * shape.context)
    num_tokens = shape.batch * shape.extend
    new_slots = slots.view(shape.batch, shape.context)[:, prefix:].reshape(-1)  # (T,)
    prefix_slots = slots.view(shape.batch, shape.context)[:, :prefix].reshape(-1)
    q = torch.randn((num_tokens, shape.num_heads, shape.head_dim), device="cuda").to(shape.dtype)
    args = (
        q, k_buffer[new_slots], v_buffer[new_slots], k_buffer, v_buffer,
        uniform_indptr(shape.batch, shape.extend), uniform_indptr(shape.batch, prefix),
        prefix_slots, shape.head_dim**-0.5,
    )  # fmt: skip
    k_dense, v_dense = dense(k_buffer, slots, shape), dense(v_buffer, slots, shape)
    q4 = q.view(shape.batch, shape.extend, shape.num_heads, -1).transpose(1, 2)  # (B, H, E, D)
    # bottom-right causal: new token i sees keys 0 .. prefix + i
    mask = torch.ones(shape.extend, shape.context, device="cuda", dtype=torch.bool)
    mask = mask.tril(prefix)  # (E, L)

    def flat(out: torch.Tensor) -> torch.Tensor:  # (B, H, E, D) -> (T, H, D)
        return out.transpose(1, 2).reshape(num_tokens, shape.num_heads, shape.head_dim)

    def gather_sdpa() -> torch.Tensor:
        k, v = dense(k_buffer, slots, shape), dense(v_buffer, slots, shape)
        return flat(sdpa(q4, k, v, mask))

    return {
        "triton": lambda: extend_attention(*args),
        "torch reference": lambda: reference.extend_attention(*args),
        "sdpa, dense KV": lambda: flat(sdpa(q4, k_dense, v_dense, mask)),
        "sdpa + gather": gather_sdpa,
    }


def time_cases(op: str, cases: dict[str, Callable[[], torch.Tensor]]) -> dict[str, float]:
    """Print a row per case: milliseconds, ratio to the Triton kernel, max abs diff from the
    torch reference. Returns the milliseconds by case name."""
    from triton.testing import do_bench  # noqa: PLC0415 (optional: triton, CUDA only)

    expected = cases["torch reference"]().float()
    times = {
        name: do_bench(fn, warmup=10, rep=50, return_mode="median") for name, fn in cases.items()
    }
    for name, fn in cases.items():
        error = (fn().float() - expected).abs().max().item()
        ratio = times[name] / times["triton"]
        print(f"{op:<7} {name:<16} {times[name]:>9.3f} {ratio:>8.2f}x {error:>10.2e}")
    return times


def main(argv: list[str] | None = None) -> int:
    if not torch.cuda.is_available():
        print(
            "radixflow.bench.kernels needs a CUDA GPU: the Triton kernels only run there.",
            file=sys.stderr,
        )
        return 2
    shape = parse_args(argv)
    torch.manual_seed(0)
    print(
        f"{torch.cuda.get_device_name()}: {shape.batch} requests x {shape.context} tokens, "
        f"{shape.num_heads} q heads / {shape.num_kv_heads} kv heads, head_dim {shape.head_dim}, "
        f"{shape.dtype}, decode splits {shape.splits}, extend {shape.extend} new tokens"
    )
    print(f"{'op':<7} {'impl':<16} {'ms':>9} {'vs triton':>9} {'max |err|':>10}")
    decode_ms = time_cases("decode", decode_cases(shape))["triton"]
    time_cases("extend", extend_cases(shape))
    kv_bytes = 2 * shape.batch * shape.context * shape.num_kv_heads * shape.head_dim
    kv_bytes *= shape.dtype.itemsize
    print(f"triton decode: {kv_bytes / 1e6:.1f} MB of K/V, {kv_bytes / decode_ms / 1e6:.0f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
