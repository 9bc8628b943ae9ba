"""fp32 CPU weights prepacked for MKL's sgemm.

`F.linear` hands MKL the weight as it is stored, and MKL repacks it into its blocked layout
on every call. At decode sizes (a few to a few hundred rows) that repacking is a large share
of each matmul: a 64-row step of SmolLM2's projections ran in 0.7-0.8x the time from a
packed copy on this project's Xeon. `prepack` packs each projection and the LM head once,
after loading; the model then multiplies through `torch.ops.mkl._mkl_linear`.

- The packed layout does not depend on the number of rows (MKL sizes it from the weight's
  shape alone), so one pack serves every batch size. `_mkl_linear` falls back to a plain
  linear unless told the rows it was packed for, so each call passes its own row count. A
  check at pack time compares both paths on a few row counts and keeps `F.linear` if they
  disagree (an MKL whose layout did depend on the rows).
- The plain weights stay (tensor-parallel sharding, tests and the loader read them), so the
  packed copies cost one more copy of the projection and head weights in memory, paid before
  the KV pool is sized from what is left.
- Results match `F.linear` to fp32 rounding (about 1e-6), not bit for bit. A single decode
  (fewer than PACKED_MIN_ROWS rows) still goes through `F.linear`.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)
PACK_ROWS = 64  # the row count MKL is told at pack time; the layout does not depend on it
# Fewer rows go through F.linear, whose matrix-vector path wins there: at 1 row it took
# 0.70-0.99x the packed time per SmolLM2 projection, while at 4 rows the packed one was
# 1.1-2.6x faster (2 threads).
PACKED_MIN_ROWS = 4


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch can pack weights of `dtype` on `device`: fp32 on a CPU build
    with MKL (x86)."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_linear")
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """MKL's packed copy of an (out, in) fp32 weight."""
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), PACK_ROWS)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    packed: torch.Tensor | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, from `packed` when there is one and the rows are many."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if packed is None or rows < PACKED_MIN_ROWS:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    out = torch.ops.mkl._mkl_linear(flat, packed, weight, bias, rows)
    return out.reshape(*x.shape[:-1], weight.shape[0])


class PackedLinear(nn.Module):
    """An `nn.Linear` (same `weight` and `bias` parameters) multiplied from a packed copy."""

    def __init__(self, linear: nn.Linear, packed: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = pack(linear.weight) if packed is None else packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.packed, self.bias)


def agrees(weight: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether `packed` reproduces `F.linear` at row counts other than PACK_ROWS."""
    generator = torch.Generator().manual_seed(0)
    for rows in (PACKED_MIN_ROWS, 7, PACK_ROWS + 3):
        x = torch.randn(rows, weight.shape[1], generator=generator)
        want = F.linear(x, weight)
        if not torch.allclose(linear(x, weight, packed), want, rtol=1e-4, atol=1e-4):
            return False
    return True


def prepack(model: nn.Module) -> int:
    """Replace the model's `nn.Linear` projections by `PackedLinear` and pack its LM head
    (`model.head_pack`). Returns the number of weights packed; 0 where this torch cannot
    pack the model's weights or the packed path disagrees with `F.linear`."""
    param = next(model.parameters())
    if not available(param.device, param.dtype):
        return 0
    with torch.inference_mode():
        found = [
            (parent, name, child)
            for parent in model.modules()
            for name, child in parent.named_children()
            if type(child) is nn.Linear
        ]
        if not found:
            return 0
        first = pack(found[0][2].weight)  # checked once, then used
        if not agrees(found[0][2].weight, first):
            log.warning("MKL's packed sgemm disagrees with F.linear here: weights left unpacked")
            return 0
        for i, (parent, name, child) in enumerate(found):
            setattr(parent, name, PackedLinear(child, first if i == 0 else None))
        head = getattr(model, "lm_head", None)  # untied: packed with the projections
        if isinstance(head, PackedLinear):
            model.head_pack = head.packed
        else:
            model.head_pack = pack(model.embed_tokens.weight if head is None else head.weight)
    return len(found) + 1
