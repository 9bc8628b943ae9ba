"""Quantized weights: the reference (`radixflow.kernels.quant`) against gguf's own numpy
dequantize, bit for bit, and the native kernels (`radixflow.kernels.cpu.quant`) against the
reference on every ISA path the machine has, for every type, over decode and prefill row counts
and through both the decode (few rows) and the panel (many rows) path.

Where the machine has a C compiler the kernels must build: a silently failed build would leave
the native tests skipped, not passing."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import gguf
import numpy as np
import pytest
import torch

from radixflow.kernels import quant
from radixflow.kernels.cpu import quant as native_quant

GGUF_TYPES = [
    quant.F16, quant.BF16, quant.Q4_0, quant.Q4_1, quant.Q5_0, quant.Q5_1, quant.Q8_0,
    quant.Q4_K, quant.Q5_K, quant.Q6_K,
]  # fmt: skip
ALL_TYPES = [*GGUF_TYPES, quant.I8, quant.Q4G128, quant.Q4_1R, quant.Q8_0R]
LIB = native_quant.library()
BEST = native_quant.isa()  # before any test lowers it
PANEL_ROWS = {"avx512": 16, "avx2": 12}  # quant.c's measured thresholds
needs_lib = pytest.mark.skipif(LIB is None, reason="native quant kernels unavailable")


@pytest.fixture(autouse=True)
def exact_activations() -> Iterator[None]:
    """The fp32-activation paths these tests hold to the reference at 1e-4 (the default
    integer path has its own tests: test_qdot.py)."""
    before = native_quant.set_activations(None)
    native_quant.set_activations("fp32")
    yield
    native_quant.set_activations(before)


def random_weight(qtype: int, n: int, k: int, seed: int = 0) -> quant.QuantWeight:
    """A (n, k) weight of `qtype`: quantized from Gaussian values where `quantize` makes the
    type; K-quants as random bytes with small finite fp16 d and dmin (every scale, min and
    quant bit pattern occurs); Q4G128 from random AWQ-style groups."""
    gen = torch.Generator().manual_seed(seed)
    if qtype in (quant.Q4_K, quant.Q5_K, quant.Q6_K):
        size, type_size = quant.BLOCK[qtype]
        blocks = torch.randint(0, 256, (n * k // size, type_size), dtype=torch.uint8, generator=gen)

        def halves() -> torch.Tensor:  # fp16 d in [-0.01, 0.01): no inf or nan
            d = (torch.rand(len(blocks), generator=gen) - 0.5) * 0.02
            return d.to(torch.float16).view(torch.uint8).view(-1, 2)

        for at in (208,) if qtype == quant.Q6_K else (0, 2):
            blocks[:, at : at + 2] = halves()
        return quant.QuantWeight(qtype, blocks.reshape(n, -1).contiguous(), (n, k))
    if qtype == quant.Q4G128:
        q = torch.randint(0, 16, (n, k), generator=gen)
        scales = (torch.rand((n, k // 128), generator=gen) * 0.02).half().float()
        zeros = torch.randint(0, 16, (n, k // 128), generator=gen).float()
        return quant.from_groups(q, scales, zeros)
    if qtype in quant.UNPACKED:
        file_type = quant.UNPACKED[qtype]
        return quant.repack(quant.quantize(torch.randn((n, k), generator=gen), file_type))
    return quant.quantize(torch.randn((n, k), generator=gen), qtype)


def k_for(qtype: int, blocks: int = 3) -> int:
    """An in_features the type allows: `blocks` blocks, or 77 (not a multiple of 16)"""
    size = quant.BLOCK[qtype][0]
    return 77 if size == 1 else blocks * max(size, 64)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


# ---- the reference ----


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=quant.NAMES.get)
def test_dequantize_is_gguf_bit_for_bit(qtype: int) -> None:
    w = random_weight(qtype, 19, k_for(qtype, 4))
    expected = gguf.quants.dequantize(w.data.numpy(), gguf.GGMLQuantizationType(qtype))
    got = quant.dequantize(w)
    assert got.shape == w.shape and got.dtype == torch.float32
    assert torch.isfinite(got).all()
    assert torch.equal(bits(got), bits(torch.from_numpy(np.ascontiguousarray(expected))))


@pytest.mark.parametrize("qtype", [*quant.GGUF_QUANTIZE, quant.I8, quant.F16, quant.BF16])
def test_quantize_round_trips_within_a_step(qtype: int) -> None:
    weight = torch.randn((9, 128), generator=torch.Generator().manual_seed(1))
    w = quant.quantize(weight, qtype)
    assert w.data.shape == (9, w.row_bytes) and w.nbytes < weight.numel() * 4
    step = {quant.Q4_0: 0.5, quant.Q4_1: 0.5, quant.Q5_0: 0.25, quant.Q5_1: 0.25}.get(qtype, 0.05)
    err = (quant.dequantize(w) - weight).abs().max()
    assert 0 < err < step * weight.abs().max(), f"{quant.NAMES[qtype]}: {err=}"


def test_repacked_types_are_the_file_types_rearranged() -> None:
    """repack keeps every byte (a row's d's, Q4_1's m's, then the quants); unpack undoes it;
    the values are Q4_1's and Q8_0's bit for bit."""
    w = quant.quantize(torch.randn((5, 96)), quant.Q4_1)
    r = quant.repack(w)
    assert r.qtype == quant.Q4_1R and r.data.shape == w.data.shape
    blocks = w.data.view(5, 3, 20)
    assert torch.equal(r.data[:, :6], blocks[:, :, :2].reshape(5, 6))  # the d's
    assert torch.equal(r.data[:, 12:28], blocks[:, 0, 4:])  # the first block's nibbles
    assert torch.equal(quant.unpack(r).data, w.data)
    assert torch.equal(bits(quant.dequantize(r)), bits(quant.dequantize(w)))
    w = quant.quantize(torch.randn((5, 96)), quant.Q8_0)
    r = quant.repack(w)
    assert r.qtype == quant.Q8_0R and r.data.shape == w.data.shape
    blocks = w.data.view(5, 3, 34)
    assert torch.equal(r.data[:, :6], blocks[:, :, :2].reshape(5, 6))  # the d's
    assert torch.equal(r.data[:, 38:70], blocks[:, 1, 2:])  # the second block's bytes
    assert torch.equal(quant.unpack(r).data, w.data)
    assert torch.equal(bits(quant.dequantize(r)), bits(quant.dequantize(w)))


def test_i8_is_per_row_absmax() -> None:
    weight = torch.tensor([[1.0, -2.54, 0.0], [0.0, 0.0, 0.0]])
    w = quant.quantize(weight, quant.I8)
    assert torch.equal(w.scale, torch.tensor([2.54, 0.0]) / 127)
    assert w.data.view(torch.int8).tolist() == [[50, -127, 0], [0, 0, 0]]


def test_from_groups_is_q_minus_z_times_s() -> None:
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (5, 256), generator=gen)
    scales = torch.randn((5, 2), generator=gen).half().float()  # AWQ/GPTQ scales are fp16
    zeros = torch.randint(0, 16, (5, 2), generator=gen).float()
    w = quant.from_groups(q, scales, zeros)
    expected = (q.float() - zeros.repeat_interleave(128, dim=1)) * scales.repeat_interleave(
        128, dim=1
    )
    assert w.qtype == quant.Q4G128 and w.data.shape == (5, 144)
    assert torch.equal(quant.dequantize(w), expected)  # equal values: q == z gives +0 for -0


def test_linear_and_embedding_use_the_dequantized_weight() -> None:
    w = random_weight(quant.Q4_1, 6, 64)
    x, bias = torch.randn(3, 64), torch.randn(6)
    dense = quant.dequantize(w)
    torch.testing.assert_close(quant.linear(x, w, bias), x @ dense.T + bias)
    assert torch.equal(quant.embedding(torch.tensor([5, 0, 5]), w), dense[[5, 0, 5]])


# ---- the native kernels against it ----


def test_kernels_build_where_a_compiler_exists() -> None:
    if shutil.which(os.environ.get("CC", "cc")) and os.environ.get("RADIXFLOW_NATIVE") != "0":
        assert LIB is not None, "kernels/cpu/quant.c failed to build: see the log warning"


@pytest.fixture(params=["avx512", "avx2", "scalar"])
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each ISA path the CPU has (a faster one than it has is skipped), restored after."""
    if LIB is None:
        pytest.skip("native quant kernels unavailable")
    before = native_quant.isa()
    if native_quant.set_isa(request.param) != request.param:
        native_quant.set_isa(before)
        pytest.skip(f"no {request.param} on this CPU")
    yield request.param
    native_quant.set_isa(before)


