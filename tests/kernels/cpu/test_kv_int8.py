"""The int8 KV pool (kernels/kv_int8.py): its quantization spec, the native kernels' stores
(bit for bit the spec's) and their attention reading int8 keys and values with their scales
(against the reference attention over the same pool), decode and extend, at tiny shapes."""

from __future__ import annotations

import pytest
import torch
from test_fused_ops import rope_tables
from test_kernels_cpu import assert_close, indptr
from test_native import needs_lib, pooled_batch

from radixflow.kernels import reference
from radixflow.kernels.cpu import attention as cpu_attention
from radixflow.kernels.cpu import native
from radixflow.kernels.kv_int8 import Int8KV, copy_slots, dequantize, pool_tensors, quantize
from radixflow.runtime.models.rope import rope_qk


def int8_pools(k: torch.Tensor, v: torch.Tensor) -> tuple[Int8KV, Int8KV]:
    return Int8KV(*quantize(k)), Int8KV(*quantize(v))


def test_quantize_rounds_each_head_to_127_steps_of_its_own_scale() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((50, 3, 64), generator=gen) * torch.tensor([0.01, 1.0, 300.0])[:, None]
    x[7, 1] = 0.0  # an all-zero head: scale 0, reads back as zeros
    q, scale = quantize(x)
    assert q.dtype == torch.int8 and scale.shape == (50, 3) and scale[7, 1] == 0
    assert q.abs().amax(-1)[scale > 0].eq(127).all()  # each head's largest value is +-127
    back = dequantize(q, scale)
    assert ((back - x).abs() <= scale[..., None] / 2 * (1 + 1e-6)).all()
    assert torch.equal(back[7, 1], torch.zeros(64))
    # the error of a plain per-tensor scale would be 300x larger on the smallest heads
    assert (back - x).abs()[:, 0].max() < 5e-4


@needs_lib
def test_native_stores_quantize_as_the_spec_does_bit_for_bit() -> None:
    """fp32 rows stored into int8 pools by the plain store and by rope's fused store give the
    spec's int8 values and scales exactly (ties to even, heads of different magnitudes)."""
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn((9, 2 * 2 * 16), generator=gen) * 10
    rows[0, :16] = torch.tensor([127, 2.5, 3.5, -2.5, 0.5, -126.5] + [1.0] * 10)  # scale 1
    rows[1, 16:32] = 0.0  # an all-zero head
    k, v = rows[:, :32].view(9, 2, 16), rows[:, 32:].view(9, 2, 16)
    slots = torch.tensor([4, 49, 1, 17, 18, 30, 2, 40, 41])
    pools = [Int8KV.zeros((50, 2, 16), torch.device("cpu")) for _ in range(4)]
    assert native.store_kv(pools[0], pools[1], slots, k, v)
    reference.store_kv(pools[2], pools[3], slots, k, v)
    for got, want in ((pools[0], pools[2]), (pools[1], pools[3])):
        assert torch.equal(got.data, want.data) and torch.equal(got.scale, want.scale)
    assert pools[0].scale[4, 0] == 1 and pools[0].data[4, 0, :6].tolist() == [
        127,
        2,
        4,
        -2,
        0,
        -126,
    ]
    assert pools[0].scale[49, 1] == 0  # the all-zero head
    assert torch.equal(pools[0].data[49, 1], torch.zeros(16, dtype=torch.int8))
    qk = torch.cat([k, k], 1)  # 2 query heads, then the 2 key heads
    cos, sin = rope_tables(16, 1.0, torch.arange(9), qk.dtype)
    stored = [Int8KV.zeros((50, 2, 16), torch.device("cpu")) for _ in range(2)]
    rotated = native.rope(qk, cos, sin, store=(stored[0], stored[1], slots, v))
    reference.store_kv(pools[2], pools[3], slots, rotated[:, 2:], v)
    assert torch.equal(stored[0].data, pools[2].data)
    assert torch.equal(stored[0].scale, pools[2].scale)
    with pytest.raises(IndexError):
        native.store_kv(pools[0], pools[1], torch.tensor([3, 50]), k[:2], v[:2])


