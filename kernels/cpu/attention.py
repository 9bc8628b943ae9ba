"""The CPU fast path of every attention op: what `get_ops` runs on CPU. Same signatures and
results as `radixflow.kernels.reference` (the spec, which the tests hold this to), plus an
optional `layout=` derived once per forward by `make_layout` / `decode_layout` (the latter
in `kernels/cpu/decode_layout.py`).

What makes it fast on CPU, each measured when it went in:
  - decodes are grouped by KV length and padded only to their group's longest (16 short
    chats beside one 3,000-token request no longer gather 3,000 keys each);
  - KV runs that several requests share (`find_shared_prefixes`) are read once per group of
    query rows and merged with each request's own keys by log-sum-exp (64 decodes behind an
    800-token prefix: 53 -> 3 ms per layer);
  - attention goes through torch's fused CPU kernel, which also returns the log-sum-exp,
    with the query heads of one KV head as extra query rows (no GQA expansion);
  - a long decode (VIEW_MIN_KEYS) whose own keys lie in a few runs of consecutive slots (the
    KV pool allocates each request's slots as contiguous runs) is attended over views of
    the pool, one fused call per run, instead of a gathered copy (64 decodes of 1,000 keys
    alone: 83 -> 20 ms per layer on 1 thread, 14.4 -> 12.6 ms on 2); the others are
    gathered, with index_select (about 2x advanced indexing);
  - short extends (verify rows of speculative decoding, a few new tokens each) read their
    cached keys as views of the pool with plain matmuls (kernels/cpu/short_extend.py);
  - extends whose requests are all short (ROWS_MAX_KEYS keys each, cached and new, and the
    caller names the slots the new keys are stored at) run as one decode row per new token
    on the native kernel, each row reading its own keys up to itself where they lie in the
    pool (64 prompts of 21 tokens, 2 threads: 1.6 -> 0.2 ms a layer a chunk of 512 rows);
  - the other decodes whose own keys are one run each on a common stride (the KV pool
    starts the runs of requests admitted together on multiples of a power of two) are read
    as one strided view of the pool, a grid, in one fused call (64 decodes, 2 threads: 1.38
    -> 0.71 ms per layer at 92 keys, 5.9 -> 1.9 ms at 400, against gathering them). Keys a
    grid row's mask hides are other slots of the pool: this needs a pool whose unwritten
    slots are finite (the runner's is zero-filled).
Metadata and pool conventions are the reference's. Math in fp32; outputs in q's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixflow.kernels import reference
from radixflow.kernels.cpu import native
from radixflow.kernels.cpu.decode_layout import DecodeLayout, decode_layout, padded, run_table
from radixflow.kernels.cpu.short_extend import (
    ShortExtend,
    plan_short_extend,
    short_extend_attention,
)
from radixflow.kernels.cpu.torch_attention import (
    attention_lse,
    gather,
    masked_attention,
    merge_shared,
    own_keys,
)
from radixflow.kernels.shared_prefix import SharedPrefix, drop_leading, find_shared_prefixes


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
    shared: tuple[SharedPrefix, ...] = ()
    short: ShortExtend | None = None  # every request short, its keys in few runs
    # the native kernel's run table (kernels/cpu/native.py) of one decode row per new token: its
    # request's cached keys, then the request's new tokens up to itself (`_row_runs`)
    row_runs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


# Extends whose requests all see at most this many keys (cached and new) run as decode rows on
# the native kernel: each row reads its keys again, so long requests stay on the fused kernel.
ROWS_MAX_KEYS = 128


def make_layout(
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sliding_window: int = 0,
    new_slots: torch.Tensor | None = None,
) -> Layout:
    """Layout for extend (new tokens over qo_indptr) or decode (qo_indptr = arange(B+1)).
    `sliding_window` W > 0: a query sees only keys less than W positions behind it, so each
    prefix is cut to its last W - 1 keys and no shared run is looked for. `new_slots` (T,):
    the pool slots the new tokens' keys and values are stored at before `extend_attention`
    runs with this layout (the model stores them first); with it, short requests may be
    attended as decode rows reading the pool (`row_runs`)."""
    short = None if sliding_window else plan_short_extend(qo_indptr, kv_indptr, kv_indices)
    if sliding_window:
        shared, lens = (), kv_indptr[1:] - kv_indptr[:-1]
        skip = (lens - (sliding_window - 1)).clamp(min=0)
        kv_indptr, kv_indices = drop_leading(kv_indptr, kv_indices, skip)
    else:
        shared, skip = find_shared_prefixes(qo_indptr, kv_indptr, kv_indices)
    if shared:
        kv_indptr, kv_indices = drop_leading(kv_indptr, kv_indices, skip)
    kv_index, prefix_lens = padded(kv_indptr, kv_indices)
    q_index, extend_lens = padded(qo_indptr, None)
    max_q = q_index.shape[1]
    i = torch.arange(max_q, device=qo_indptr.device)
    j = torch.arange(kv_index.shape[1], device=qo_indptr.device)
    # cached key j is visible iff j < prefix; new key e iff e <= i (bottom-right causal)
    cached = (j[None, None, :] < prefix_lens[:, None, None]).expand(-1, max_q, -1)
    new = (i[None, None, :] <= i[None, :, None]) & (i[None, None, :] < extend_lens[:, None, None])
    if sliding_window:  # a key d positions behind its query is visible iff d < window
        cached = cached & (prefix_lens[:, None, None] + i[None, :, None] - j < sliding_window)
        new = new & (i[None, :, None] - i[None, None, :] < sliding_window)
    rows_valid = i[None, :, None] < extend_lens[:, None, None]
    mask = torch.cat([cached, new.expand(len(extend_lens), -1, -1)], dim=-1) & rows_valid
    batch = torch.repeat_interleave(
        torch.arange(len(extend_lens), device=qo_indptr.device), extend_lens
    )
    rows = torch.arange(int(qo_indptr[-1]), device=qo_indptr.device) - qo_indptr[:-1][batch]
    row_runs = None
    if (
        new_slots is not None
        and not (sliding_window or shared)
        and len(extend_lens)
        and int((prefix_lens + extend_lens).max()) <= ROWS_MAX_KEYS
        and qo_indptr.device.type == "cpu"
        and native.library() is not None
    ):
        row_runs = _row_runs(kv_indptr, kv_indices, prefix_lens, new_slots, batch, rows)
    return Layout(kv_index, q_index, mask, batch, rows, shared, short, row_runs)


def _row_runs(
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    new_slots: torch.Tensor,
    batch: torch.Tensor,
    rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode row per new token (T rows): new token i of request b reads b's cached keys,
    then b's new tokens 0..i, as the native kernel's run table."""
    device = kv_indptr.device
    # request b's keys laid end to end: its cached prefix, then its new tokens' slots
    new_lens = torch.bincount(batch, minlength=len(prefix_lens))
    req_indptr = torch.zeros(len(prefix_lens) + 1, dtype=torch.long, device=device)
    req_indptr[1:] = torch.cumsum(prefix_lens + new_lens, 0)
    keys = torch.empty(int(req_indptr[-1]), dtype=torch.long, device=device)
    owners = torch.repeat_interleave(torch.arange(len(prefix_lens), device=device), prefix_lens)
    cached_at = torch.arange(len(kv_indices), device=device) - kv_indptr[:-1][owners]
    keys[req_indptr[:-1][owners] + cached_at] = kv_indices.long()
    keys[req_indptr[:-1][batch] + prefix_lens[batch] + rows] = new_slots.long()
    # row r reads the first prefix + i + 1 of its request's keys
    lens = prefix_lens[batch] + rows + 1
    row_indptr = torch.zeros(len(rows) + 1, dtype=torch.long, device=device)
    row_indptr[1:] = torch.cumsum(lens, 0)
    starts = torch.repeat_interleave(req_indptr[:-1][batch] - row_indptr[:-1], lens)
    return run_table(row_indptr, keys[starts + torch.arange(int(row_indptr[-1]), device=device)])


