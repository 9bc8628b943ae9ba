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


def _ragged_positions(indptr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a prefix-sum `indptr` (B+1,), the request index and in-request offset of each row."""
    lens = indptr[1:] - indptr[:-1]
    total = int(indptr[-1])
    batch = torch.repeat_interleave(torch.arange(lens.numel(), device=indptr.device), lens)
    offset = torch.arange(total, device=indptr.device) - indptr[:-1][batch]
    return batch, offset


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
) -> torch.Tensor:
    """Attention of new tokens over their request's cached prefix and (causally) each other.

    q (T, H, D); k_extend/v_extend (T, Hkv, D) are the new tokens' own K/V; the prefix of
    request b is `kv_indices[kv_indptr[b]:kv_indptr[b+1]]` in the pools. New token i of a
    request with prefix P sees keys 0 .. P + i (bottom-right causal mask). Returns (T, H, D).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_extend.shape[1]
    batch_size = qo_indptr.numel() - 1
    extend_lens = qo_indptr[1:] - qo_indptr[:-1]
    prefix_lens = kv_indptr[1:] - kv_indptr[:-1]
    max_q = int(extend_lens.max()) if batch_size else 0
    max_k = int((extend_lens + prefix_lens).max()) if batch_size else 0
    if num_tokens == 0:
        return q.new_zeros(q.shape)

    # Pad keys/values of every request into (B, max_k, Hkv, D): prefix first, then new tokens.
    keys = q.new_zeros((batch_size, max_k, num_kv_heads, head_dim), dtype=torch.float32)
    values = torch.zeros_like(keys)
    pb, po = _ragged_positions(kv_indptr)
    keys[pb, po] = k_buffer[kv_indices].float()
    values[pb, po] = v_buffer[kv_indices].float()
    eb, eo = _ragged_positions(qo_indptr)
    keys[eb, prefix_lens[eb] + eo] = k_extend.float()
    values[eb, prefix_lens[eb] + eo] = v_extend.float()

    queries = q.new_zeros((batch_size, max_q, num_heads, head_dim), dtype=torch.float32)
    queries[eb, eo] = q.float()

    # Visible iff key j <= prefix + i (bottom-right causal); padding keys are past that.
    rows = torch.arange(max_q, device=q.device)
    cols = torch.arange(max_k, device=q.device)
    mask = cols[None, None, :] <= (prefix_lens[:, None, None] + rows[None, :, None])
    mask = mask & (rows[None, :, None] < extend_lens[:, None, None])  # (B, max_q, max_k)

    out = _masked_attention(queries, keys, values, mask, sm_scale)  # (B, max_q, H, D)
    return out[eb, eo].to(q.dtype)


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    num_kv_splits: int = 8,
) -> torch.Tensor:
    """One query token per request over all its pooled KV (which already holds this token).

    q (B, H, D); request b reads `kv_indices[kv_indptr[b]:kv_indptr[b+1]]`. `num_kv_splits`
    only matters to the split-KV kernel (the math does not depend on it). Returns (B, H, D).
    """
    batch_size, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    if batch_size == 0:
        return q.new_zeros(q.shape)
    lens = kv_indptr[1:] - kv_indptr[:-1]
    max_k = int(lens.max())
    keys = q.new_zeros((batch_size, max_k, num_kv_heads, head_dim), dtype=torch.float32)
    values = torch.zeros_like(keys)
    pb, po = _ragged_positions(kv_indptr)
    keys[pb, po] = k_buffer[kv_indices].float()
    values[pb, po] = v_buffer[kv_indices].float()
    cols = torch.arange(max_k, device=q.device)
    mask = (cols[None, :] < lens[:, None])[:, None, :]  # (B, 1, max_k)
    out = _masked_attention(q.float()[:, None], keys, values, mask, sm_scale)
    return out[:, 0].to(q.dtype)


def _masked_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """queries (B, Lq, H, D), keys/values (B, Lk, Hkv, D), mask (B, Lq, Lk) -> (B, Lq, H, D)."""
    batch_size, len_q, num_heads, head_dim = queries.shape
    num_kv_heads = keys.shape[2]
    group = num_heads // num_kv_heads
    # (B, Hkv, G, Lq, D) x (B, Hkv, Lk, D): the query heads of one KV head share its keys.
    qg = queries.view(batch_size, len_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    kt = keys.permute(0, 2, 1, 3)[:, :, None]
    vt = values.permute(0, 2, 1, 3)[:, :, None]
    scores = torch.matmul(qg, kt.transpose(-1, -2)) * sm_scale  # (B, Hkv, G, Lq, Lk)
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # fully masked padding rows -> 0
    out = torch.matmul(probs, vt)  # (B, Hkv, G, Lq, D)
    return out.permute(0, 3, 1, 2, 4).reshape(batch_size, len_q, num_heads, head_dim)
