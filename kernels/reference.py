"""Torch reference of every attention op: the specification, the CPU path and the test oracle.

Metadata format shared with the Triton kernels (all int64 tensors on the op's device):
  qo_indptr  (B+1,)  prefix sum of each request's new-token count (rows of q / k_extend)
  kv_indptr  (B+1,)  prefix sum of each request's pooled KV length
  kv_indices (sum,)  pool slot of every pooled KV position, request after request
Pools are `[num_slots, num_kv_heads, head_dim]` per layer; slot 0 is a dummy.
Query head h uses KV head h // (num_heads // num_kv_heads) (grouped-query attention).
Math runs in fp32; outputs come back in q's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def store_kv(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write new keys/values `(n, num_kv_heads, head_dim)` into the pools at `slots` (n,)."""
    k_buffer[slots] = k.to(k_buffer.dtype)
    v_buffer[slots] = v.to(v_buffer.dtype)


@dataclass(frozen=True)
class Layout:
    """Padded gather indices derived from the metadata once per forward, reused by all layers.

    kv_index (B, Lk) pool slots of the cached keys, padded with slot 0; q_index (B, Lq) rows of
    the new tokens, padded with row 0; mask (B, Lq, Lk + Lq) which keys each query sees (cached
    keys first, then the new tokens); rows/batch (T,) map each new-token row back to (b, i).
    """

    kv_index: torch.Tensor
    q_index: torch.Tensor
    mask: torch.Tensor
    batch: torch.Tensor
    rows: torch.Tensor


