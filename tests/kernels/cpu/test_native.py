"""The native CPU kernels (kernels/cpu/native.c through kernels/cpu/native.py) against their torch
twins and the attention spec, then the model and engine with them on and off.

Where the machine has a C compiler (CI's does) the kernels must build: a build that silently
failed would leave every test here comparing torch with itself."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_fused_ops import rope_tables
from test_kernels_cpu import HEAD_DIM, PagedPool, assert_close, indptr

from radixflow.kernels import reference
from radixflow.kernels.cpu import attention as cpu_attention
from radixflow.kernels.cpu import decode_layout as cpu_decode_layout
from radixflow.kernels.cpu import native
from radixflow.runtime.models.layers import rms_norm
from radixflow.runtime.models.rope import rope_qk

LIB = native.library()
needs_lib = pytest.mark.skipif(
    LIB is None and shutil.which("cc") is None, reason="no C compiler on this machine"
)


def test_kernels_build_where_a_compiler_exists() -> None:
    if shutil.which("cc") is not None:
        assert LIB is not None, "kernels/cpu/native.c failed to build: see the log warning"


@needs_lib
def test_an_edit_to_a_nested_include_builds_anew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The build is keyed by every file the source includes, to any depth (quant.c includes
    quant_body.c, which includes the format families): keyed by the source and its direct
    includes only, an edit two levels down would load the stale library."""
    monkeypatch.setenv("RADIXFLOW_CACHE", str(tmp_path / "cache"))
    (tmp_path / "top.c").write_text('#include "mid.h"\nint rf_value(void) { return VALUE; }\n')
    (tmp_path / "mid.h").write_text('#include "leaf.h"\n')
    signatures = {"rf_value": (ctypes.c_int, [])}
    values = []
    for value in (1, 2):
        (tmp_path / "leaf.h").write_text(f"#define VALUE {value}\n")
        lib = native.build(tmp_path / "top.c", "nested", ["-O1", "-shared", "-fPIC"], signatures)
        assert lib is not None, "the test library failed to build: see the log warning"
        values.append(lib.rf_value())
    assert values == [1, 2]
    assert len(list((tmp_path / "cache" / "native").glob("nested-*.so"))) == 2


def pooled_batch(
    layout: str, hkv: int, group: int, dim: int, dtype=torch.float32, fill=float("nan")
):
    """(q, k_pool, v_pool, kv_indptr, kv_indices) of decodes whose keys are laid out as
    `layout` says: one run each ("runs"), scattered slots ("scattered"), or several runs
    behind a shared prefix and a request with no keys of its own ("shared"). Slots nobody
    wrote hold `fill`, NaN by default: a kernel reading outside a request's runs poisons
    its output (the torch path's grid needs them finite, as the runner's zeroed pool is)."""
    gen = torch.Generator().manual_seed(100 * hkv + dim)
    num_slots = 4000
    k, v = (torch.full((num_slots, hkv, dim), fill, dtype=dtype) for _ in "kv")
    order = torch.randperm(num_slots - 1, generator=gen) + 1
    if layout != "scattered":
        order = order.sort().values
    cursor = 0

    def alloc(n: int) -> torch.Tensor:  # then a gap: the next run does not continue this one
        nonlocal cursor
        slots, cursor = order[cursor : cursor + n], cursor + n + 3
        k[slots] = torch.randn((n, hkv, dim), generator=gen).to(dtype)
        v[slots] = torch.randn((n, hkv, dim), generator=gen).to(dtype)
        return slots

    if layout == "shared":
        prefix = alloc(128)
        own = [alloc(n) for n in (40, 7, 33)]
        requests = [
            torch.cat([prefix, alloc(20)]),
            torch.cat([prefix, alloc(90)]),
            torch.cat([prefix, *own]),  # three runs of its own behind the prefix
            alloc(50),
            prefix,  # ends where the prefix does: no keys of its own
        ]
    else:
        requests = [alloc(n) for n in (1, 15, 16, 17, 64, 65, 200, 130)]
    fused = torch.randn((len(requests), hkv * (group + 2), dim), generator=gen).to(dtype)
    q = fused[:, : hkv * group]  # a strided view of a fused qkv output, as in the model
    return q, k, v, indptr([len(r) for r in requests]), torch.cat(requests)