def assert_near(got: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 accumulation-order rounding: 1e-4 of the largest value, never more"""
    err = (got - expected).abs().max().item()
    assert err <= 1e-4 * expected.abs().max().item(), f"{err=}"


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=quant.NAMES.get)
def test_native_matches_reference(isa: str, qtype: int) -> None:
    """At the default threshold: row counts on both sides of it, each path's partial blocks."""
    n = 37  # panels of 4 (decode) and 16 or 32 (panel) output rows: a partial last one
    w = random_weight(qtype, n, k_for(qtype), seed=qtype)
    k = w.shape[1]
    dense = quant.dequantize(w)
    assert torch.equal(bits(native_quant.dequantize(w)), bits(dense)), "dequantize"
    gen = torch.Generator().manual_seed(3)
    bias = torch.randn(n, generator=gen)
    threshold = native_quant.set_panel_rows(-1)
    assert threshold == (0 if isa == "scalar" else PANEL_ROWS[isa]), f"{threshold=}"
    for m in (1, 2, 3, 4, 7, 8, 11, 12, 13, 15, 16, 17, 64, 200):
        x = torch.randn((m, k), generator=gen)
        expected = quant.linear(x, w)
        assert_near(native_quant.linear(x, w), expected)
        assert_near(native_quant.linear(x, w, bias), expected + bias)
    ids = torch.tensor([n - 1, 0, 5, 5])
    assert torch.equal(bits(native_quant.embedding(ids, w)), bits(quant.embedding(ids, w)))


@pytest.fixture
def panel(isa: str) -> Iterator[None]:
    """Every call through the panel path (skipped where the ISA has none), threshold restored."""
    if native_quant.set_panel_rows(1) != 1:
        native_quant.set_panel_rows(0)
        pytest.skip(f"no panel path on {isa}")
    native_quant.set_amx_rows(1 << 30)  # not the AMX path, where the CPU has one
    yield
    native_quant.set_panel_rows(0)
    native_quant.set_amx_rows(0)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=quant.NAMES.get)
