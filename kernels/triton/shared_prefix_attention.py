"""Triton attention over KV runs shared by several decoding requests (cascade attention).

`decode_layout` finds the runs once per forward (`find_shared_prefixes`, as the CPU path
does) and packs them for the kernels; `shared_prefix_attention` attends each run for all of
its query rows at once, so the run's keys are read once per tile of BLOCK_M (request, head)
rows instead of once per request. Its output and log-sum-exp per (entry, head) are merged
with each request's own keys by the decode merge kernel (`decode_attention`).

Grid: (groups, KV heads, row tiles). A program stacks the query heads of one KV head of up
to BLOCK_M / GROUP requests of its group as a (BLOCK_M, D) tile and runs the online softmax
over the whole run; every key of a run is visible to every query of its group. Math in
fp32; partial results in fp32.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixflow.kernels.shared_prefix import drop_leading, find_shared_prefixes
from radixflow.kernels.triton.online_softmax import interpreting, online_softmax_step


@dataclass(frozen=True)
class DecodeLayout:
    """A decode batch's KV split into shared runs and each request's own keys; int64 tensors
    on the metadata's device, derived once per forward and read by every layer.

    kv_indptr (B+1,), kv_indices: each request's keys after the runs that cover its start.
    An entry is one (run, request) pair; entries are numbered group after group:
    group_indptr (G+1,) into entry_rows (E,), the request (query row) of each entry;
    prefix_indptr (G+1,) into prefix_slots (sum P,), the run's slots;
    row_entry_indptr (B+1,) into row_entries (E,), the entries each request merges;
    max_group_size: the most requests in one group (sizes the grid without a device sync),
    or a bound on it (a fixed-size layout for a captured launch: see `pad_layout`).
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    group_indptr: torch.Tensor
    entry_rows: torch.Tensor
    prefix_indptr: torch.Tensor
    prefix_slots: torch.Tensor
    row_entry_indptr: torch.Tensor
    row_entries: torch.Tensor
    max_group_size: int

    @property
    def num_groups(self) -> int:
        return self.group_indptr.numel() - 1


def _indptr(lens: torch.Tensor) -> torch.Tensor:
    """(n,) lengths -> (n+1,) int64 prefix sum starting at 0."""
    return torch.nn.functional.pad(lens.to(torch.int64).cumsum(0), (1, 0))


def decode_layout(kv_indptr: torch.Tensor, kv_indices: torch.Tensor) -> DecodeLayout:
    """Find the shared runs of a decode batch (`find_shared_prefixes`) and pack them, once
    per forward rather than once per layer. The finder reads lengths and slots one by one,
    so it runs on a host copy of the metadata (one copy each way, not one sync per read);
    a caller holding the metadata on the host already calls `host_decode_layout` and
    uploads the result itself (the model runner: no device-to-host copy at all)."""
    device = kv_indptr.device
    packed = host_decode_layout(kv_indptr.cpu(), kv_indices.cpu())
    on_device = {
        name: getattr(packed, name).to(device, non_blocking=True) for name in LAYOUT_TENSORS
    }
    return dataclasses.replace(packed, **on_device)


LAYOUT_TENSORS = (
    "kv_indptr",
    "kv_indices",
    "group_indptr",
    "entry_rows",
    "prefix_indptr",
    "prefix_slots",
    "row_entry_indptr",
    "row_entries",
)


def host_decode_layout(kv_indptr: torch.Tensor, kv_indices: torch.Tensor) -> DecodeLayout:
    """`decode_layout` of host (CPU) metadata, on the host: int64 CPU tensors."""
    assert kv_indptr.device.type == "cpu", f"{kv_indptr.device=}"
    num_reqs = kv_indptr.numel() - 1
    kv_indptr, kv_indices = kv_indptr.to(torch.int64), kv_indices.to(torch.int64)
    batch = torch.arange(num_reqs + 1)  # decode: query row b is request b
    shared, skip = find_shared_prefixes(batch, kv_indptr, kv_indices)
    if shared:
        kv_indptr, kv_indices = drop_leading(kv_indptr, kv_indices, skip)
    empty = torch.zeros(0, dtype=torch.int64)
    entry_rows = torch.cat([g.q_rows for g in shared]) if shared else empty  # (E,)
    sizes = torch.tensor([len(g.q_rows) for g in shared], dtype=torch.int64)
    lens = torch.tensor([len(g.slots) for g in shared], dtype=torch.int64)
    per_row = torch.bincount(entry_rows, minlength=num_reqs)  # (B,) runs each request has
    return DecodeLayout(
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        group_indptr=_indptr(sizes),
        entry_rows=entry_rows.to(torch.int64),
        prefix_indptr=_indptr(lens),
        prefix_slots=torch.cat([g.slots for g in shared]) if shared else empty,
        row_entry_indptr=_indptr(per_row),
        row_entries=torch.argsort(entry_rows, stable=True),  # (E,) entries sorted by row
        max_group_size=max((len(g.q_rows) for g in shared), default=0),
    )


