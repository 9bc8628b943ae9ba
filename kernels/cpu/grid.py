"""The grid: a decode batch whose own KV runs lie on one stride of the pool, read as one
strided view (radixflow.kernels.cpu.attention's decode path). The KV pool starts the runs
of requests admitted together on multiples of a power of two (radixflow.runtime.cache.kv_pool),
so a batch admitted together forms a grid. Plain torch."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Grid:
    """Requests whose own keys (after any head: see DecodeLayout.heads) are one run each,
    inside row k of a strided view of the pool, (count, Hkv, length, D), row k starting at
    slot first + k * stride (rows with no request of the batch are holes: zero queries,
    outputs dropped). rows (n,) batch rows, region (n,) their grid row, bias (count, 1, 1,
    length) 0 on each request's own keys, -inf elsewhere (0 for holes: the keys a mask
    hides are other requests' or never-written zeroed slots, always finite)."""

    rows: torch.Tensor
    region: torch.Tensor
    first: int
    stride: int
    count: int
    length: int
    bias: torch.Tensor
    in_order: bool = False  # rows and region are both 0 .. count-1 (no holes, no reordering)


GRID_MIN_REQUESTS = 4  # fewer: the gathered group is as cheap


def make_grid(tails: list[tuple[int, int, int, int]], device: torch.device) -> Grid | None:
    """A Grid over the requests' last runs (row, first slot, length, head), or None when
    too few share a stride or the grid's padded keys (holes, offsets, unequal lengths)
    would be more than twice their own. The KV pool starts the runs of requests admitted
    together on multiples of a power of two (radixflow.runtime.cache.kv_pool); a run may start
    some slots into its grid row (a sliding window cut its first keys, or the tree took
    them over when a request beside it cached the same tokens): those columns are masked.
    The stride tried are the most common distance between starts and the powers of two;
    the one with the fewest padded plus gathered keys wins."""
    if len(tails) < GRID_MIN_REQUESTS:
        return None
    firsts = sorted(first for _, first, _, _ in tails)
    steps = Counter(b - a for a, b in zip(firsts, firsts[1:]) if b > a)
    candidates = {1 << k for k in range(3, 17)} | {step for step, _ in steps.most_common(1)}
    best = None
    for stride in sorted(candidates):
        by_region: dict[int, tuple[int, int, int]] = {}  # grid row -> (row, offset, length)
        for row, first, length, _ in tails:
            region, offset = divmod(first, stride)
            if region not in by_region or length > by_region[region][2]:
                by_region[region] = (row, offset, length)
        by_region = _densest_window(by_region)
        if len(by_region) < GRID_MIN_REQUESTS:
            continue
        count = max(by_region) - min(by_region) + 1
        length = max(offset + n for _, offset, n in by_region.values())
        own = sum(n for _, _, n in by_region.values())
        if count * length > 2 * own:
            continue
        cost = count * length + 2 * (sum(n for _, _, n, _ in tails) - own)  # gathered: 2x
        if best is None or cost < best[0]:
            best = (cost, stride, by_region, count, length)
    if best is None:
        return None
    _, stride, by_region, count, length = best
    low = min(by_region)
    regions = sorted(by_region)
    begin = torch.zeros(count, dtype=torch.long, device=device)
    end = torch.full((count,), length, dtype=torch.long, device=device)  # holes: all (finite)
    index = torch.tensor(regions, device=device) - low
    begin[index] = torch.tensor([by_region[k][1] for k in regions], device=device)
    end[index] = begin[index] + torch.tensor([by_region[k][2] for k in regions], device=device)
    cols = torch.arange(length, device=device)
    outside = (cols[None, :] < begin[:, None]) | (cols[None, :] >= end[:, None])
    bias = torch.zeros(count, 1, 1, length, device=device)
    bias.masked_fill_(outside[:, None, None, :], -torch.inf)
    row_list = [by_region[k][0] for k in regions]
    in_order = row_list == list(range(count))  # then regions are 0 .. count-1 as well
    rows = torch.tensor(row_list, device=device)
    return Grid(rows, index, low * stride, stride, count, length, bias, in_order)


def _densest_window(
    by_region: dict[int, tuple[int, int, int]],
) -> dict[int, tuple[int, int, int]]:
    """The consecutive grid rows holding the most keys whose rectangle stays within twice
    them. A wave of requests admitted together may wrap around the pool's end: its last
    runs then sit far from the others, and one grid over all of them would be mostly
    padding. The rows outside the window are gathered."""
    regions = sorted(by_region)
    length = max(offset + n for _, offset, n in by_region.values())
    keys = [0]
    for region in regions:
        keys.append(keys[-1] + by_region[region][2])
    best, left = (0, 0, 0), 0
    for right, region in enumerate(regions):
        while left <= right and (region - regions[left] + 1) * length > 2 * (
            keys[right + 1] - keys[left]
        ):
            left += 1
        if keys[right + 1] - keys[left] > best[0]:
            best = (keys[right + 1] - keys[left], left, right + 1)
    return {region: by_region[region] for region in regions[best[1] : best[2]]}


def grid_view(buffer: torch.Tensor, grid: Grid) -> torch.Tensor | None:
    """The grid's keys (count, Hkv, length, D) as a strided view of an fp32 pool (no copy;
    the masked columns read other slots of the pool, finite: the runner's pool is
    zero-filled, radixflow.runtime.model_executor.model_runner.zeroed_cache), or None for other
    dtypes or a grid whose last row would leave the pool (gather `grid_index` instead)."""
    _, hkv, d = buffer.shape
    last = grid.first + (grid.count - 1) * grid.stride + grid.length
    if buffer.dtype != torch.float32 or not buffer.is_contiguous() or last > buffer.shape[0]:
        return None
    return buffer.as_strided(
        (grid.count, hkv, grid.length, d),
        (grid.stride * hkv * d, d, hkv * d, 1),
        buffer.storage_offset() + grid.first * hkv * d,
    )


def grid_index(grid: Grid, num_slots: int) -> torch.Tensor:
    """(count, length) pool slots of the grid's keys, for gathering: the masked columns on
    slot 0, holes' rows kept inside the pool (their outputs are dropped)."""
    rows = grid.first + grid.stride * torch.arange(grid.count, device=grid.bias.device)
    index = (rows[:, None] + torch.arange(grid.length, device=rows.device)).clamp(max=num_slots - 1)
    hidden = torch.isinf(grid.bias[:, 0, 0])  # (count, length): masked columns
    return torch.where(hidden, torch.zeros_like(index), index)