# (3, 3, 64) is SmolLM2-135M's: tasks of its 3 heads take attend() with the head count fixed
SHAPES = [(3, 3, 64), (2, 3, 64), (1, 7, 128), (4, 1, 32), (2, 8, 256), (3, 5, 16)]


@needs_lib
@pytest.mark.parametrize("layout", ["runs", "scattered", "shared"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("extra", [{}, {"logit_cap": 5.0}, {"sliding_window": 40}])
def test_native_decode_attention_matches_reference(layout: str, shape: tuple, extra: dict) -> None:
    """Every request's keys read where they lie (runs of consecutive slots) by the native
    kernel, merged with the shared runs, equal the spec for GQA groups 1-8, head dims
    16-256, soft-capped scores and sliding windows."""
    hkv, group, dim = shape
    q, k, v, kv_indptr, kv_indices = pooled_batch(layout, hkv, group, dim)
    window = {key: val for key, val in extra.items() if key == "sliding_window"}
    decode_layout = cpu_attention.decode_layout(kv_indptr, kv_indices, **window)
    assert decode_layout.runs is not None  # the native path, not the torch one
    if layout == "shared" and not window:
        assert decode_layout.shared  # the prefix is read once, then merged
    args = (q, k, v, kv_indptr, kv_indices, dim**-0.5)
    out = cpu_attention.decode_attention(*args, layout=decode_layout, **extra)
    assert not decode_layout.fallback  # the kernel took it
    assert_close(out, reference.decode_attention(*args, **extra))


@needs_lib
@pytest.mark.parametrize("shape", [(3, 3, 64), (2, 3, 64)])
def test_native_decode_attention_is_the_same_on_any_thread_count(shape: tuple) -> None:
    q, k, v, kv_indptr, kv_indices = pooled_batch("runs", *shape)
    runs = cpu_decode_layout.run_table(kv_indptr, kv_indices)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(native.decode_attention(q, k, v, runs, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@needs_lib
@pytest.mark.parametrize("layout", ["runs", "scattered", "shared"])
@pytest.mark.parametrize("shape", [(3, 3, 64), (1, 7, 128), (4, 1, 32), (2, 8, 256)])
@pytest.mark.parametrize("logit_cap", [0.0, 5.0])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_native_decode_attention_reads_half_precision_pools(
    layout: str, shape: tuple, logit_cap: float, kv_dtype: torch.dtype
) -> None:
    """--kv-cache-dtype bf16 / fp16: the kernel widens half-precision keys and values as it
    loads them and matches the spec over the same pools (which upcasts them) to fp32
    rounding."""
    hkv, group, dim = shape
    q, k, v, kv_indptr, kv_indices = pooled_batch(layout, hkv, group, dim)
    q, k, v = q.to(kv_dtype).float(), k.to(kv_dtype), v.to(kv_dtype)
    decode_layout = cpu_attention.decode_layout(kv_indptr, kv_indices)
    args = (q, k, v, kv_indptr, kv_indices, dim**-0.5)
    out = cpu_attention.decode_attention(*args, layout=decode_layout, logit_cap=logit_cap)
    assert not decode_layout.fallback  # the kernel took the half-precision pools
    assert out.dtype == torch.float32
    assert_close(out, reference.decode_attention(*args, logit_cap=logit_cap))


@needs_lib
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_native_stores_round_to_half_precision_as_torch_does(kv_dtype: torch.dtype) -> None:
    """fp32 rows stored into bf16 or fp16 pools (the plain store and rope's) are torch's
    `.to(dtype)` bit for bit: round to nearest even at ties, inf, -0 and NaN kept, fp16's
    overflow to inf."""
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn((9, 2 * 2 * 16), generator=gen) * 10
    bits = 8 if kv_dtype == torch.bfloat16 else 11  # mantissa bits + 1
    tie, above = 1 + 2**-bits, 1 + 3 * 2**-bits  # halfway: to 1 (even), and up
    rows[0, :6] = torch.tensor([tie, above, float("inf"), -0.0, float("nan"), 3.0e38])
    k, v = rows[:, :32].view(9, 2, 16), rows[:, 32:].view(9, 2, 16)
    slots = torch.tensor([4, 49, 1, 17, 18, 30, 2, 40, 41])
    pools = [torch.zeros((50, 2, 16), dtype=kv_dtype) for _ in range(4)]
    assert native.store_kv(pools[0], pools[1], slots, k, v)
    reference.store_kv(pools[2], pools[3], slots, k, v)
    for got, want in ((pools[0], pools[2]), (pools[1], pools[3])):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert pools[0][4, 0, 0].item() == 1.0 and pools[0][4, 0, 1].item() == 1 + 2 ** (2 - bits)
    qk = torch.cat([k, k], 1)  # 2 query heads, then the 2 key heads
    cos, sin = rope_tables(16, 1.0, torch.arange(9), qk.dtype)
    stored = [torch.zeros_like(p) for p in pools[:2]]
    rotated = native.rope(qk, cos, sin, store=(stored[0], stored[1], slots, v))
    reference.store_kv(pools[2], pools[3], slots, rotated[:, 2:], v)
    assert torch.equal(stored[0].view(torch.int16), pools[2].view(torch.int16))


@needs_lib
@pytest.mark.parametrize("dtype", [torch.float64])
def test_native_decode_leaves_other_dtypes_to_torch(dtype: torch.dtype) -> None:
    """A pool the kernel does not take (not fp32, bf16 or fp16) falls back to the torch
    path's layout, derived once and kept with the layout, with the same result as the spec."""
    q, k, v, kv_indptr, kv_indices = pooled_batch("shared", 2, 3, 32, dtype, fill=0.0)
    layout = cpu_attention.decode_layout(kv_indptr, kv_indices)
    args = (q, k, v, kv_indptr, kv_indices, 32**-0.5)
    out = cpu_attention.decode_attention(*args, layout=layout)
    assert "torch" in layout.fallback
    expected = reference.decode_attention(*args)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=1e-2)


@needs_lib
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dim", [576, 100])
def test_native_rms_norm_matches_torch(residual: bool, dim: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((70, dim + 8), generator=gen)[:, :dim]  # rows strided, as a slice
    res = torch.randn((70, dim), generator=gen) if residual else None
    weight = torch.randn(dim, generator=gen)
    hidden, normed = native.rms_norm(x, weight, 1e-5, res)
    want_hidden = x + res if residual else x
    assert torch.equal(hidden, want_hidden)  # one fp32 add: exact
    torch.testing.assert_close(normed, rms_norm(want_hidden, weight, 1e-5), atol=2e-6, rtol=1e-5)


@needs_lib
@pytest.mark.parametrize("inter", [1536, 40])
def test_native_silu_mul_matches_torch(inter: int) -> None:
    gate_up = torch.randn((33, 2 * inter), generator=torch.Generator().manual_seed(1)) * 6
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(native.silu_mul(gate_up), F.silu(gate) * up, atol=1e-5, rtol=1e-5)


@needs_lib
@pytest.mark.parametrize("rotary", [64, 32])
def test_native_rope_matches_torch(rotary: int, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn((29, 16 * 64), generator=gen)
    qk = qkv[:, : 12 * 64].view(29, 12, 64)  # a strided view of the fused output
    cos, sin = rope_tables(64, rotary / 64, torch.randint(0, 4000, (29,), generator=gen), qk.dtype)
    fused = native.rope(qk, cos, sin)
    monkeypatch.setitem(native._state, "lib", None)  # rope_qk's torch path
    torch.testing.assert_close(fused, rope_qk(qk, cos, sin))


@needs_lib
def test_native_store_kv_matches_reference() -> None:
    gen = torch.Generator().manual_seed(3)
    pools = [torch.zeros((50, 3, 16)) for _ in range(4)]
    qkv = torch.randn((7, 9 * 16), generator=gen)
    k, v = qkv[:, 3 * 16 : 6 * 16].view(7, 3, 16), qkv[:, 6 * 16 :].view(7, 3, 16)
    slots = torch.tensor([4, 49, 1, 17, 18, 30, 2])
    assert native.store_kv(pools[0], pools[1], slots, k, v)
    reference.store_kv(pools[2], pools[3], slots, k, v)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
    with pytest.raises(IndexError):
        native.store_kv(pools[0], pools[1], torch.tensor([3, 50]), k[:2], v[:2])


@needs_lib
@pytest.mark.parametrize("rows", [7, 200])  # one thread, and rows split between threads
def test_native_rope_with_store_matches_rope_then_store(rows: int) -> None:
    """The layer's fused call: q and k rotated as `rope_qk` does, and the rotated keys and v
    stored at the slots as `reference.store_kv` does; an out-of-range slot raises, and pools
    the store does not take (not fp32) leave the call to the separate ops (None)."""
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn((rows, 9 * 16), generator=gen)  # 3 q heads, 3 k heads, 3 v heads of 16
    qk, v = qkv[:, : 6 * 16].view(rows, 6, 16), qkv[:, 6 * 16 :].view(rows, 3, 16)
    cos, sin = rope_tables(16, 1.0, torch.randint(0, 4000, (rows,), generator=gen), qk.dtype)
    pools = [torch.zeros((rows + 40, 3, 16)) for _ in range(4)]
    slots = torch.randperm(rows + 40, generator=gen)[:rows]
    fused = native.rope(qk, cos, sin, store=(pools[0], pools[1], slots, v))
    want = rope_qk(qk, cos, sin)
    reference.store_kv(pools[2], pools[3], slots, want[:, 3:], v)
    assert torch.equal(fused, want)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
    with pytest.raises(IndexError):
        native.rope(
            qk[:2], cos[:2], sin[:2], store=(pools[0], pools[1], torch.tensor([3, -1]), v[:2])
        )
    wide = [p.double() for p in pools[:2]]  # a pool type the store does not take
    assert native.rope(qk, cos, sin, store=(wide[0], wide[1], slots, v)) is None


@needs_lib
@pytest.mark.parametrize("layout", ["runs", "scattered", "shared"])
@pytest.mark.parametrize("shape", [(2, 3, 64, 64), (1, 7, 128, 64), (3, 1, 32, 16)])
@pytest.mark.parametrize("logit_cap", [0.0, 5.0])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_decode_attention_in_one_call_equals_the_separate_calls(
    layout: str, shape: tuple, logit_cap: float, kv_dtype: torch.dtype
) -> None:
    """A decode step's rope, KV store and attention in one native call give the same bits
    as `rope_qk`, `reference.store_kv` and `decode_attention` one after another: the same
    output, the same pools, and qkv's query heads left rotated in place (shared prefixes
    merged after, partial rotary, GQA groups 1-7; fp32, bf16 and fp16 pools)."""
    hkv, group, dim, rotary = shape
    _, k, v, kv_indptr, kv_indices = pooled_batch(layout, hkv, group, dim, kv_dtype)
    b, heads = len(kv_indptr) - 1, hkv * group
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn((b, (heads + 2 * hkv) * dim + 5), generator=gen)[:, :-5]  # rows strided
    slots = kv_indices[kv_indptr[1:] - 1].clone()  # each request's last key is this step's
    positions = torch.randint(0, 4000, (b,), generator=gen)
    cos, sin = rope_tables(dim, rotary / dim, positions, qkv.dtype)
    decode_layout = cpu_attention.decode_layout(kv_indptr, kv_indices)
    k_want, v_want = k.clone(), v.clone()
    qk = rope_qk(qkv[:, : (heads + hkv) * dim].view(b, heads + hkv, dim), cos, sin)
    new_v = qkv[:, (heads + hkv) * dim :].view(b, hkv, dim)
    reference.store_kv(k_want, v_want, slots, qk[:, heads:], new_v)
    want = cpu_attention.decode_attention(
        qk[:, :heads], k_want, v_want, kv_indptr, kv_indices, dim**-0.5,
        layout=decode_layout, logit_cap=logit_cap,
    )  # fmt: skip
    got = cpu_attention.rope_decode_attention(
        qkv, heads, cos, sin, k, v, slots, dim**-0.5, decode_layout, logit_cap
    )
    assert torch.equal(got, want)
    for pool, expected in ((k, k_want), (v, v_want)):  # slots nobody wrote hold NaN
        torch.testing.assert_close(pool, expected, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(qkv[:, : heads * dim].view(b, heads, dim), qk[:, :heads])


@needs_lib
def test_rope_decode_attention_refuses_untouched_or_raises() -> None:
    """Pools the kernel does not take (fp64) and a layout without native runs return None
    with qkv and the pools untouched; a slot outside the pool raises IndexError."""
    _, k, v, kv_indptr, kv_indices = pooled_batch("runs", 2, 3, 64, fill=0.0)
    b = len(kv_indptr) - 1
    qkv = torch.randn((b, 10 * 64))
    cos, sin = rope_tables(64, 1.0, torch.arange(b), qkv.dtype)
    slots = kv_indices[kv_indptr[1:] - 1].clone()
    runs = cpu_attention.decode_layout(kv_indptr, kv_indices)
    torch_layout = cpu_attention.decode_layout(kv_indptr, kv_indices, native_runs=False)
    before = qkv.clone()
    for pools, layout in (((k.double(), v.double()), runs), ((k, v), torch_layout)):
        kept = [p.clone() for p in pools]
        got = cpu_attention.rope_decode_attention(qkv, 6, cos, sin, *pools, slots, 0.125, layout)
        assert got is None
        assert torch.equal(qkv, before) and all(map(torch.equal, pools, kept))
    slots[3] = len(k)
    with pytest.raises(IndexError):
        cpu_attention.rope_decode_attention(qkv, 6, cos, sin, k, v, slots, 0.125, runs)


@needs_lib
def test_engine_greedy_output_same_with_and_without_native(engine, monkeypatch) -> None:
    """SmolLM2 through the public API: 6 prompts decoded together, greedy, with the native
    kernels and with the torch path, give the same tokens."""
    prompts = [f"Count from {i} to {i + 20}:" for i in range(6)]
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    engine.flush_cache()
    on = [r["output_ids"] for r in engine.generate(prompts, params)]
    monkeypatch.setitem(native._state, "lib", None)
    engine.flush_cache()
    off = [r["output_ids"] for r in engine.generate(prompts, params)]
    assert on == off


@needs_lib
def test_engine_decodes_through_the_one_call_with_the_same_tokens(engine, monkeypatch) -> None:
    """SmolLM2's decode steps take the one-call rope + store + attention in every layer, and
    give the same tokens as the layer's separate calls (the one call refused)."""
    prompts = [f"List {i} colours:" for i in range(4)]
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    real, calls = native.rope_decode_attention, []
    # the layers in Python (the compiled loop calls the kernel itself: tests/test_decode_loop)
    monkeypatch.setattr(engine.scheduler.runner.model, "decode_loop", None)

    def counted(*args, **kwargs):
        calls.append(len(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(native, "rope_decode_attention", counted)
    engine.flush_cache()
    fused = [r["output_ids"] for r in engine.generate(prompts, params)]
    # 11 decode steps of 4 rows (the first token comes from the prefill), SmolLM2's 30 layers
    assert len(calls) >= 11 * 30 and max(calls) == len(prompts)
    monkeypatch.setattr(native, "rope_decode_attention", lambda *args, **kwargs: None)
    engine.flush_cache()
    separate = [r["output_ids"] for r in engine.generate(prompts, params)]
    assert fused == separate


@needs_lib
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("logit_cap", [0.0, 5.0])
def test_short_requests_extend_as_decode_rows(
    group: int, page_size: int, dtype: torch.dtype, logit_cap: float, monkeypatch
) -> None:
    """Extends of short requests (cached and new keys within ROWS_MAX_KEYS) whose new keys
    are stored in the pool first, as the model does, run as one native decode row per new
    token reading the pool; same result as the spec. fp16 pools fall back to the general
    path; a request past the bound keeps the whole batch on it."""
    pool = PagedPool(4000 // page_size + 40, page_size, dtype, seed=11)
    shapes = [(0, 21), (1, 7), (31, 1), (64, 33), (5, 21), (90, 38)]  # (cached, new)
    prefixes = [pool.alloc(p) for p, _ in shapes]
    new_slots = torch.cat([pool.alloc(n) for _, n in shapes])  # the new keys, stored
    q = pool.queries(len(new_slots), group)
    args = (q, pool.k[new_slots], pool.v[new_slots], pool.k, pool.v)
    args += (indptr([n for _, n in shapes]), indptr([p for p, _ in shapes]))
    args += (torch.cat(prefixes), HEAD_DIM**-0.5)
    layout = cpu_attention.make_layout(*args[5:8], new_slots=new_slots)
    assert layout.row_runs is not None
    real, taken = native.decode_attention, []

    def counted(*a, **kw):
        result = real(*a, **kw)
        taken.append(result is not None)
        return result

    monkeypatch.setattr(native, "decode_attention", counted)
    out = cpu_attention.extend_attention(*args, layout=layout, logit_cap=logit_cap)
    assert taken == [dtype == torch.float32]  # fp16: refused, then the fused kernel's path
    assert_close(out, reference.extend_attention(*args, logit_cap=logit_cap))
    longer = torch.cat([prefixes[-1], pool.alloc(cpu_attention.ROWS_MAX_KEYS)])
    too_long = (args[5], indptr([*(p for p, _ in shapes[:-1]), len(longer)]))
    too_long += (torch.cat([*prefixes[:-1], longer]),)
    assert cpu_attention.make_layout(*too_long, new_slots=new_slots).row_runs is None


@needs_lib
def test_engine_prefills_short_prompts_as_decode_rows(engine, monkeypatch) -> None:
    """SmolLM2's prefill of short prompts attends as one native decode row per prompt token
    (`cpu_attention.ROWS_MAX_KEYS`) in every layer, with the same tokens as the fused
    kernel's path (the bound set to 0). Six prompts: four or fewer take short_extend."""
    prompts = [f"Name {i} rivers:" for i in range(6)]
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    real, rows = native.decode_attention, []

    def counted(q, *args, **kwargs):
        rows.append(len(q))
        return real(q, *args, **kwargs)

    monkeypatch.setattr(native, "decode_attention", counted)
    engine.flush_cache()
    results = engine.generate(prompts, params)
    as_rows = [r["output_ids"] for r in results]
    prompt_tokens = sum(r["meta_info"]["prompt_tokens"] for r in results)
    assert rows.count(prompt_tokens) == 30  # one call a layer, a row per prompt token
    monkeypatch.setattr(cpu_attention, "ROWS_MAX_KEYS", 0)
    rows.clear()
    engine.flush_cache()
    fused = [r["output_ids"] for r in engine.generate(prompts, params)]
    assert prompt_tokens not in rows and fused == as_rows


@needs_lib
@pytest.mark.parametrize("shape", [(64, 49152), (1, 49152), (3, 17), (5, 40)])
def test_native_argmax_matches_torch_max(shape: tuple) -> None:
    """The first index of each row's maximum, as torch's max(dim=-1) returns it: a tie
    between the row's 4th and last entries, a row of -inf (a grammar that bans every
    token but EOS is masked elsewhere; this is the degenerate case), a strided view."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn((shape[0], shape[1] + 3), generator=gen)[:, : shape[1]]
    logits[0, 3] = logits[0].max() + 1
    logits[0, -1] = logits[0, 3]
    if shape[0] > 1:
        logits[1] = -float("inf")
    top, index = native.argmax(logits)
    want_top, want_index = logits.max(dim=-1)
    assert torch.equal(index, want_index) and torch.equal(top, want_top)