def _padded(indptr: torch.Tensor, values: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged runs of `values` (or of row numbers) -> (B, max_len) padded with 0, and lens."""
    lens = indptr[1:] - indptr[:-1]
    width = int(lens.max()) if lens.numel() else 0
    cols = torch.arange(width, device=indptr.device)
    valid = cols[None, :] < lens[:, None]
    index = (indptr[:-1, None] + cols[None, :]).clamp(max=max(int(indptr[-1]) - 1, 0))
    if values is not None:
        index = values[index] if values.numel() else torch.zeros_like(index)
    return torch.where(valid, index, torch.zeros_like(index)), lens


def make_layout(
    qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor
) -> Layout:
    """Layout for extend (new tokens over qo_indptr) or decode (qo_indptr = arange(B+1))."""
    kv_index, prefix_lens = _padded(kv_indptr, kv_indices)
    q_index, extend_lens = _padded(qo_indptr, None)
    max_q = q_index.shape[1]
    i = torch.arange(max_q, device=qo_indptr.device)
    j = torch.arange(kv_index.shape[1], device=qo_indptr.device)
    # cached key j is visible iff j < prefix; new key e iff e <= i (bottom-right causal)
    cached = (j[None, None, :] < prefix_lens[:, None, None]).expand(-1, max_q, -1)
    new = (i[None, None, :] <= i[None, :, None]) & (i[None, None, :] < extend_lens[:, None, None])
    rows_valid = i[None, :, None] < extend_lens[:, None, None]
    mask = torch.cat([cached, new.expand(len(extend_lens), -1, -1)], dim=-1) & rows_valid
    batch = torch.repeat_interleave(
        torch.arange(len(extend_lens), device=qo_indptr.device), extend_lens
    )
    rows = torch.arange(int(qo_indptr[-1]), device=qo_indptr.device) - qo_indptr[:-1][batch]
    return Layout(kv_index, q_index, mask, batch, rows)


def extend_attention(
    q: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    layout: Layout | None = None,
) -> torch.Tensor:
    """Attention of new tokens over their request's cached prefix and (causally) each other.

    q (T, H, D); k_extend/v_extend (T, Hkv, D) are the new tokens' own K/V; the prefix of
    request b is `kv_indices[kv_indptr[b]:kv_indptr[b+1]]` in the pools. New token i of a
    request with prefix P sees keys 0 .. P + i (bottom-right causal mask). Returns (T, H, D).
    `layout` (from `make_layout`) may be passed to skip recomputing the indices.
    """
    if q.shape[0] == 0:
        return q.new_zeros(q.shape)
    layout = layout or make_layout(qo_indptr, kv_indptr, kv_indices)
    keys = torch.cat([_gather(k_buffer, layout.kv_index), _gather(k_extend, layout.q_index)], 2)
    values = torch.cat([_gather(v_buffer, layout.kv_index), _gather(v_extend, layout.q_index)], 2)
    queries = q[layout.q_index].float()  # (B, Lq, H, D)
    out = _masked_attention(queries, keys, values, layout.mask, sm_scale)  # (B, Lq, H, D)
    return out[layout.batch, layout.rows].to(q.dtype)


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

    q (B, H, D); request b reads `kv_indices[kv_indptr[b]:kv_indptr[b+1]]`. `num_kv_splits`
    only matters to the split-KV kernel (the math does not depend on it). Returns (B, H, D).
    """
    if q.shape[0] == 0:
        return q.new_zeros(q.shape)
    layout = layout or decode_layout(kv_indptr, kv_indices)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for rows, kv_index, mask in layout.groups:
        keys, values = _gather(k_buffer, kv_index), _gather(v_buffer, kv_index)
        out[rows] = _masked_attention(q[rows].float()[:, None], keys, values, mask, sm_scale)[:, 0]
    return out.to(q.dtype)


@dataclass(frozen=True)
class DecodeLayout:
    """Requests in groups of similar KV length, each padded to its longest: (rows (g,),
    kv_index (g, Lk), mask (g, 1, Lk)). Padding every request to the batch's longest made 16
    short chats beside one 3,000-token request gather 3,000 keys each, in every layer."""

    groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def decode_layout(kv_indptr: torch.Tensor, kv_indices: torch.Tensor) -> DecodeLayout:
    """Group requests, longest first, while a group's padded size stays within twice its
    real size; one group when lengths are alike."""
    lens = (kv_indptr[1:] - kv_indptr[:-1]).tolist()
    order = sorted(range(len(lens)), key=lambda b: -lens[b])
    groups, start = [], 0
    while start < len(order):
        end, total = start + 1, lens[order[start]]
        while end < len(order) and (end - start + 1) * lens[order[start]] <= 2 * (
            total + lens[order[end]]
        ):
            total += lens[order[end]]
            end += 1
        rows = torch.tensor(order[start:end], dtype=torch.long, device=kv_indptr.device)
        starts = kv_indptr[:-1][rows]
        indptr = torch.cat([starts.new_zeros(1), torch.cumsum(kv_indptr[1:][rows] - starts, 0)])
        spans = [kv_indices[kv_indptr[b] : kv_indptr[b + 1]] for b in order[start:end]]
        kv_index, group_lens = _padded(indptr, torch.cat(spans) if spans else kv_indices)
        cols = torch.arange(kv_index.shape[1], device=kv_indptr.device)
        groups.append((rows, kv_index, (cols[None, :] < group_lens[:, None])[:, None, :]))
        start = end
    return DecodeLayout(groups)


def _gather(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows (N, Hkv, D) at index (B, L) -> fp32 (B, Hkv, L, D) (a transposed view)."""
    return rows[index].float().transpose(1, 2)


def _masked_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """queries (B, Lq, H, D), keys/values (B, Hkv, Lk, D), mask (B, Lq, Lk) -> (B, Lq, H, D).

    torch's fused scaled_dot_product_attention (grouped-query heads, boolean mask): on CPU
    it is 2-5x faster than spelling out matmul, mask and softmax. Rows whose mask is all
    False (padding) come out as zeros."""
    out = torch.nn.functional.scaled_dot_product_attention(
        queries.transpose(1, 2),
        keys,
        values,
        attn_mask=mask[:, None],
        scale=sm_scale,
        enable_gqa=True,
    )  # (B, H, Lq, D)
    return out.transpose(1, 2).nan_to_num_(0.0)