def test_panel_path_matches_reference(panel: None, qtype: int) -> None:
    """The many-rows path at any row count: partial panels of output rows (37 = 32 + 5 and
    2 x 16 + 5), partial row blocks (PM = 8 or 6), K split in blocks with a bias added once
    (1280 and 1101 > 1024; 1101 and 77 leave a partial vector of k), x at a row stride."""
    gen = torch.Generator().manual_seed(5)
    for n, k in ((37, k_for(qtype)), (37, 1101 if quant.BLOCK[qtype][0] == 1 else 1280)):
        w = random_weight(qtype, n, k, seed=qtype)
        bias = torch.randn(n, generator=gen)
        for m in (1, 5, 7, 13, 33):
            x = torch.randn((m, k + 9), generator=gen)[:, 3 : 3 + k]  # row stride k + 9
            expected = quant.linear(x, w)
            assert_near(native_quant.linear(x, w), expected)
            assert_near(native_quant.linear(x, w, bias), expected + bias)


@pytest.fixture
def amx() -> Iterator[None]:
    """Every call of 1 row or more through the AMX path (skipped where the CPU has no AMX or
    the ISA is lowered), the threshold restored."""
    if native_quant.set_amx_rows(1) != 1:
        native_quant.set_amx_rows(0)
        pytest.skip("no AMX path here (no AMX-BF16, or an ISA below AVX-512)")
    yield
    native_quant.set_amx_rows(0)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=quant.NAMES.get)
def test_amx_path_matches_reference(amx: None, qtype: int) -> None:
    """bf16x3 tile products within the fp32 tolerance: partial 32-row blocks, a partial
    panel and an odd panel count (37, 100 output features), chunks of 64 (100), x at a row
    stride, a bias; K not a multiple of 32 (F16/BF16 at 77) falls back to the fp32 paths."""
    gen = torch.Generator().manual_seed(6)
    for n, k in ((37, k_for(qtype)), (100, 1024 if quant.BLOCK[qtype][0] > 1 else 1101)):
        w = random_weight(qtype, n, k, seed=qtype)
        bias = torch.randn(n, generator=gen)
        for m in (1, 5, 31, 32, 33, 70):
            x = torch.randn((m, k + 9), generator=gen)[:, 3 : 3 + k]
            expected = quant.linear(x, w)
            assert_near(native_quant.linear(x, w), expected)
            assert_near(native_quant.linear(x, w, bias), expected + bias)


