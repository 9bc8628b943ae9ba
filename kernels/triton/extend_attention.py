"""Triton kernel for extend (prefill) attention over a cached prefix plus new tokens.

Same signature and semantics as `radixflow.kernels.reference.extend_attention`.
Grid (batch, heads, cdiv(max_extend_len, BLOCK_M)): a program owns BLOCK_M new tokens of
one request and one query head. Loop 1 reads the request's cached prefix from the pools
through kv_indices (every prefix key is visible); loop 2 reads the new tokens' own K/V
with the bottom-right causal mask and stops at the end of the program's query block, so
blocks above the diagonal are never loaded. Online softmax in fp32; the output comes back
in q's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixflow.kernels.triton.online_softmax import (
    FLOAT_DTYPES,
    check_index_tensor,
    interpreting,
    online_softmax_step,
)


@triton.jit
def _extend_kernel(
    q_ptr,
    k_extend_ptr,
    v_extend_ptr,
    k_buffer_ptr,
    v_buffer_ptr,
    out_ptr,
    qo_indptr_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    sm_scale,
    head_dim,
    stride_qt,
    stride_qh,
    stride_ket,
    stride_keh,
    stride_vet,
    stride_veh,
    stride_kbt,
    stride_kbh,
    stride_vbt,
    stride_vbh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """out[i] = softmax(q_i Kᵀ·scale) V over the prefix and new tokens 0..i of one request.

    Rows past the request's extend length are computed on zeros and never stored.
    """
    batch = tl.program_id(0)
    head = tl.program_id(1)
    block_m = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(qo_indptr_ptr + batch).to(tl.int64)
    extend_len = (tl.load(qo_indptr_ptr + batch + 1).to(tl.int64) - q_start).to(tl.int32)
    kv_start = tl.load(kv_indptr_ptr + batch).to(tl.int64)
    prefix_len = (tl.load(kv_indptr_ptr + batch + 1).to(tl.int64) - kv_start).to(tl.int32)
    if block_m * BLOCK_M >= extend_len:
        return

    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)  # new-token index within the request
    mask_m = offs_m < extend_len
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    rows_m = (q_start + offs_m)[:, None]  # (BLOCK_M, 1)
    q_ptrs = q_ptr + rows_m * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)
    if UPCAST:
        q = q.to(tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Loop 1: the cached prefix, gathered from the pools; no causal mask.
    for start in range(0, prefix_len, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < prefix_len
        slots = tl.load(kv_indices_ptr + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
        mask_kv = mask_n[:, None] & mask_d[None, :]
        k_ptrs = k_buffer_ptr + slots[:, None] * stride_kbt + kv_head * stride_kbh + offs_d[None, :]
        v_ptrs = v_buffer_ptr + slots[:, None] * stride_vbt + kv_head * stride_vbh + offs_d[None, :]
        k = tl.load(k_ptrs, mask=mask_kv, other=0.0)  # (BLOCK_N, BLOCK_D)
        v = tl.load(v_ptrs, mask=mask_kv, other=0.0)  # (BLOCK_N, BLOCK_D)
        row_max, row_sum, acc = online_softmax_step(
            q, k, v, mask_n[None, :], row_max, row_sum, acc, sm_scale, UPCAST
        )

    # Loop 2: the new tokens, causal. Key 0 is visible to every row, so after the first
    # step every row has a finite max and fully masked rows of later steps are no-ops.
    end = tl.minimum(extend_len, (block_m + 1) * BLOCK_M)
    for start in range(0, end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < extend_len
        rows_n = (q_start + offs_n)[:, None]  # (BLOCK_N, 1)
        mask_kv = mask_n[:, None] & mask_d[None, :]
        k_ptrs = k_extend_ptr + rows_n * stride_ket + kv_head * stride_keh + offs_d[None, :]
        v_ptrs = v_extend_ptr + rows_n * stride_vet + kv_head * stride_veh + offs_d[None, :]
        k = tl.load(k_ptrs, mask=mask_kv, other=0.0)  # (BLOCK_N, BLOCK_D)
        v = tl.load(v_ptrs, mask=mask_kv, other=0.0)  # (BLOCK_N, BLOCK_D)
        visible = mask_n[None, :] & (offs_n[None, :] <= offs_m[:, None])  # (BLOCK_M, BLOCK_N)
        row_max, row_sum, acc = online_softmax_step(
            q, k, v, visible, row_max, row_sum, acc, sm_scale, UPCAST
        )

    out_ptrs = out_ptr + rows_m * stride_ot + head * stride_oh + offs_d[None, :]
    out = (acc / row_sum[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptrs, out, mask=mask_m[:, None] & mask_d[None, :])


def _block_sizes(head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): SGLang's choices by GPU generation; small in tests."""
    if interpreting(device):
        return 16, 16, 4  # keeps several query blocks and partial tiles in the tests
    num_warps = 4 if head_dim <= 64 else 8
    if dtype == torch.float32:
        return 64, 32, num_warps  # IEEE fp32 dots run without tensor cores: smaller tiles
    major, _ = torch.cuda.get_device_capability(device)
    if head_dim <= 128 and major >= 8:
        return 128, 64, num_warps
    if head_dim <= 256:
        return 64, 64, num_warps
    return 32, 32, num_warps