@needs_lib
@pytest.mark.parametrize("layout", ["runs", "scattered", "shared"])
@pytest.mark.parametrize("shape", [(3, 3, 64), (1, 7, 128), (4, 1, 32), (2, 8, 16)])
@pytest.mark.parametrize("logit_cap", [0.0, 5.0])
def test_native_decode_attention_reads_int8_pools_with_their_scales(
    layout: str, shape: tuple, logit_cap: float
) -> None:
    """The kernel takes the int8 pools themselves (no fallback, no dequantized copy) and
    matches the spec over the same pools (which dequantizes the rows it reads) to fp32
    rounding; it differs from attention over the unscaled int8 values (a kernel that
    dropped the scales fails here) and is near attention over the fp32 keys."""
    hkv, group, dim = shape
    q, k, v, kv_indptr, kv_indices = pooled_batch(layout, hkv, group, dim)
    k8, v8 = int8_pools(k, v)
    decode_layout = cpu_attention.decode_layout(kv_indptr, kv_indices)
    args = (q, k8, v8, kv_indptr, kv_indices, dim**-0.5)
    out = cpu_attention.decode_attention(*args, layout=decode_layout, logit_cap=logit_cap)
    assert not decode_layout.fallback  # the native kernel read the int8 pools
    want = reference.decode_attention(*args, logit_cap=logit_cap)
    assert_close(out, want)
    unscaled = reference.decode_attention(
        q, k8.data.float(), v8.data.float(), kv_indptr, kv_indices, dim**-0.5, logit_cap=logit_cap
    )
    assert (out - unscaled).abs().max() > 1.0
    exact = reference.decode_attention(q, k, v, kv_indptr, kv_indices, dim**-0.5)
    if not logit_cap:
        assert (out - exact).abs().max() < 0.1  # int8 rounding only (values ~N(0, 1))


@needs_lib
@pytest.mark.parametrize("layout", ["runs", "shared"])
def test_torch_decode_path_reads_int8_pools_as_the_spec(layout: str) -> None:
    """Without native runs (the torch path: views, grid, gathered groups, shared runs) the
    int8 pools read as their dequantized rows, as the spec does."""
    q, k, v, kv_indptr, kv_indices = pooled_batch(layout, 3, 3, 64, fill=0.0)
    k8, v8 = int8_pools(k, v)
    args = (q, k8, v8, kv_indptr, kv_indices, 64**-0.5)
    torch_layout = cpu_attention.decode_layout(kv_indptr, kv_indices, native_runs=False)
    out = cpu_attention.decode_attention(*args, layout=torch_layout)
    assert_close(out, reference.decode_attention(*args))


@needs_lib
@pytest.mark.parametrize("layout", ["runs", "scattered", "shared"])
@pytest.mark.parametrize("shape", [(3, 3, 64, 64), (1, 7, 128, 64), (3, 1, 32, 16)])
def test_rope_decode_attention_on_int8_pools_equals_the_separate_calls(
    layout: str, shape: tuple
) -> None:
    """A decode step's rope, quantized store and attention in one call: the same output,
    the same int8 values and scales as `rope_qk`, the spec's store and `decode_attention`."""
    hkv, group, dim, rotary = shape
    _, k, v, kv_indptr, kv_indices = pooled_batch(layout, hkv, group, dim, fill=0.0)
    k8, v8 = int8_pools(k, v)
    b, heads = len(kv_indptr) - 1, hkv * group
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn((b, (heads + 2 * hkv) * dim + 5), generator=gen)[:, :-5]  # rows strided
    slots = kv_indices[kv_indptr[1:] - 1].clone()  # each request's last key is this step's
    cos, sin = rope_tables(
        dim, rotary / dim, torch.randint(0, 4000, (b,), generator=gen), qkv.dtype
    )
    decode_layout = cpu_attention.decode_layout(kv_indptr, kv_indices)
    k_want, v_want = (Int8KV(p.data.clone(), p.scale.clone()) for p in (k8, v8))
    qk = rope_qk(qkv[:, : (heads + hkv) * dim].view(b, heads + hkv, dim), cos, sin)
    new_v = qkv[:, (heads + hkv) * dim :].view(b, hkv, dim)
    reference.store_kv(k_want, v_want, slots, qk[:, heads:], new_v)
    want = cpu_attention.decode_attention(
        qk[:, :heads], k_want, v_want, kv_indptr, kv_indices, dim**-0.5, layout=decode_layout
    )
    got = cpu_attention.rope_decode_attention(
        qkv, heads, cos, sin, k8, v8, slots, dim**-0.5, decode_layout
    )
    assert got is not None and torch.equal(got, want)
    for pool, expected in ((k8, k_want), (v8, v_want)):
        assert torch.equal(pool.data, expected.data) and torch.equal(pool.scale, expected.scale)