def test_amx_path_is_taken_from_its_threshold(amx: None) -> None:
    """Its sums differ from the fp32 panel path's in the last bits (bf16x3), so which path ran
    shows: AMX at and above the threshold, the panel path below it."""
    w = random_weight(quant.Q4_1, 64, 512)
    x = torch.randn((40, 512), generator=torch.Generator().manual_seed(7))
    assert native_quant.set_amx_rows(0) == 32  # the measured default
    native_quant.set_amx_rows(1 << 30)
    fp32 = native_quant.linear(x, w)
    native_quant.set_amx_rows(33)
    assert torch.equal(native_quant.linear(x[:32], w), fp32[:32]), "32 rows: the panel path"
    tiles = native_quant.linear(x, w)
    assert not torch.equal(tiles, fp32), "40 rows: the AMX path"
    assert_near(tiles, quant.linear(x, w))


def test_explicit_exact_mode_never_takes_the_tiles(amx: None) -> None:
    """`activations="fp32"` (--quantized-activations fp32) keeps fp32 sums at every row count
    (the tiles' few 1e-6 a matmul grow past the 1e-4 it promises through a model); `auto`'s
    choice for a 32-block type ("fp32-tiles") takes the bf16x3 tiles from the threshold."""
    w = random_weight(quant.Q4_1, 64, 512)
    x = torch.randn((40, 512), generator=torch.Generator().manual_seed(7))
    exact, tiles = (native_quant.linear(x, w, activations=a) for a in ("fp32", "fp32-tiles"))
    assert torch.equal(native_quant.linear(x, w, activations="auto"), tiles)
    native_quant.set_amx_rows(1 << 30)
    panels = native_quant.linear(x, w)
    assert torch.equal(exact, panels), "fp32: the panel path, not the tiles"
    assert not torch.equal(tiles, panels), "fp32-tiles: the tiles"


def test_set_panel_rows_moves_the_threshold(panel: None) -> None:
    assert native_quant.set_panel_rows(-1) == 1
    assert native_quant.set_panel_rows(40) == 40
    assert native_quant.set_panel_rows(0) == PANEL_ROWS[native_quant.isa()]


@pytest.mark.parametrize("m", [2, 5, 21])  # fused, decode and panel path
def test_native_strides_and_out(isa: str, m: int) -> None:
    """x rows at a stride, the result written into columns of a wider out; threads split N."""
    w = random_weight(quant.Q5_K, 603, 512)
    gen = torch.Generator().manual_seed(4)
    wide = torch.randn((m, 700), generator=gen)
    x = wide[:, 100:612]  # (m, 512), row stride 700
    out = torch.full((m, 650), float("nan"))
    result = native_quant.linear(x, w, out=out[:, 20:623])
    assert result is not None and result.data_ptr() == out[:, 20:].data_ptr()
    assert_near(out[:, 20:623], quant.linear(x, w))
    assert out[:, :20].isnan().all() and out[:, 623:].isnan().all(), "wrote outside out"


@needs_lib
def test_native_refuses_what_it_cannot_take() -> None:
    w = random_weight(quant.Q8_0, 4, 64)
    assert native_quant.linear(torch.randn(2, 32), w) is None  # K mismatch
    assert native_quant.linear(torch.randn(2, 64, dtype=torch.float64), w) is None
    assert native_quant.linear(torch.randn(64, 2).T, w) is None  # inner stride 2
    with pytest.raises(IndexError):
        native_quant.embedding(torch.tensor([4]), w)
    x, out = torch.randn(1, 64), torch.empty(1, 4)
    # qtype 4 (ggml's removed Q4_2) is unknown
    status = LIB.rf_qlinear(
        x.data_ptr(), 1, 64, 64, w.data.data_ptr(), 4, w.row_bytes, 4, None, None,
        out.data_ptr(), 4, 1,
    )  # fmt: skip
    assert status == -1
    # K = 48 is not a multiple of Q8_0's 32
    status = LIB.rf_qlinear(
        x.data_ptr(), 1, 64, 48, w.data.data_ptr(), 4, w.row_bytes, quant.Q8_0, None, None,
        out.data_ptr(), 4, 1,
    )  # fmt: skip
    assert status == -1