def pad_layout(
    layout: DecodeLayout, batch_size: int, max_groups: int, max_entries: int
) -> dict[str, torch.Tensor] | None:
    """The host `layout` of B requests as the fixed-size tensors a captured (CUDA graph)
    launch reads: `batch_size` requests and `max_groups` groups of `max_entries` entries in
    all, whatever this step holds, so the grids and buffer sizes never change. Padding the
    kernels skip by construction: groups past the real ones are empty (group_indptr and
    prefix_indptr repeat their last value: no rows, no keys), padded requests merge no
    entries and own one key, the dummy slot 0 (their rows are discarded). kv_indices and
    prefix_slots keep their real lengths (a launch reads only what the indptrs name).
    -> name -> tensor (int64, host), or None when the step does not fit."""
    num_reqs, num_groups = layout.kv_indptr.numel() - 1, layout.num_groups
    num_entries = layout.entry_rows.numel()
    if num_reqs > batch_size or num_groups > max_groups or num_entries > max_entries:
        return None
    pad_reqs, pad_groups = batch_size - num_reqs, max_groups - num_groups
    own_end = layout.kv_indptr[-1]

    def extend(t: torch.Tensor, n: int, value: torch.Tensor | int) -> torch.Tensor:
        return torch.cat([t, torch.full((n,), int(value), dtype=torch.int64)])

    def zeros_to(t: torch.Tensor, n: int) -> torch.Tensor:
        return extend(t, n - t.numel(), 0)

    return {
        "kv_indptr": torch.cat([layout.kv_indptr, own_end + torch.arange(1, pad_reqs + 1)]),
        "kv_indices": extend(layout.kv_indices, pad_reqs, 0),
        "group_indptr": extend(layout.group_indptr, pad_groups, num_entries),
        "entry_rows": zeros_to(layout.entry_rows, max_entries),
        "prefix_indptr": extend(layout.prefix_indptr, pad_groups, layout.prefix_indptr[-1]),
        "prefix_slots": layout.prefix_slots,
        "row_entry_indptr": extend(layout.row_entry_indptr, pad_reqs, num_entries),
        "row_entries": zeros_to(layout.row_entries, max_entries),
    }


@triton.jit
def _shared_prefix_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    group_indptr_ptr,
    entry_rows_ptr,
    prefix_indptr_ptr,
    prefix_slots_ptr,
    out_ptr,
    lse_ptr,
    sm_scale,
    head_dim,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_oe,
    stride_oh,
    stride_le,
    stride_lh,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """out[e, h] = softmax(q Kᵀ·scale) V over run g, lse[e, h] its log-sum-exp, for the
    (entry e, head h) rows m = (e - first entry) * GROUP + (h % GROUP) of this tile."""
    group = tl.program_id(0)
    kv_head = tl.program_id(1)
    entry_start = tl.load(group_indptr_ptr + group).to(tl.int64)
    num_rows = (tl.load(group_indptr_ptr + group + 1).to(tl.int64) - entry_start) * GROUP
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    if tl.program_id(2) * BLOCK_M >= num_rows:
        return

    mask_m = offs_m < num_rows
    entries = entry_start + offs_m // GROUP  # (BLOCK_M,)
    heads = kv_head * GROUP + offs_m % GROUP  # (BLOCK_M,)
    rows = tl.load(entry_rows_ptr + entries, mask=mask_m, other=0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    mask_md = mask_m[:, None] & mask_d[None, :]
    q_ptrs = q_ptr + rows[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_md, other=0.0)  # (BLOCK_M, BLOCK_D)
    if UPCAST:
        q = q.to(tl.float32)

    prefix_start = tl.load(prefix_indptr_ptr + group).to(tl.int64)
    prefix_len = (tl.load(prefix_indptr_ptr + group + 1).to(tl.int64) - prefix_start).to(tl.int32)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, prefix_len, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < prefix_len
        slots = tl.load(prefix_slots_ptr + prefix_start + offs_n, mask=mask_n, other=0)
        slots = slots.to(tl.int64)  # (BLOCK_N,)
        mask_kv = mask_n[:, None] & mask_d[None, :]
        k_ptrs = k_ptr + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
        v_ptrs = v_ptr + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :]
        k = tl.load(k_ptrs, mask=mask_kv, other=0.0)  # (BLOCK_N, BLOCK_D)
        v = tl.load(v_ptrs, mask=mask_kv, other=0.0)  # (BLOCK_N, BLOCK_D)
        # Every step holds >= 1 valid key, so row_max is finite from the first step on.
        row_max, row_sum, acc = online_softmax_step(
            q, k, v, mask_n[None, :], row_max, row_sum, acc, sm_scale, UPCAST
        )

    out_ptrs = out_ptr + entries[:, None] * stride_oe + heads[:, None] * stride_oh
    tl.store(out_ptrs + offs_d[None, :], acc / row_sum[:, None], mask=mask_md)
    lse_ptrs = lse_ptr + entries * stride_le + heads * stride_lh
    tl.store(lse_ptrs, row_max + tl.log(row_sum), mask=mask_m)


def _block_sizes(head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): small in the interpreter (several tiles in the tests); on a GPU
    a 64x64 tile for 16-bit dots, smaller for IEEE fp32 dots and wide heads."""
    if interpreting(device):
        return 16, 32
    if dtype == torch.float32 or head_dim > 128:
        return 32, 32
    return 64, 64


def shared_prefix_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    layout: DecodeLayout,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each entry's query row over its run: q (B, H, D), pools (num_slots, Hkv,
    D) -> fp32 output (E, H, D) and log-sum-exp (E, H). The caller checked the inputs."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buffer.shape[1]
    num_entries = layout.entry_rows.numel()
    out = torch.empty((num_entries, num_heads, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((num_entries, num_heads), dtype=torch.float32, device=q.device)
    if num_entries == 0:
        return out, lse
    group = num_heads // num_kv_heads
    block_m, block_n = _block_sizes(head_dim, q.dtype, q.device)
    grid = (layout.num_groups, num_kv_heads, triton.cdiv(layout.max_group_size * group, block_m))
    _shared_prefix_kernel[grid](
        q, k_buffer, v_buffer, layout.group_indptr, layout.entry_rows, layout.prefix_indptr,
        layout.prefix_slots, out, lse, float(sm_scale), head_dim,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), out.stride(0), out.stride(1),
        lse.stride(0), lse.stride(1),
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), UPCAST=interpreting(q.device),
        num_warps=4, num_stages=2,
    )  # fmt: skip
    return out, lse