@needs_lib
@pytest.mark.parametrize(
    ("path", "prefix_lens", "new_lens"),
    [
        ("short", (0, 5, 200), (4, 9, 2)),  # pool views, plain matmuls
        ("rows", (0, 5, 40, 7, 60), (4, 9, 2, 30, 3)),  # decode rows on the native kernel
        ("gathered", (300, 0), (20, 35)),  # the fused kernel over gathered, dequantized rows
    ],
)
def test_extend_attention_over_int8_pools_matches_the_spec(
    path: str, prefix_lens: tuple, new_lens: tuple
) -> None:
    """Prefill over cached int8 keys, on each CPU path (short extends' pool views, decode
    rows on the native kernel reading int8, the gathering fused path), with the new tokens
    stored first as the model does, equals the spec over the same pools."""
    gen = torch.Generator().manual_seed(11)
    hkv, group, dim, num_slots = 2, 3, 32, 1200
    k8, v8 = (Int8KV.zeros((num_slots, hkv, dim), torch.device("cpu")) for _ in "kv")
    free, prefixes, news = torch.arange(1, num_slots), [], []  # runs, as the pool gives
    at = 0
    for p, n in zip(prefix_lens, new_lens):
        run = free[at : at + p].sort().values
        prefixes.append(run)
        news.append(free[at + p : at + p + n])
        at += p + n
        rows = torch.randn((p, hkv, dim), generator=gen)
        reference.store_kv(k8, v8, run, rows, rows.flip(0))
    t = sum(new_lens)
    q = torch.randn((t, hkv * group, dim), generator=gen)
    k_new, v_new = (torch.randn((t, hkv, dim), generator=gen) for _ in "kv")
    new_slots = torch.cat(news)
    cpu_attention.store_kv(k8, v8, new_slots, k_new, v_new)
    qo_indptr, kv_indptr = indptr(new_lens), indptr(list(prefix_lens))
    kv_indices = torch.cat(prefixes)
    # the spec sees the new tokens' K/V as stored (quantized), as the pool paths read them
    k_seen, v_seen = k8[new_slots], v8[new_slots]
    args = (q, k_seen, v_seen, k8, v8, qo_indptr, kv_indptr, kv_indices, dim**-0.5)
    layout = cpu_attention.make_layout(qo_indptr, kv_indptr, kv_indices, new_slots=new_slots)
    taken = "short" if layout.short else "rows" if layout.row_runs is not None else "gathered"
    assert taken == path
    out = cpu_attention.extend_attention(*args, layout=layout)
    assert_close(out, reference.extend_attention(*args))


def test_copy_slots_carries_the_scales() -> None:
    """A copy-on-write page copy of a stacked int8 pool moves the scales with the data."""
    pool = Int8KV(*quantize(torch.randn((2, 10, 3, 16))))
    src, dst = torch.tensor([1, 2]), torch.tensor([7, 8])
    before = pool[:, src]
    copy_slots(pool, src, dst)
    assert torch.equal(pool[:, dst], before)
    assert torch.equal(pool.scale[:, dst], pool.scale[:, src])
    assert pool_tensors(pool) == (pool.data, pool.scale)
