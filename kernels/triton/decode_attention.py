"""Split-KV ("flash decoding") Triton kernel for one query token per request.

Same signature and semantics as `radixflow.kernels.reference.decode_attention`.
Stage 1 (grid: batch, KV-head tiles, splits) attends the query heads of one KV head, as a
`[BLOCK_H, D]` tile, to one contiguous split of the request's pooled KV and writes the
split's normalized output and log-sum-exp. Stage 2 (grid: batch, heads) merges the splits
with their log-sum-exps, and with the request's shared-prefix entries when a `layout` is
given (`radixflow.kernels.triton.shared_prefix_attention`). Both stages derive a split's range
from `_split_range`, so stage 2 reads exactly the splits stage 1 wrote (empty splits are
never written and never read).
Math runs in fp32; the output comes back in q's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixflow.kernels.triton.online_softmax import (
    FLOAT_DTYPES,
    check_index_tensor,
    interpreting,
    online_softmax_step,
)
from radixflow.kernels.triton.shared_prefix_attention import (
    DecodeLayout,
    decode_layout,
    shared_prefix_attention,
)

__all__ = ["BLOCK_H", "BLOCK_N", "decode_attention", "decode_layout"]

BLOCK_H = 16  # query heads per tile: tl.dot needs every dim >= 16; padding heads are masked
BLOCK_N = 32  # keys per loop step, also the granularity of split boundaries


@triton.jit
def _split_range(seq_len, split, num_kv_splits, BLOCK_N: tl.constexpr):
    """KV positions [lo, hi) of `split`; hi <= lo means the split is empty.

    Splits are `ceil(seq_len / num_kv_splits)` rounded up to BLOCK_N, so trailing splits
    of short requests are empty. Both stages call this: it is the one definition.
    """
    per_split = tl.cdiv(tl.cdiv(seq_len, num_kv_splits), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)
    return lo, hi


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    part_out_ptr,
    part_lse_ptr,
    sm_scale,
    num_kv_splits,
    head_dim,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    stride_pls,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Stage 1: softmax(q Kᵀ·scale) V over one split, for up to BLOCK_H heads of a KV head.

    Writes part_out[b, h, split] = acc / row_sum and part_lse[b, h, split] =
    row_max + log(row_sum); writes nothing for an empty split.
    """
    batch = tl.program_id(0)
    head_blocks = tl.cdiv(GROUP, BLOCK_H)
    kv_head = tl.program_id(1) // head_blocks
    split = tl.program_id(2)
    kv_start = tl.load(kv_indptr_ptr + batch).to(tl.int64)
    seq_len = (tl.load(kv_indptr_ptr + batch + 1).to(tl.int64) - kv_start).to(tl.int32)
    lo, hi = _split_range(seq_len, split, num_kv_splits, BLOCK_N)
    if hi <= lo:
        return

    group_offs = (tl.program_id(1) % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = group_offs < GROUP  # GROUP need not be a power of two
    heads = kv_head * GROUP + group_offs  # (BLOCK_H,)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    q_ptrs = q_ptr + batch * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # (BLOCK_H, BLOCK_D)
    if UPCAST:
        q = q.to(tl.float32)

    row_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        slots = tl.load(kv_indices_ptr + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
        mask_kv = mask_n[:, None] & mask_d[None, :]
        k_ptrs = k_ptr + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
        v_ptrs = v_ptr + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :]
        k = tl.load(k_ptrs, mask=mask_kv, other=0.0)  # (BLOCK_N, BLOCK_D)
        v = tl.load(v_ptrs, mask=mask_kv, other=0.0)  # (BLOCK_N, BLOCK_D)
        # Every step holds >= 1 valid key (start < hi), so row_max is finite from then on.
        row_max, row_sum, acc = online_softmax_step(
            q, k, v, mask_n[None, :], row_max, row_sum, acc, sm_scale, UPCAST
        )

    part = batch * stride_pob + heads * stride_poh + split * stride_pos  # (BLOCK_H,)
    out_ptrs = part_out_ptr + part[:, None] + offs_d[None, :]
    tl.store(out_ptrs, acc / row_sum[:, None], mask=mask_h[:, None] & mask_d[None, :])
    lse_ptrs = part_lse_ptr + batch * stride_plb + heads * stride_plh + split * stride_pls
    tl.store(lse_ptrs, row_max + tl.log(row_sum), mask=mask_h)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    kv_indptr_ptr,
    shared_out_ptr,
    shared_lse_ptr,
    row_entry_indptr_ptr,
    row_entries_ptr,
    num_kv_splits,
    head_dim,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    stride_pls,
    stride_ob,
    stride_oh,
    stride_soe,
    stride_soh,
    stride_sle,
    stride_slh,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SHARED: tl.constexpr,
):
    """Stage 2: out[b, h] = Σ_s e^{lse_s} o_s / Σ_s e^{lse_s} over the non-empty splits s
    and, with HAS_SHARED, over the request's shared-run entries (`shared_prefix_attention`).

    A request with no KV at all gets zeros (the reference's answer), not NaN.
    """
    batch = tl.program_id(0)
    head = tl.program_id(1)
    kv_start = tl.load(kv_indptr_ptr + batch).to(tl.int64)
    seq_len = (tl.load(kv_indptr_ptr + batch + 1).to(tl.int64) - kv_start).to(tl.int32)
    splits = tl.arange(0, BLOCK_S)
    lo, hi = _split_range(seq_len, splits, num_kv_splits, BLOCK_N)
    written = (splits < num_kv_splits) & (hi > lo)  # (BLOCK_S,) what stage 1 stored
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim

    lse_ptrs = part_lse_ptr + batch * stride_plb + head * stride_plh + splits * stride_pls
    lse = tl.load(lse_ptrs, mask=written, other=float("-inf"))  # (BLOCK_S,)
    lse_max = tl.max(lse, 0)  # -inf when the request has no own keys
    safe_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # no split: all weights 0
    weights = tl.exp(lse - safe_max)  # (BLOCK_S,) 0 for unwritten splits
    part = batch * stride_pob + head * stride_poh + splits[:, None] * stride_pos
    part_out = tl.load(
        part_out_ptr + part + offs_d[None, :], mask=written[:, None] & mask_d[None, :], other=0.0
    )  # (BLOCK_S, BLOCK_D)
    total = tl.sum(weights, 0)
    acc = tl.sum(weights[:, None] * part_out, 0)  # (BLOCK_D,) Σ e^{lse_s - max} o_s
    if HAS_SHARED:
        # Fold in each run's (o, lse) as one more split. A run holds >= 1 key, so its lse
        # and new_max are finite; with no own keys lse_max = -inf makes alpha 0 (and total
        # and acc are 0 then anyway).
        entry_start = tl.load(row_entry_indptr_ptr + batch).to(tl.int64)
        entry_end = tl.load(row_entry_indptr_ptr + batch + 1).to(tl.int64)
        for i in range(entry_start, entry_end):
            entry = tl.load(row_entries_ptr + i).to(tl.int64)
            entry_lse = tl.load(shared_lse_ptr + entry * stride_sle + head * stride_slh)
            entry_ptrs = shared_out_ptr + entry * stride_soe + head * stride_soh + offs_d
            entry_out = tl.load(entry_ptrs, mask=mask_d, other=0.0)  # (BLOCK_D,)
            new_max = tl.maximum(lse_max, entry_lse)
            alpha = tl.exp(lse_max - new_max)
            beta = tl.exp(entry_lse - new_max)
            total = total * alpha + beta
            acc = acc * alpha + entry_out * beta
            lse_max = new_max
    out = acc / tl.where(total == 0.0, 1.0, total)
    out_ptrs = out_ptr + batch * stride_ob + head * stride_oh + offs_d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_d)


