"""How a CPU decode batch reads its keys, derived once per forward and reused by every layer
(`decode_layout`, the `prepare_decode` of `CPU_OPS`): the KV runs several requests share,
then each request's own keys, as runs of consecutive pool slots for the native kernel
(`run_table`), or, on the torch path, as views of the pool, a grid, or gathered groups of
similar length. `kernels/cpu/attention.py` runs the attention over it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from radixflow.kernels.cpu import native
from radixflow.kernels.cpu.grid import Grid, make_grid
from radixflow.kernels.shared_prefix import SharedPrefix, drop_leading, find_shared_prefixes


def padded(indptr: torch.Tensor, values: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged runs of `values` (or of row numbers) -> (B, max_len) padded with 0, and lens."""
    lens = indptr[1:] - indptr[:-1]
    width = int(lens.max()) if lens.numel() else 0
    cols = torch.arange(width, device=indptr.device)
    valid = cols[None, :] < lens[:, None]
    index = (indptr[:-1, None] + cols[None, :]).clamp(max=max(int(indptr[-1]) - 1, 0))
    if values is not None:
        index = values[index] if values.numel() else torch.zeros_like(index)
    return torch.where(valid, index, torch.zeros_like(index)), lens


# Requests with fewer keys are gathered into one padded batch. Alone, a view beats the gather
# from 100 keys on (1 and 2 threads), but in the engine at 2 threads, 64 streams of 25-75 keys
# ran at 164 tok/s with views from 32 keys against 229 gathered (one fused call per request
# per layer costs more there than it saves); views are kept for long requests, where the
# gathered bytes rival the weights'. The in-engine crossover is not measured yet.
VIEW_MIN_KEYS = 1024
MAX_VIEW_RUNS = 8  # more runs than this: gathered (one fused call per run does not pay)


@dataclass(frozen=True)
class DecodeLayout:
    """How each decode reads its keys once shared runs are taken out. `views`: (row, runs)
    for requests whose keys lie in at most MAX_VIEW_RUNS runs of consecutive slots, each run
    (first slot, length) read as a view of the pool. `groups`: the other requests in groups
    of similar KV length, each padded to its longest: (rows (g,), kv_index (g, Lk), mask
    (g, 1, Lk), bias): bias (g, 1, 1, Lk) is the mask as 0 / -inf, built once per forward
    and broadcast over each request's query heads (None if a member has no keys). Padding
    every request to the batch's longest made 16 short chats beside one 3,000-token request
    gather 3,000 keys each, in every layer."""

    groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]]
    shared: tuple[SharedPrefix, ...] = ()
    views: tuple[tuple[int, tuple[tuple[int, int], ...]], ...] = ()
    shared_starts: tuple[int, ...] = ()  # per shared run: its first slot if consecutive, or -1
    grid: Grid | None = None
    heads: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]] = field(
        default_factory=list
    )  # grid requests' keys before their last run, grouped as `groups`, merged by lse
    # the native kernel's (run_indptr (B+1,), first slot (R,), count (R,)): every request's
    # keys after the shared runs, read where they lie (kernels/cpu/native.py); then nothing above
    # but `shared` is filled in
    runs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    fallback: dict[str, DecodeLayout] = field(default_factory=dict)  # torch's, if needed


def decode_layout(
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sliding_window: int = 0,
    native_runs: bool | None = None,
) -> DecodeLayout:
    """Shared prefixes first (`find_shared_prefixes`); then, where the native kernels are
    built (`native_runs` None: whether they are), each request's remaining keys as runs of
    consecutive slots for the native kernel; else each request's remaining keys are read
    as views when they lie in few consecutive runs (`slot_runs`), and the rest are
    grouped, longest first, while a group's padded size stays within twice its real size
    (one group when lengths are alike). `sliding_window` W > 0 keeps each request's last W
    keys only (all a decode sees), before looking for shared runs."""
    if sliding_window:
        skip = (kv_indptr[1:] - kv_indptr[:-1] - sliding_window).clamp(min=0)
        kv_indptr, kv_indices = drop_leading(kv_indptr, kv_indices, skip)
    shared: tuple[SharedPrefix, ...] = ()
    if len(kv_indptr) > 2:  # a shared run needs two requests: one stream skips the search
        batch = torch.arange(len(kv_indptr), device=kv_indptr.device)
        shared, skip = find_shared_prefixes(batch, kv_indptr, kv_indices)
    if shared:
        kv_indptr, kv_indices = drop_leading(kv_indptr, kv_indices, skip)
    starts = tuple(run_start(prefix.slots) for prefix in shared)
    if native_runs is None:
        native_runs = kv_indices.device.type == "cpu" and native.library() is not None
    if native_runs:
        return DecodeLayout([], shared, shared_starts=starts, runs=run_table(kv_indptr, kv_indices))
    views, gathered, tails = [], [], []
    for b, runs in enumerate(slot_runs(kv_indptr, kv_indices)):
        length = sum(n for _, n in runs)
        if length >= VIEW_MIN_KEYS and len(runs) <= MAX_VIEW_RUNS:
            views.append((b, tuple(runs)))
        elif runs:  # its last run may sit on the grid; keys before it are its head
            tails.append((b, runs[-1][0], runs[-1][1], length - runs[-1][1]))
        else:
            gathered.append(b)
    grid = make_grid(tails, kv_indptr.device)
    on_grid = set(grid.rows.tolist()) if grid is not None else set()
    gathered = sorted(gathered + [b for b, *_ in tails if b not in on_grid])
    heads = [(b, head) for b, _, _, head in tails if b in on_grid and head]
    head_groups = []
    if heads:  # each grid request's leading keys (a short run cached in the tree), gathered
        count = torch.zeros(len(kv_indptr) - 1, dtype=torch.long, device=kv_indptr.device)
        count[[b for b, _ in heads]] = torch.tensor([n for _, n in heads], device=count.device)
        head_indptr, head_indices = drop_leading(kv_indptr, kv_indices, count * 0, count)
        head_groups = _length_groups(head_indptr, head_indices, [b for b, _ in heads])
    return DecodeLayout(
        _length_groups(kv_indptr, kv_indices, gathered), shared, tuple(views), starts, grid,
        head_groups,
    )  # fmt: skip