@needs_lib
def test_address_is_the_callable_entry_point() -> None:
    """What a C++ caller gets: rf_qlinear by address, same result as the wrapper."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    signature = ctypes.CFUNCTYPE(
        ctypes.c_int, ptr, i64, i64, i64, ptr, i64, i64, ctypes.c_int, ptr, ptr, ptr, i64,
        ctypes.c_int,
    )  # fmt: skip
    qlinear = signature(native_quant.address("rf_qlinear"))
    w = random_weight(quant.I8, 10, 77)
    x, out = torch.randn(3, 77), torch.empty(3, 10)
    status = qlinear(
        x.data_ptr(), 3, 77, 77, w.data.data_ptr(), 10, w.row_bytes, quant.I8,
        w.scale.data_ptr(), None, out.data_ptr(), 10, 2,
    )  # fmt: skip
    assert status == 0
    assert torch.equal(out, native_quant.linear(x, w))
    assert native_quant.address("rf_nothing") is None


@needs_lib
def test_isa_environment_variable_lowers_the_path() -> None:
    """Read by the library itself (a C++ caller gets it too): a fresh process loads it bare."""
    code = f"import ctypes; print(ctypes.CDLL({LIB._name!r}).rf_qset_isa(-1))"
    for name, level in (("scalar", 0), ("avx2", 1)):
        env = {**os.environ, "RADIXFLOW_QUANT_ISA": name}
        result = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
        assert result.stdout.strip() == str(min(level, native_quant.ISAS.index(BEST))), (
            result.stderr[-2000:]
        )


def test_fused_split_moves_the_threshold_and_changes_no_result() -> None:
    """rf_qset_fused_split: set, asked, restored; one row of Q4_1 split over 2 threads or not
    gives the same bits (each output is one thread's sum)."""
    default = native_quant.set_fused_split(0)
    assert default > 0 and native_quant.set_fused_split(1 << 16) == 1 << 16
    assert native_quant.set_fused_split(-1) == 1 << 16
    w = random_weight(quant.Q4_1, 1536, 576)
    x = torch.randn((1, 576), generator=torch.Generator().manual_seed(6))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        split = native_quant.linear(x, w)
        native_quant.set_fused_split(0)
        whole = native_quant.linear(x, w)
    finally:
        torch.set_num_threads(before)
        native_quant.set_fused_split(0)
    assert torch.equal(bits(split), bits(whole))
    assert_near(whole, quant.linear(x, w))


def fixed_point_auto(x: torch.Tensor, w: quant.QuantWeight, bias: torch.Tensor) -> torch.Tensor:
    """`auto` on x's rows, into a wider out: nothing written outside, its sums not the exact
    mode's (the fixed-point kernel taken), and with those kernels off `auto` gives the exact
    mode's bits. -> auto's output"""
    m, n = x.shape[0], w.shape[0]
    out = torch.full((m, n + 3), float("nan"))
    got = native_quant.linear(x, w, bias, out=out[:, 1 : 1 + n], activations="auto")
    assert out[:, 0].isnan().all() and out[:, -2:].isnan().all(), "wrote outside"
    fp32 = native_quant.linear(x, w, bias, activations="fp32")
    assert not torch.equal(got, fp32), "auto: the fixed-point kernel"
    native_quant.set_x24(False)
    assert torch.equal(native_quant.linear(x, w, bias, activations="auto"), fp32)
    native_quant.set_x24(True)
    return got


def fixed_point_edges(x: torch.Tensor, w: quant.QuantWeight) -> None:
    """A NaN in x's first row makes that row's outputs NaN only; a zero x gives zeros."""
    x[0, 3] = float("nan")
    got = native_quant.linear(x, w, activations="auto")
    assert got[0].isnan().all() and not got[1:].isnan().any()
    zero = torch.zeros(1, x.shape[1])
    assert torch.equal(native_quant.linear(zero, w, activations="auto"), torch.zeros(1, w.shape[0]))


@pytest.fixture
def x24() -> Iterator[None]:
    """quant_x24.c's kernel on (skipped where the CPU has no AVX512-VNNI or the ISA is
    lowered: there `auto` keeps the fp32 fused kernel), restored after."""
    if BEST != "avx512" or native_quant.set_int_isa(None) != "avx512-vnni":
        pytest.skip("no AVX512-VNNI here")
    assert native_quant.set_x24(None), "on by default"
    yield
    native_quant.set_x24(True)


@pytest.mark.parametrize("qtype", [quant.Q4_1R, quant.Q8_0R], ids=quant.NAMES.get)
def test_x24_kernels_take_auto_rows_near_exact(x24: None, qtype: int) -> None:
    """1-4 rows of x against Q4_1R or Q8_0R under `auto` (a small model's one stream) run x in
    fixed point as three signed bytes (24 bits, 22 for Q8_0R): within 3e-6 of the largest
    output of the reference (the fp32 kernel's rounding is ~1e-6; 1e-4 is the exact paths'
    bound), at K of 18 blocks (partial groups of four and of two), 48 and 5, an outlier in
    x, a bias, x and out at a stride, 2 threads. Taken: its sums differ from the exact mode's
    in the last bits, and with it off `auto` gives the fp32 kernels' bits; the explicit
    exact mode never takes it. A NaN in x makes that row's outputs NaN; a zero x gives zeros."""
    gen = torch.Generator().manual_seed(11)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for n, k in ((3072, 576), (576, 1536), (37, 160)):
            w = random_weight(qtype, n, k, seed=k)
            bias = torch.randn(n, generator=gen)
            for m in (1, 2, 3, 4):
                x = torch.randn((m, k + 7), generator=gen)[:, 2 : 2 + k]
                x[:, 5] *= 50.0
                expected = quant.linear(x, w).double() + bias.double()
                got = fixed_point_auto(x, w, bias)
                err = (got.double() - expected).abs().max().item()
                assert err <= 3e-6 * expected.abs().max().item(), f"{n=} {k=} {m=} {err=}"
        fixed_point_edges(x, w)
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def x24_avx2() -> Iterator[None]:
    """The AVX2 path (quant_x24_avx2.c's kernel under `auto`), on any AVX2 CPU: the ISA lowered
    to AVX2 where it has AVX-512, restored after."""
    if BEST not in ("avx512", "avx2"):
        pytest.skip("no AVX2 here")
    assert native_quant.set_isa("avx2") == "avx2"
    assert native_quant.set_x24(None), "on by default"
    yield
    native_quant.set_x24(True)
    native_quant.set_isa(BEST)


def test_x24_kernel_of_the_avx2_path_takes_auto_rows_near_exact(x24_avx2: None) -> None:
    """1-4 rows of x against Q4_1R under `auto` on the AVX2 path put x in 24-bit fixed point
    (three signed bytes a value, |v| <= 2^23 - 2^16 a block; maddubs, no VNNI): each output
    within the bound that rounding allows, the sum over blocks of (the block's largest |x| /
    (2^23 - 2^16) / 2) times the block's sum of |w|, plus 3e-6 of the row's largest output
    for fp32's own (1e-4 is the exact paths' bound), at K of 18 blocks (a lone last block of
    a pair, a partial group of eight), 48 and 5, an outlier in x, a bias, x and out at a
    stride, 2 threads. Taken: its sums differ from the exact mode's in the last bits, and
    with it off `auto` gives the fp32 kernel's bits. A NaN in x makes that row's outputs NaN;
    a zero x gives zeros."""
    gen = torch.Generator().manual_seed(12)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    qtype = quant.Q4_1R
    try:
        for n, k in ((3072, 576), (576, 1536), (37, 160)):
            w = random_weight(qtype, n, k, seed=k)
            weights = quant.dequantize(w).double()
            bias = torch.randn(n, generator=gen)
            for m in (1, 2, 3, 4):
                x = torch.randn((m, k + 7), generator=gen)[:, 2 : 2 + k]
                x[:, 5] *= 50.0
                expected = x.double() @ weights.T + bias.double()
                half_step = x.abs().reshape(m, k // 32, 32).amax(-1).double() / 8323072 / 2
                bound = half_step.repeat_interleave(32, 1) @ weights.abs().T
                bound += 3e-6 * expected.abs().amax(1, keepdim=True)
                err = (fixed_point_auto(x, w, bias).double() - expected).abs()
                assert (err <= bound).all(), f"{n=} {k=} {m=} {(err / bound).max()=}"
        fixed_point_edges(x, w)
    finally:
        torch.set_num_threads(before)