def _check_inputs(
    activations: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    pools: tuple[torch.Tensor, torch.Tensor],
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
) -> None:
    """The launch contract: shapes, last-dim-contiguous strides, dtypes, one device."""
    q, k_extend, v_extend = activations
    k_buffer, v_buffer = pools
    assert q.dim() == 3 and k_buffer.dim() == 3, f"{q.shape=} {k_buffer.shape=}"
    assert k_extend.shape == v_extend.shape, f"{k_extend.shape=} {v_extend.shape=}"
    assert k_extend.shape[0] == q.shape[0], f"num_tokens: {q.shape=} {k_extend.shape=}"
    assert k_buffer.shape == v_buffer.shape, f"{k_buffer.shape=} {v_buffer.shape=}"
    assert k_buffer.shape[1:] == k_extend.shape[1:], f"{k_buffer.shape=} {k_extend.shape=}"
    assert q.shape[2] == k_extend.shape[2], f"head_dim: {q.shape=} {k_extend.shape=}"
    assert q.shape[1] % k_extend.shape[1] == 0, f"GQA: {q.shape=} {k_extend.shape=}"
    for t in (*activations, *pools):
        assert t.stride(-1) == 1, f"last dim must be contiguous: {t.shape} {t.stride()}"
        assert t.dtype == q.dtype and t.dtype in FLOAT_DTYPES, f"{t.dtype} vs {q.dtype}"
    for t in (*activations, *pools, qo_indptr, kv_indptr, kv_indices):
        assert t.device == q.device, f"{t.device=} {q.device=}"
    for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices)):
        check_index_tensor(name, t)
    assert qo_indptr.numel() == kv_indptr.numel() >= 1, f"{qo_indptr.shape=} {kv_indptr.shape=}"


@dataclass(frozen=True)
class ExtendLayout:
    """What the launch needs from the metadata on the host: the most new tokens of one
    request (it sizes the grid)."""

    max_extend_len: int


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
    layout: ExtendLayout | None = None,
) -> torch.Tensor:
    """Attention of new tokens over their request's cached prefix and (causally) each other.

    q (T, H, D); k_extend/v_extend (T, Hkv, D); pools (num_slots, Hkv, D); the prefix of
    request b is `kv_indices[kv_indptr[b]:kv_indptr[b+1]]`. New token i of a request with
    prefix P sees keys 0 .. P + i. Returns a new contiguous (T, H, D) tensor. Without a
    `layout` (the longest extend, known to a caller holding the metadata on the host) it
    reads max_extend_len from qo_indptr (one device sync).
    """
    _check_inputs((q, k_extend, v_extend), (k_buffer, v_buffer), qo_indptr, kv_indptr, kv_indices)
    num_tokens, num_heads, head_dim = q.shape
    batch_size = qo_indptr.numel() - 1
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or batch_size == 0:
        return out.zero_()
    if layout is None:
        max_extend_len = int((qo_indptr[1:] - qo_indptr[:-1]).max())
    else:
        max_extend_len = layout.max_extend_len
    block_m, block_n, num_warps = _block_sizes(head_dim, q.dtype, q.device)
    grid = (batch_size, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q, k_extend, v_extend, k_buffer, v_buffer, out, qo_indptr, kv_indptr, kv_indices,
        float(sm_scale), head_dim,
        q.stride(0), q.stride(1), k_extend.stride(0), k_extend.stride(1),
        v_extend.stride(0), v_extend.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), out.stride(0), out.stride(1),
        GROUP=num_heads // k_extend.shape[1], BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), UPCAST=interpreting(q.device),
        num_warps=num_warps, num_stages=1,
    )  # fmt: skip
    return out
