"""Triton attention kernels vs the plain torch reference (`radixflow.kernels.reference`, which
runs on any device) on CUDA, at realistic shapes, fp16/bf16, with and without shared-prefix
groups.

`pytest -m gpu tests/` runs these compiled: the interpreter modules (tests/kernels/test_kernels.py,
tests/runtime/model_executor/test_cuda_graph.py) set TRITON_INTERPRET=1 only without CUDA
(conftest.use_the_triton_interpreter). Set by hand, it would make these interpreted: they skip.
On the GPU the kernels feed fp16/bf16 operands to tl.dot (probabilities rounded to the
activation dtype before P·V), so tolerances are those of the activation dtype.
"""

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1",
        reason="TRITON_INTERPRET=1 is set: these test the compiled kernels",
    ),
]

TOLERANCE = {torch.float16: (5e-3, 5e-3), torch.bfloat16: (2e-2, 2e-2)}  # (atol, rtol)
SHAPES = [(9, 3, 64), (32, 8, 128), (16, 16, 64), (32, 1, 128)]  # (heads, kv_heads, head_dim)


def indptr(lens: torch.Tensor) -> torch.Tensor:
    """Prefix sum (B+1,) int64 of per-request lengths (B,)."""
    return torch.nn.functional.pad(lens.cumsum(0), (1, 0))


def make_pools(
    num_used: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pools with `num_used` random rows at shuffled slots (slot 0 unused); int64 slots."""
    num_slots = num_used + 1 + 1000
    slots = (1 + torch.randperm(num_slots - 1, generator=gen)[:num_used]).cuda()
    shape = (num_slots, num_kv_heads, head_dim)
    k_buffer = torch.randn(shape, generator=gen).to(device="cuda", dtype=dtype)
    v_buffer = torch.randn(shape, generator=gen).to(device="cuda", dtype=dtype)
    return k_buffer, v_buffer, slots


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOLERANCE[expected.dtype]
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("num_kv_splits", [1, 8, 16])
def test_decode_matches_reference_on_cuda(
    dtype: torch.dtype, shape: tuple[int, int, int], num_kv_splits: int
) -> None:
    from radixflow.kernels import reference
    from radixflow.kernels.triton.decode_attention import decode_attention

    num_heads, num_kv_heads, head_dim = shape
    gen = torch.Generator().manual_seed(0)
    lens = torch.cat([torch.tensor([1, 31, 32, 33]), torch.randint(1, 4097, (28,), generator=gen)])
    k_buffer, v_buffer, slots = make_pools(int(lens.sum()), num_kv_heads, head_dim, dtype, gen)
    q = torch.randn((lens.numel(), num_heads, head_dim), generator=gen).to("cuda", dtype)
    args = (q, k_buffer, v_buffer, indptr(lens).cuda(), slots, head_dim**-0.5)
    out = decode_attention(*args, num_kv_splits=num_kv_splits)  # (B, H, D)
    assert_close(out, reference.decode_attention(*args))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_extend_matches_reference_on_cuda(dtype: torch.dtype, shape: tuple[int, int, int]) -> None:
    from radixflow.kernels import reference
    from radixflow.kernels.triton.extend_attention import extend_attention

    num_heads, num_kv_heads, head_dim = shape
    gen = torch.Generator().manual_seed(1)
    prefix_lens = torch.tensor([0, 0, 17, 1000, 2048, 300, 129, 4000])
    extend_lens = torch.tensor([1, 700, 33, 128, 1, 513, 64, 256])
    k_buffer, v_buffer, slots = make_pools(
        int(prefix_lens.sum()), num_kv_heads, head_dim, dtype, gen
    )
    num_tokens = int(extend_lens.sum())
    fused = torch.randn((num_tokens, num_heads + 2 * num_kv_heads, head_dim), generator=gen)
    q, k, v = fused.to("cuda", dtype).split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    args = (q, k, v, k_buffer, v_buffer, indptr(extend_lens).cuda(), indptr(prefix_lens).cuda())
    args = (*args, slots, head_dim**-0.5)
    out = extend_attention(*args)  # (T, H, D)
    assert_close(out, reference.extend_attention(*args))


def test_fp32_is_exact_on_cuda() -> None:
    """fp32 inputs use IEEE dots (no TF32): the kernels match the reference to 1e-5."""
    from radixflow.kernels import reference
    from radixflow.kernels.triton.decode_attention import decode_attention

    gen = torch.Generator().manual_seed(2)
    lens = torch.randint(1, 3000, (16,), generator=gen)
    k_buffer, v_buffer, slots = make_pools(int(lens.sum()), 3, 64, torch.float32, gen)
    q = torch.randn((16, 9, 64), generator=gen).cuda()
    args = (q, k_buffer, v_buffer, indptr(lens).cuda(), slots, 0.125)
    expected = reference.decode_attention(*args)
    torch.testing.assert_close(decode_attention(*args), expected, atol=1e-5, rtol=0)


def tree_batch(num_kv_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator):
    """A tree-of-thought decode batch as the radix tree lays it out: 2 problems (800-slot
    runs) x 4 branches (200-slot runs) x 4 leaves (1..300 own keys), plus 8 unrelated
    requests. -> (k_buffer, v_buffer, kv_indptr, kv_indices) on CUDA."""
    leaves = torch.randint(1, 301, (32,), generator=gen)
    own = torch.randint(1, 3000, (8,), generator=gen)
    k_buffer, v_buffer, pool = make_pools(
        2 * 800 + 8 * 200 + int(leaves.sum()) + int(own.sum()), num_kv_heads, head_dim, dtype, gen
    )
    take = iter(pool.split([800] * 2 + [200] * 8 + leaves.tolist() + own.tolist()))
    problems, branches = [next(take) for _ in range(2)], [next(take) for _ in range(8)]
    requests = [torch.cat([problems[i // 16], branches[i // 4], next(take)]) for i in range(32)] + [
        next(take) for _ in range(8)
    ]
    lens = torch.tensor([len(r) for r in requests])
    return k_buffer, v_buffer, indptr(lens).cuda(), torch.cat(requests)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_shared_prefix_decode_matches_reference_on_cuda(
    dtype: torch.dtype, shape: tuple[int, int, int]
) -> None:
    """Nested shared runs read once per group, merged with each request's own keys."""
    from radixflow.kernels import reference
    from radixflow.kernels.triton.decode_attention import decode_attention, decode_layout

    num_heads, num_kv_heads, head_dim = shape
    gen = torch.Generator().manual_seed(3)
    k_buffer, v_buffer, kv_indptr, kv_indices = tree_batch(num_kv_heads, head_dim, dtype, gen)
    q = torch.randn((40, num_heads, head_dim), generator=gen).to("cuda", dtype)
    layout = decode_layout(kv_indptr, kv_indices)
    assert layout.num_groups == 2 + 8 and layout.max_group_size == 16
    args = (q, k_buffer, v_buffer, kv_indptr, kv_indices, head_dim**-0.5)
    out = decode_attention(*args, layout=layout)  # (B, H, D)
    expected = reference.decode_attention(*args)
    if dtype == torch.float32:  # IEEE dots: as exact as without groups
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    else:
        assert_close(out, expected)


def test_get_ops_on_cuda_is_triton_with_shared_prefix_layouts() -> None:
    from radixflow.kernels import get_ops

    ops = get_ops("auto", torch.device("cuda"))
    assert ops.name == "triton" and ops.prepare_decode is not None
