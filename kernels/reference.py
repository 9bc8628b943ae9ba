"""The specification of every attention op: plain torch, one request at a time, any device.

Each function has the signature of its Triton kernel and is what the kernels and the CPU
fast path (`radixflow.kernels.cpu.attention`) are tested against. It is meant to be checked
by eye, not to be fast: no layouts, no grouping, no fused kernels.

Metadata format (integer tensors; B requests):
  qo_indptr  (B+1,)  prefix sum of each request's new-token count (rows of q / k_extend)
  kv_indptr  (B+1,)  prefix sum of each request's pooled KV length
  kv_indices (sum,)  pool slot of every pooled KV position, request after request
Pools are (num_slots, num_kv_heads, head_dim) per layer; slot 0 is a dummy. An int8 pool
(`kv_int8.Int8KV`) indexes as the same rows dequantized, and stores by quantizing.
Query head h uses KV head h // (num_heads // num_kv_heads) (grouped-query attention).
Math runs in fp32; outputs come back in q's dtype. A query that sees no key gets zeros.
"""

from __future__ import annotations

import torch

from radixflow.kernels.kv_int8 import Int8KV


def store_kv(
    k_buffer: torch.Tensor | Int8KV,
    v_buffer: torch.Tensor | Int8KV,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write new keys/values (n, num_kv_heads, head_dim) into the pools at `slots` (n,)."""
    if isinstance(k_buffer, Int8KV) and isinstance(v_buffer, Int8KV):
        k_buffer.store(slots, k)
        v_buffer.store(slots, v)
        return
    k_buffer[slots] = k.to(k_buffer.dtype)
    v_buffer[slots] = v.to(v_buffer.dtype)


def attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    logit_cap: float = 0.0,
) -> torch.Tensor:
    """softmax(q Kᵀ·scale, over visible keys) V for one request, in fp32.

    q (Lq, H, D); keys/values (Lk, Hkv, D); visible (Lq, Lk) bool -> (Lq, H, D).
    `logit_cap` c > 0 soft-caps the scores to c·tanh(score / c) before masking (Gemma 2).
    """
    group = q.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)  # (Lk, H, D): head h reads h // group
    values = values.float().repeat_interleave(group, dim=1)  # (Lk, H, D)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale  # (H, Lq, Lk)
    if logit_cap:
        scores = torch.tanh(scores / logit_cap) * logit_cap
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no visible key: zeros
    return torch.einsum("hqk,khd->qhd", probs, values)  # (Lq, H, D)


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
    sliding_window: int = 0,
    logit_cap: float = 0.0,
) -> torch.Tensor:
    """New tokens over their request's cached prefix and (causally) each other.

    q (T, H, D); k_extend/v_extend (T, Hkv, D) are the new tokens' own K/V; the prefix of
    request b is `kv_indices[kv_indptr[b]:kv_indptr[b+1]]` in the pools. New token i of a
    request with prefix P sees keys 0 .. P + i (bottom-right causal). Returns (T, H, D).
    `sliding_window` W > 0: it sees only keys P + i - W < j <= P + i (W keys, its own
    included, as transformers' sliding-window mask). `logit_cap` as in `attention`.
    """
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # (T, H, D)
    q_starts, kv_starts = qo_indptr.tolist(), kv_indptr.tolist()
    for b in range(len(q_starts) - 1):
        rows = slice(q_starts[b], q_starts[b + 1])
        slots = kv_indices[kv_starts[b] : kv_starts[b + 1]]  # (P,)
        prefix_len, extend_len = kv_starts[b + 1] - kv_starts[b], rows.stop - rows.start
        keys = torch.cat([k_buffer[slots], k_extend[rows]])  # (P + E, Hkv, D)
        values = torch.cat([v_buffer[slots], v_extend[rows]])
        ones = torch.ones(extend_len, prefix_len + extend_len, dtype=torch.bool, device=q.device)
        visible = ones.tril(prefix_len)  # (E, P + E): row i sees columns 0 .. P + i
        if sliding_window:  # and not columns <= P + i - W
            visible &= ~ones.tril(prefix_len - sliding_window)
        out[rows] = attention(q[rows], keys, values, visible, sm_scale, logit_cap)
    return out.to(q.dtype)


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    num_kv_splits: int = 8,
    sliding_window: int = 0,
    logit_cap: float = 0.0,
) -> torch.Tensor:
    """One query token per request over all its pooled KV (which already holds this token).

    q (B, H, D); request b reads `kv_indices[kv_indptr[b]:kv_indptr[b+1]]`. `num_kv_splits`
    only matters to the split-KV kernel (the math does not depend on it). Returns (B, H, D).
    `sliding_window` W > 0: only the last W keys are seen. `logit_cap` as in `attention`.
    """
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # (B, H, D)
    starts = kv_indptr.tolist()
    for b in range(q.shape[0]):
        slots = kv_indices[starts[b] : starts[b + 1]]  # (L,)
        visible = torch.ones(1, len(slots), dtype=torch.bool, device=q.device)  # (1, L)
        if sliding_window:
            visible[:, : max(len(slots) - sliding_window, 0)] = False
        keys, values = k_buffer[slots], v_buffer[slots]
        out[b] = attention(q[b : b + 1], keys, values, visible, sm_scale, logit_cap)[0]
    return out.to(q.dtype)
