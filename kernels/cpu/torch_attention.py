"""The torch path of the CPU attention (radixflow.kernels.cpu.attention): each request's own
keys attended by torch's fused kernel, which also returns the log-sum-exp, over views of the
pool, a grid's strided view or gathered groups, and merged with the runs several requests
share. Math in fp32."""

from __future__ import annotations

import torch

from radixflow.kernels.cpu.decode_layout import DecodeLayout
from radixflow.kernels.cpu.grid import Grid, grid_index, grid_view
from radixflow.kernels.shared_prefix import SharedPrefix


def own_keys(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    layout: DecodeLayout,
    sm_scale: float,
    logit_cap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path over each request's keys after the shared runs (views, the grid and
    its heads, gathered groups) -> fp32 out (B, H, D), lse (B, H)."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    if layout.views:
        rows = torch.tensor([row for row, _ in layout.views], device=q.device)
        out[rows], lse[rows] = attend_views(
            q, k_buffer, v_buffer, layout.views, sm_scale, logit_cap
        )
    hkv, (_, h, d) = k_buffer.shape[1], q.shape
    if layout.grid is not None:
        grid = layout.grid
        whole = grid.in_order and grid.count == q.shape[0]  # the batch in grid order
        if whole:
            queries = q.float().view(grid.count, hkv, h // hkv, d)
        else:
            queries = torch.zeros((grid.count, hkv, h // hkv, d), device=q.device)
            queries.index_copy_(
                0, grid.region, q.index_select(0, grid.rows).float().view(-1, hkv, h // hkv, d)
            )
        keys, values = grid_keys(k_buffer, grid), grid_keys(v_buffer, grid)
        grid_out, grid_lse = flash_with_lse(queries, keys, values, grid.bias, sm_scale, logit_cap)
        if whole:
            out, lse = grid_out.reshape(-1, h, d), grid_lse.reshape(-1, h)
        else:
            out.index_copy_(0, grid.rows, grid_out.index_select(0, grid.region).reshape(-1, h, d))
            lse.index_copy_(0, grid.rows, grid_lse.index_select(0, grid.region).reshape(-1, h))
    for rows, kv_index, mask, bias in layout.heads:
        part, part_lse = group_attention(
            q, k_buffer, v_buffer, rows, kv_index, mask, bias, sm_scale, logit_cap
        )
        merged, merged_lse = merge(
            out.index_select(0, rows), lse.index_select(0, rows), part, part_lse
        )
        out.index_copy_(0, rows, merged)
        lse.index_copy_(0, rows, merged_lse)
    for rows, kv_index, mask, bias in layout.groups:
        part, part_lse = group_attention(
            q, k_buffer, v_buffer, rows, kv_index, mask, bias, sm_scale, logit_cap
        )
        out.index_copy_(0, rows, part)
        lse.index_copy_(0, rows, part_lse)
    return out, lse


def group_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    rows: torch.Tensor,
    kv_index: torch.Tensor,
    mask: torch.Tensor,
    bias: torch.Tensor | None,
    sm_scale: float,
    logit_cap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One padded group of decodes over its gathered keys -> out (g, H, D), lse (g, H)."""
    keys, values = gather(k_buffer, kv_index), gather(v_buffer, kv_index)
    if bias is None:  # a member with no keys: the masked path zeroes its row
        out, lse = attention_lse(q[rows].float()[:, None], keys, values, mask, sm_scale, logit_cap)
        return out[:, 0], lse[:, 0]
    (_, h, d), hkv = q.shape, k_buffer.shape[1]
    queries = q.index_select(0, rows).float().view(len(rows), hkv, h // hkv, d)
    out, lse = flash_with_lse(queries, keys, values, bias, sm_scale, logit_cap)
    return out.reshape(-1, h, d), lse.reshape(-1, h)


def pool_view(rows: torch.Tensor, first: int, length: int) -> torch.Tensor:
    """Consecutive pool slots first .. first+length-1 -> fp32 (1, Hkv, length, D): a view of
    the pool (no copy) when it is fp32."""
    return rows[first : first + length].float().transpose(0, 1)[None]


def attend_views(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    views: tuple[tuple[int, tuple[tuple[int, int], ...]], ...],
    sm_scale: float,
    logit_cap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each view request's query (its heads grouped per KV head) over its runs, merged by
    log-sum-exp when there are several -> out (n, H, D), lse (n, H), in `views` order."""
    b, h, d = q.shape
    hkv = k_buffer.shape[1]
    grouped = q.float().view(b, hkv, h // hkv, d)
    outs, lses = [], []
    for row, runs in views:
        query = grouped[row : row + 1]  # (1, Hkv, group, D)
        out = lse = None
        for first, length in runs:
            keys, values = (pool_view(buf, first, length) for buf in (k_buffer, v_buffer))
            part, part_lse = flash_with_lse(query, keys, values, None, sm_scale, logit_cap)
            out, lse = (part, part_lse) if out is None else merge(out, lse, part, part_lse)
        outs.append(out.reshape(h, d))
        lses.append(lse.reshape(h))
    return torch.stack(outs), torch.stack(lses)


def merge(
    out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attentions of the same queries over disjoint keys, (..., D) outputs with (...)
    log-sum-exps -> the attention over all those keys (softmax weights by log-sum-exp)."""
    top = torch.maximum(lse, part_lse)
    w_out, w_part = torch.exp(lse - top), torch.exp(part_lse - top)
    total = w_out + w_part
    merged = (out * w_out[..., None] + part * w_part[..., None]) / total[..., None]
    return merged, top + torch.log(total)


def grid_keys(buffer: torch.Tensor, grid: Grid) -> torch.Tensor:
    """The grid's keys (count, Hkv, length, D) in fp32: a view of the pool, else gathered."""
    view = grid_view(buffer, grid)
    return view if view is not None else gather(buffer, grid_index(grid, buffer.shape[0]))


def gather(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows (N, Hkv, D) at index (B, L) -> fp32 (B, Hkv, L, D) (a transposed view).
    index_select copies rows about twice as fast as advanced indexing on CPU."""
    picked = rows.index_select(0, index.reshape(-1)).view(*index.shape, *rows.shape[1:])
    return picked.float().transpose(1, 2)


def masked_attention(
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


def attention_lse(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    sm_scale: float,
    logit_cap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`masked_attention` that also returns each row's log-sum-exp (B, Lq, H): -inf for a
    row that sees no key (its output is zeros). The query heads of one KV head go in as
    extra query rows, so the fused CPU kernel needs no grouped-query support."""
    b, lq, h, d = queries.shape
    hkv = keys.shape[1]
    if keys.shape[2] == 0:  # the fused kernel divides by the key count
        empty = torch.full((b, lq, h), -torch.inf, device=queries.device)
        return torch.zeros_like(queries), empty
    group = h // hkv
    grouped = queries.view(b, lq, hkv, group, d).permute(0, 2, 1, 3, 4).reshape(b, hkv, -1, d)
    rows_mask = (
        mask[:, None, :, None, :].expand(-1, -1, -1, group, -1).reshape(b, 1, lq * group, -1)
    )
    bias = torch.zeros(rows_mask.shape, device=queries.device).masked_fill_(~rows_mask, -torch.inf)
    out, lse = flash_with_lse(grouped, keys, values, bias, sm_scale, logit_cap)
    out = out.view(b, hkv, lq, group, d).permute(0, 2, 1, 3, 4).reshape(b, lq, h, d)
    lse = lse.view(b, hkv, lq, group).permute(0, 2, 1, 3).reshape(b, lq, h)
    sees_none = ~mask.any(-1)  # (B, Lq)
    lse = lse.masked_fill(sees_none[:, :, None], -torch.inf)
    return out.masked_fill(sees_none[:, :, None, None], 0.0), lse


def flash_with_lse(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor | None,
    sm_scale: float,
    logit_cap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, Hkv, Lq, D) over (B, Hkv, Lk, D) -> output (B, Hkv, Lq, D) and log-sum-exp
    (B, Hkv, Lq): torch's fused CPU attention kernel, which returns both. Soft-capped
    scores (`logit_cap`, Gemma 2) are spelled out: the fused kernel cannot cap them."""
    if logit_cap:
        scores = torch.tanh(queries @ keys.transpose(-1, -2) * sm_scale / logit_cap) * logit_cap
        scores = scores if bias is None else scores + bias  # (B, Hkv, Lq, Lk)
        return torch.softmax(scores, -1).nan_to_num_(0.0) @ values, torch.logsumexp(scores, -1)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        queries, keys, values, attn_mask=bias, scale=sm_scale
    )


def merge_shared(
    out: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    shared: tuple[SharedPrefix, ...],
    sm_scale: float,
    logit_cap: float = 0.0,
    starts: tuple[int, ...] = (),
) -> None:
    """Fold each shared prefix's attention into out (T, H, D) / lse (T, H), in place. Every
    query of a group sees the whole prefix (it precedes all their positions): no mask.
    `starts[i]` >= 0: run i is consecutive slots from there, read as a view of the pool."""
    hkv, d = k_buffer.shape[1], k_buffer.shape[2]
    group = q.shape[1] // hkv
    for i, prefix in enumerate(shared):
        rows = prefix.q_rows
        n = len(rows)
        queries = q[rows].float().view(n, hkv, group, d).transpose(0, 1).reshape(1, hkv, -1, d)
        first = starts[i] if i < len(starts) else -1
        if first >= 0:
            keys = pool_view(k_buffer, first, len(prefix.slots))  # (1, Hkv, P, D)
            values = pool_view(v_buffer, first, len(prefix.slots))
        else:
            keys = gather(k_buffer, prefix.slots[None])
            values = gather(v_buffer, prefix.slots[None])
        part, part_lse = flash_with_lse(queries, keys, values, None, sm_scale, logit_cap)
        part = part[0].view(hkv, n, group, d).transpose(0, 1).reshape(n, hkv * group, d)
        part_lse = part_lse[0].view(hkv, n, group).transpose(0, 1).reshape(n, hkv * group)
        out[rows], lse[rows] = merge(out[rows], lse[rows], part, part_lse)
