"""Finding the KV runs that several requests share (cascade attention), for every backend.

The radix tree hands every request under one node the same pool slots, so a batch behind
one few-shot prefix holds the same slot ids at the same positions. A backend that finds
these runs can attend to each one in one dense product for all its requests' query rows,
and merge that partial result with the rest of each request's keys by log-sum-exp, instead
of gathering one copy of the run per request. Plain torch, on the metadata's device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SharedPrefix:
    """Query rows `q_rows` (n,) whose requests' pooled KV all holds `slots` (P,) at the same
    position (the run starts at the request's first key or right after an enclosing run).
    Every query of those rows sees the whole run: it precedes all their positions."""

    q_rows: torch.Tensor
    slots: torch.Tensor


MIN_SHARED_KEYS = 64  # shorter common runs stay in each request's own keys


def find_shared_prefixes(
    qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor
) -> tuple[tuple[SharedPrefix, ...], torch.Tensor]:
    """Runs of MIN_SHARED_KEYS or more slots that two or more requests hold at the same
    position, found level by level as in the radix tree: requests with the same slot at
    `offset` share the run up to their first difference, then split by the slot after it
    (a tree-of-thought batch: one run per problem, then one per first-level branch).
    -> (groups, per-request count (B,) of leading keys the groups cover)."""
    lens = kv_indptr[1:] - kv_indptr[:-1]
    skip = torch.zeros_like(lens)
    starts, device = kv_indptr[:-1], kv_indptr.device
    groups: list[SharedPrefix] = []
    lens_list, q_bounds = lens.tolist(), qo_indptr.tolist()  # one read each, not one per row

    def split(members: list[int], offset: int) -> None:
        members = [b for b in members if lens_list[b] - offset >= MIN_SHARED_KEYS]
        if len(members) < 2:
            return
        by_slot: dict[int, list[int]] = {}
        for b, slot in zip(members, kv_indices[starts[members] + offset].tolist()):
            by_slot.setdefault(slot, []).append(b)
        for sub in by_slot.values():
            if len(sub) < 2:
                continue
            rows = torch.tensor(sub, device=device)
            cols = offset + torch.arange(int(lens[rows].min()) - offset, device=device)
            index = kv_indices[starts[rows][:, None] + cols]  # (n, shortest - offset)
            length = int((index == index[:1]).all(0).cumprod(0).sum())
            if length < MIN_SHARED_KEYS:
                continue
            skip[rows] = offset + length
            q_rows = [r for b in sub for r in range(q_bounds[b], q_bounds[b + 1])]
            rows_tensor = torch.tensor(q_rows, dtype=torch.int64, device=device)
            groups.append(SharedPrefix(rows_tensor, index[0, :length]))
            split(sub, offset + length)

    split(list(range(len(lens))), 0)
    return tuple(groups), skip


def drop_leading(
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    skip: torch.Tensor,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The metadata (B+1,), (sum,) of each request's keys after its first `skip[b]`: all of
    them, or the next `keep[b]`."""
    lens = kv_indptr[1:] - kv_indptr[:-1] - skip if keep is None else keep  # (B,)
    indptr = torch.cat([kv_indptr[:1] * 0, torch.cumsum(lens, 0)])
    owner = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens)
    offset = torch.arange(int(indptr[-1]), device=lens.device) - indptr[:-1][owner]
    return indptr, kv_indices[kv_indptr[:-1][owner] + skip[owner] + offset]