def store_kv(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """`reference.store_kv`, as one native copy loop where the kernels are built."""
    if not native.store_kv(k_buffer, v_buffer, slots, k, v):
        reference.store_kv(k_buffer, v_buffer, slots, k, v)


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
    sliding_window: int = 0,
    logit_cap: float = 0.0,
) -> torch.Tensor:
    """Attention of new tokens over their request's cached prefix and (causally) each other.

    q (T, H, D); k_extend/v_extend (T, Hkv, D) are the new tokens' own K/V; the prefix of
    request b is `kv_indices[kv_indptr[b]:kv_indptr[b+1]]` in the pools. New token i of a
    request with prefix P sees keys 0 .. P + i (bottom-right causal mask). Returns (T, H, D).
    `layout` (from `make_layout`, with the same `sliding_window`) may be passed to skip
    recomputing the indices. `sliding_window` and `logit_cap` as in the reference.
    """
    if q.shape[0] == 0:
        return q.new_zeros(q.shape)
    layout = layout or make_layout(qo_indptr, kv_indptr, kv_indices, sliding_window)
    if layout.short is not None and not logit_cap:
        short = layout.short
        return short_extend_attention(q, k_extend, v_extend, k_buffer, v_buffer, short, sm_scale)
    if layout.row_runs is not None:  # new keys already stored: read where they lie
        fast = native.decode_attention(q, k_buffer, v_buffer, layout.row_runs, sm_scale, logit_cap)
        if fast is not None:
            return fast[0].to(q.dtype)
    keys = torch.cat([gather(k_buffer, layout.kv_index), gather(k_extend, layout.q_index)], 2)
    values = torch.cat([gather(v_buffer, layout.kv_index), gather(v_extend, layout.q_index)], 2)
    queries = q[layout.q_index].float()  # (B, Lq, H, D)
    if not layout.shared and not logit_cap:
        out = masked_attention(queries, keys, values, layout.mask, sm_scale)  # (B, Lq, H, D)
        return out[layout.batch, layout.rows].to(q.dtype)
    out, lse = attention_lse(queries, keys, values, layout.mask, sm_scale, logit_cap)
    out, lse = out[layout.batch, layout.rows], lse[layout.batch, layout.rows]
    merge_shared(out, lse, q, k_buffer, v_buffer, layout.shared, sm_scale, logit_cap)
    return out.to(q.dtype)


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    num_kv_splits: int = 8,
    layout: DecodeLayout | None = None,
    sliding_window: int = 0,
    logit_cap: float = 0.0,
) -> torch.Tensor:
    """One query token per request over all its pooled KV (which already holds this token).

    q (B, H, D); request b reads `kv_indices[kv_indptr[b]:kv_indptr[b+1]]`. `num_kv_splits`
    only matters to the split-KV kernel (the math does not depend on it). Returns (B, H, D).
    """
    if q.shape[0] == 0:
        return q.new_zeros(q.shape)
    layout = layout or decode_layout(kv_indptr, kv_indices, sliding_window)
    fast = None
    if layout.runs is not None:
        fast = native.decode_attention(q, k_buffer, v_buffer, layout.runs, sm_scale, logit_cap)
        if fast is None:  # a pool the kernel does not take (fp16): torch's layout, once
            if "torch" not in layout.fallback:
                layout.fallback["torch"] = decode_layout(
                    kv_indptr, kv_indices, sliding_window, False
                )
            layout = layout.fallback["torch"]
    out, lse = fast or own_keys(q, k_buffer, v_buffer, layout, sm_scale, logit_cap)
    if layout.shared:
        merge_shared(
            out, lse, q, k_buffer, v_buffer, layout.shared, sm_scale, logit_cap,
            layout.shared_starts,
        )  # fmt: skip
    return out.to(q.dtype)


def rope_decode_attention(
    qkv: torch.Tensor,
    num_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out_slots: torch.Tensor,
    sm_scale: float,
    layout: DecodeLayout | None,
    logit_cap: float = 0.0,
) -> torch.Tensor | None:
    """A decode-only step's rope, KV store and attention from the fused projection qkv
    (B, (H + 2 Hkv) * D), in one native call (`native.rope_decode_attention`; qkv's query and
    key heads are rotated in place), then the shared prefixes merged as `decode_attention`
    does -> (B, H, D). None, with nothing touched, where the native kernels do not take it
    (no native runs in `layout`, other dtypes): the caller then rotates, stores and calls
    `decode_attention` itself."""
    if layout is None or layout.runs is None:
        return None
    fast = native.rope_decode_attention(
        qkv, num_heads, cos, sin, k_buffer, v_buffer, out_slots, layout.runs, sm_scale, logit_cap
    )
    if fast is None:
        return None
    out, lse = fast
    if layout.shared:
        q = qkv[:, : num_heads * k_buffer.shape[2]].view(len(qkv), num_heads, -1)
        merge_shared(
            out, lse, q, k_buffer, v_buffer, layout.shared, sm_scale, logit_cap,
            layout.shared_starts,
        )  # fmt: skip
    return out
