"""What every Triton attention kernel here shares: the flash-attention step, the launch checks
on index tensors, and whether the kernels run in Triton's CPU interpreter."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def online_softmax_step(
    q,  # (ROWS, BLOCK_D)
    k,  # (BLOCK_N, BLOCK_D)
    v,  # (BLOCK_N, BLOCK_D)
    visible,  # (ROWS, BLOCK_N) or broadcastable: which scores take part
    row_max,  # (ROWS,) running max of the scores
    row_sum,  # (ROWS,) running sum of exp(score - row_max)
    acc,  # (ROWS, BLOCK_D) running sum of exp(score - row_max) * v, fp32
    sm_scale,
    UPCAST: tl.constexpr,
):
    """One flash-attention step: fold keys k / values v into (row_max, row_sum, acc).

    A row with no visible key in this step keeps its state unchanged as long as it saw a
    visible key before (its row_max is finite); callers order the steps so that is always
    true, which keeps `-inf - (-inf)` (NaN) out of the rescale. UPCAST runs the dots in
    fp32 (callers then pass an fp32 q): the interpreter's bf16 `tl.dot` is wrong.
    """
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale  # (ROWS, BLOCK_N)
    scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, 1))  # (ROWS,)
    alpha = tl.exp(row_max - new_max)  # (ROWS,) exp(-inf) = 0 on the first step
    p = tl.exp(scores - new_max[:, None])  # (ROWS, BLOCK_N)
    row_sum = row_sum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return new_max, row_sum, acc


def interpreting(device: torch.device) -> bool:
    """True when Triton runs in its CPU interpreter, whose bf16 `tl.dot` is wrong."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1" or device.type == "cpu"


def check_index_tensor(name: str, t: torch.Tensor) -> None:
    """Assert an indptr/indices tensor is integer, 1-D and contiguous."""
    assert t.dtype in INDEX_DTYPES, f"{name} must be int32/int64, got {t.dtype}"
    # an empty one may come with stride 0 (torch.from_numpy of an empty array); never read
    assert t.dim() == 1 and (t.stride(0) == 1 or t.numel() == 0), f"{name} {t.shape} {t.stride()}"