def _check_inputs(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    num_kv_splits: int,
) -> None:
    """The launch contract: shapes, last-dim-contiguous strides, dtypes, one device."""
    assert q.dim() == 3 and k_buffer.dim() == 3, f"{q.shape=} {k_buffer.shape=}"
    assert k_buffer.shape == v_buffer.shape, f"{k_buffer.shape=} {v_buffer.shape=}"
    assert q.shape[2] == k_buffer.shape[2], f"head_dim: {q.shape=} {k_buffer.shape=}"
    assert q.shape[1] % k_buffer.shape[1] == 0, f"GQA: {q.shape=} {k_buffer.shape=}"
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        assert t.stride(-1) == 1, f"{name} last dim must be contiguous: {t.stride()}"
        assert t.dtype == q.dtype and t.dtype in FLOAT_DTYPES, f"{name} {t.dtype} vs {q.dtype}"
    for t in (k_buffer, v_buffer, kv_indptr, kv_indices):
        assert t.device == q.device, f"{t.device=} {q.device=}"
    check_index_tensor("kv_indptr", kv_indptr)
    check_index_tensor("kv_indices", kv_indices)
    assert kv_indptr.numel() == q.shape[0] + 1, f"{kv_indptr.shape=} {q.shape=}"
    assert num_kv_splits >= 1, f"{num_kv_splits=}"


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    num_kv_splits: int = 8,
    layout: DecodeLayout | None = None,
) -> torch.Tensor:
    """One query token per request over all its pooled KV (which already holds this token).

    q (B, H, D); k_buffer/v_buffer (num_slots, Hkv, D); request b reads
    `kv_indices[kv_indptr[b]:kv_indptr[b+1]]`. Returns a new contiguous (B, H, D) tensor.
    `layout` (`decode_layout` of this metadata) makes requests read the KV runs they share
    once per group (`shared_prefix_attention`) and split only their own keys.
    """
    _check_inputs(q, k_buffer, v_buffer, kv_indptr, kv_indices, num_kv_splits)
    if layout is not None:
        assert layout.kv_indptr.numel() == kv_indptr.numel(), f"{layout.kv_indptr.shape=}"
        assert layout.kv_indptr.device == q.device, f"{layout.kv_indptr.device=} {q.device=}"
        kv_indptr, kv_indices = layout.kv_indptr, layout.kv_indices  # own keys only
    batch_size, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    out = torch.empty((batch_size, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch_size == 0:
        return out
    shape = (batch_size, num_heads, num_kv_splits)
    part_out = torch.empty((*shape, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty(shape, dtype=torch.float32, device=q.device)  # (B, H, splits)
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    grid = (batch_size, num_kv_heads * triton.cdiv(group, BLOCK_H), num_kv_splits)
    _decode_split_kernel[grid](
        q, k_buffer, v_buffer, kv_indptr, kv_indices, part_out, part_lse,
        float(sm_scale), num_kv_splits, head_dim,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
        GROUP=group, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, BLOCK_D=block_d,
        UPCAST=interpreting(q.device), num_warps=4, num_stages=2,
    )  # fmt: skip
    has_shared = layout is not None and layout.num_groups > 0
    if has_shared:
        shared_out, shared_lse = shared_prefix_attention(q, k_buffer, v_buffer, layout, sm_scale)
        entry_indptr, entries = layout.row_entry_indptr, layout.row_entries
    else:  # never read (HAS_SHARED=False); any tensors of the right kind
        shared_out, shared_lse = part_out[:, :, 0], part_lse[:, :, 0]
        entry_indptr = entries = kv_indptr
    _decode_merge_kernel[(batch_size, num_heads)](
        part_out, part_lse, out, kv_indptr, shared_out, shared_lse, entry_indptr, entries,
        num_kv_splits, head_dim,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), part_lse.stride(2), out.stride(0), out.stride(1),
        shared_out.stride(0), shared_out.stride(1), shared_lse.stride(0), shared_lse.stride(1),
        BLOCK_S=triton.next_power_of_2(num_kv_splits), BLOCK_N=BLOCK_N, BLOCK_D=block_d,
        HAS_SHARED=has_shared,
    )  # fmt: skip
    return out