def run_table(
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every request's keys as maximal runs of consecutive slots, in order: (run_indptr
    (B+1,), first slot (R,), count (R,)), request b owning runs run_indptr[b] ..
    run_indptr[b+1] - 1."""
    if kv_indptr.device.type == "cpu" and kv_indices.device.type == "cpu":
        table = native.run_table(kv_indptr, kv_indices)
        return table or _host_run_table(kv_indptr.numpy(), kv_indices.numpy())
    return _device_run_table(kv_indptr, kv_indices)


def _device_run_table(
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`run_table` in torch ops, on the tensors' device."""
    total, num = int(kv_indptr[-1]), len(kv_indptr) - 1
    run_indptr = torch.zeros(num + 1, dtype=torch.long, device=kv_indptr.device)
    if total == 0:
        return run_indptr, kv_indices[:0].long(), kv_indices[:0].long()
    breaks = torch.ones(total, dtype=torch.bool, device=kv_indices.device)
    breaks[1:] = kv_indices[1:] != kv_indices[:-1] + 1
    breaks[kv_indptr[:-1][kv_indptr[1:] > kv_indptr[:-1]]] = True  # runs end with requests
    begins = torch.nonzero(breaks)[:, 0]
    lengths = torch.diff(begins, append=begins.new_full((1,), total))
    owners = torch.searchsorted(kv_indptr, begins, right=True) - 1
    run_indptr[1:] = torch.bincount(owners, minlength=num).cumsum(0)
    return run_indptr, kv_indices[begins].long().contiguous(), lengths


def _host_run_table(
    kv_indptr: np.ndarray, kv_indices: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`run_table` in numpy, for host tensors where the native kernels are not built: the
    same integers, without a dozen torch calls' dispatch."""
    total, num = int(kv_indptr[-1]), len(kv_indptr) - 1
    run_indptr = np.zeros(num + 1, dtype=np.int64)
    if total == 0:
        empty = torch.zeros(0, dtype=torch.long)
        return torch.from_numpy(run_indptr), empty, empty.clone()
    keys = kv_indices[:total].astype(np.int64)
    breaks = np.ones(total, dtype=bool)
    np.not_equal(keys[1:], keys[:-1] + 1, out=breaks[1:])
    breaks[kv_indptr[:-1][kv_indptr[1:] > kv_indptr[:-1]]] = True  # runs end with requests
    begins = np.flatnonzero(breaks)
    lengths = np.diff(begins, append=total)
    owners = np.searchsorted(kv_indptr, begins, side="right") - 1
    run_indptr[1:] = np.cumsum(np.bincount(owners, minlength=num))
    return torch.from_numpy(run_indptr), torch.from_numpy(keys[begins]), torch.from_numpy(lengths)


def slot_runs(kv_indptr: torch.Tensor, kv_indices: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per request, its keys as maximal runs of consecutive slots: [(first slot, length)]."""
    run_indptr, first, count = run_table(kv_indptr, kv_indices)
    bounds, pairs = run_indptr.tolist(), list(zip(first.tolist(), count.tolist()))
    return [pairs[bounds[b] : bounds[b + 1]] for b in range(len(bounds) - 1)]


def run_start(slots: torch.Tensor) -> int:
    """The first slot of `slots` if they are consecutive (a view of the pool), else -1."""
    if len(slots) and bool((torch.diff(slots) == 1).all()):
        return int(slots[0])
    return -1


def _length_groups(
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor, members: list[int]
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    lens = (kv_indptr[1:] - kv_indptr[:-1]).tolist()
    order = sorted(members, key=lambda b: -lens[b])
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
        kv_index, group_lens = padded(indptr, torch.cat(spans) if spans else kv_indices)
        cols = torch.arange(kv_index.shape[1], device=kv_indptr.device)
        mask = (cols[None, :] < group_lens[:, None])[:, None, :]  # (g, 1, Lk)
        bias = None
        if lens[order[end - 1]] > 0:  # the group's shortest has keys
            bias = torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, -torch.inf)
            bias = bias[:, :, None]
        groups.append((rows, kv_index, mask, bias))
        start = end
    return groups
