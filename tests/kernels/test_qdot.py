"""The integer path (kernels/cpu/qdot.c: x quantized to 8 bits per block, integer dot
products against the weight's blocks): its activations bit for bit the reference's
(`quant.quantize_activations`), its products within fp32 rounding of the reference's exact
product of those activations with the dequantized weight (`quant.linear_int8`), on every
instruction set the CPU has (AVX512-VNNI, AVX-VNNI, AVX2 maddubs), for every type it takes
and every row count it is taken for; and which calls take it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_quant import LIB, random_weight

from radixflow.kernels import quant
from radixflow.kernels.cpu import quant as native_quant

pytestmark = pytest.mark.skipif(
    LIB is None or native_quant.set_int_isa(None) is None, reason="no integer path here"
)
BEST = None if LIB is None else native_quant.set_int_isa(None)


@pytest.fixture(params=["avx512-vnni", "avx-vnni", "avx2"])
def int_isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each instruction set the CPU has (a better one than it has is skipped), restored."""
    if native_quant.set_int_isa(request.param) != request.param:
        native_quant.set_int_isa(BEST)
        pytest.skip(f"no {request.param} on this CPU")
    yield request.param
    native_quant.set_int_isa(BEST)


def assert_int8_near(got: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 rounding of block scales and sums: 2e-6 of the largest value. The integer path
    is about 5e-3 from the fp32 path on these weights, so a wrong scale, offset or lane
    order cannot pass."""
    err = (got - expected).abs().max().item()
    assert err <= 2e-6 * expected.abs().max().item(), f"{err=}"


@pytest.mark.parametrize("block", [32, 256])
def test_activations_are_the_references_bit_for_bit(block: int) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((5, 4 * 256 + 7), generator=gen)[:, 3 : 3 + 4 * 256]  # a row stride
    x[1, :block] = 0  # an all-zero block: d = 0, q = 0
    x[2, 5] = 1e4  # one large value: the rest of its block rounds to small integers
    x[3, :block] = torch.arange(block) / 2 - 3.25  # ties to even where x / d lands on .5
    got = native_quant.quantize_activations(x, block)
    expected = quant.quantize_activations(x, block)
    assert got is not None
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert expected[0].abs().max() == 127 and expected[1][1, 0] == 0


@pytest.mark.parametrize("qtype", quant.INT8_TYPES, ids=quant.NAMES.get)
def test_integer_path_matches_reference(int_isa: str, qtype: int, no_amx: None) -> None:
    """Row counts 1-4 (one pass of the weight) and past 4 (groups of 4 and a remainder), at
    a row stride, with a bias, into a wider out; partial thread chunks (37 rows). The 32-block
    types also at K = 576 (SmolLM2's: AVX2's one-row kernel takes 16 of its 18 blocks in groups of
    eight and the last two one at a time)."""
    for k in (3 * 256, 576) if quant.BLOCK[qtype][0] == 32 else (3 * 256,):
        integer_path_at(qtype, 37, k)


def integer_path_at(qtype: int, n: int, k: int) -> None:
    w = random_weight(qtype, n, k, seed=qtype)
    gen = torch.Generator().manual_seed(2)
    bias = torch.randn(n, generator=gen)
    native_quant.set_int_rows(64)  # every row count below through this path
    for m in (1, 2, 3, 4, 5, 9, 64):
        x = torch.randn((m, k + 9), generator=gen)[:, 3 : 3 + k]
        expected = quant.linear_int8(x, w)
        assert_int8_near(native_quant.linear(x, w, activations="int8"), expected)
        out = torch.full((m, n + 5), float("nan"))
        native_quant.linear(x, w, bias, out=out[:, 2 : 2 + n], activations="int8")
        assert_int8_near(out[:, 2 : 2 + n], expected + bias)
        assert out[:, :2].isnan().all() and out[:, 2 + n :].isnan().all()


@pytest.fixture
def no_amx() -> Iterator[None]:
    """The AMX paths of int8 mode off (where the CPU has them), restored after."""
    native_quant.set_amx_int_rows(1 << 30)
    native_quant.set_amx_bf16_rows(1 << 30)
    yield
    native_quant.set_amx_int_rows(0)
    native_quant.set_amx_bf16_rows(0)
    native_quant.set_int_rows(0)


def test_which_calls_take_it(no_amx: None) -> None:
    """int8 for the integer types up to set_int_rows' rows; fp32 activations, a type it does
    not take (F16) and more rows take the fp32 paths, which the reference's exact product
    shows (the two differ by ~1e-3)."""
    w = random_weight(quant.Q4_K, 64, 512)
    x = torch.randn((8, 512), generator=torch.Generator().manual_seed(3))
    exact, int8 = quant.linear(x, w), quant.linear_int8(x, w)
    assert (exact - int8).abs().max() > 1e-3
    assert_int8_near(native_quant.linear(x, w, activations="int8"), int8)
    fp32 = native_quant.linear(x, w, activations="fp32")
    assert (fp32 - exact).abs().max() <= 1e-4 * exact.abs().max()
    default = native_quant.set_int_rows(0)
    try:
        assert native_quant.set_int_rows(4) == 4
        above = native_quant.linear(x, w, activations="int8")
        assert (above - exact).abs().max() <= 1e-4 * exact.abs().max(), "8 rows > 4: fp32"
        assert_int8_near(native_quant.linear(x[:4], w, activations="int8"), int8[:4])
    finally:
        native_quant.set_int_rows(default)
    f16 = random_weight(quant.F16, 16, 64)
    y = torch.randn((2, 64), generator=torch.Generator().manual_seed(4))
    got = native_quant.linear(y, f16, activations="int8")
    assert (got - quant.linear(y, f16)).abs().max() <= 1e-4 * got.abs().max()


def test_a_big_models_auto_takes_int8_for_batches_only(int_isa: str) -> None:
    """`auto-big` (`auto` on a model of 1e9 weights or more) on a 32-block type: one row of
    Q4_0 or Q5_1 in int8 on every instruction set (Q4_0 eight blocks a step: qdot_row32.c,
    qdot_row32_zmm.c; Q5_1 on the row kernels); with AVX512-VNNI the exact fused kernels for
    2-4 rows of Q4_0 (`auto`'s own result, bit for bit) and int8 for Q5_1's, int8
    activations from 5 (the int8 mode's result, bit for bit: the integer path, or where the
    CPU has AMX its int8 tiles); below it, where the integer kernels win at fewer rows, int8
    at every row count for the 4- and 5-bit types (2-4 rows on the panels); exact at 1-4
    rows for Q8_0. A K type is int8 at every row count, as under `auto`."""
    w = random_weight(quant.Q4_0, 48, 512)
    x = torch.randn((16, 512), generator=torch.Generator().manual_seed(8))
    exact = quant.linear(x, w)
    w5 = random_weight(quant.Q5_1, 16, 512)
    for rows in (1, 3):
        got = native_quant.linear(x[:rows], w5, activations="auto-big")
        assert torch.equal(got, native_quant.linear(x[:rows], w5, activations="int8"))
        assert not torch.equal(got, native_quant.linear(x[:rows], w5, activations="auto"))
    for rows in (1, 2, 4):
        got = native_quant.linear(x[:rows], w, activations="auto-big")
        if int_isa == "avx512-vnni" and rows > 1:
            assert torch.equal(got, native_quant.linear(x[:rows], w, activations="auto"))
            assert (got - exact[:rows]).abs().max() <= 1e-4 * exact.abs().max()
        else:
            assert torch.equal(got, native_quant.linear(x[:rows], w, activations="int8"))
            assert (got - exact[:rows]).abs().max() > 1e-4 * exact.abs().max()
    for rows in (5, 16):
        got = native_quant.linear(x[:rows], w, activations="auto-big")
        assert torch.equal(got, native_quant.linear(x[:rows], w, activations="int8"))
    w8 = random_weight(quant.Q8_0, 16, 512)
    got = native_quant.linear(x[:1], w8, activations="auto-big")
    assert torch.equal(got, native_quant.linear(x[:1], w8, activations="auto"))
    batch = native_quant.linear(x, w, activations="auto-big")
    if native_quant.set_amx_int_rows(-1):  # int8 tiles take 16 rows: 8-bit activations
        assert (batch - exact).abs().max() > 1e-3
    wk = random_weight(quant.Q4_K, 16, 256)
    assert native_quant.activations_for(quant.Q4_K, "auto-big") == "int8"
    xk = torch.randn((2, 256), generator=torch.Generator().manual_seed(9))
    assert torch.equal(
        native_quant.linear(xk, wk, activations="auto-big"),
        native_quant.linear(xk, wk, activations="int8"),
    )


def test_process_default_is_auto_and_settable() -> None:
    """auto: a K type through the integer path, a 32-block type exact; then each mode set."""
    before = native_quant.set_activations(None)
    assert before == "auto"  # unless RADIXFLOW_QUANT_ACTIVATIONS says otherwise
    gen = torch.Generator().manual_seed(6)
    wk, w32 = random_weight(quant.Q4_K, 16, 256), random_weight(quant.Q4_0, 16, 256)
    xk = torch.randn((1, 256), generator=gen)
    assert_int8_near(native_quant.linear(xk, wk), quant.linear_int8(xk, wk))
    exact = quant.linear(xk, w32)
    assert (native_quant.linear(xk, w32) - exact).abs().max() <= 1e-4 * exact.abs().max()
    try:
        assert native_quant.set_activations("fp32") == "fp32"
        w = random_weight(quant.Q8_0, 16, 256)
        x = torch.randn((1, 256), generator=torch.Generator().manual_seed(5))
        exact = quant.linear(x, w)
        assert (native_quant.linear(x, w) - exact).abs().max() <= 1e-4 * exact.abs().max()
        assert native_quant.set_activations("int8") == "int8"
        assert_int8_near(native_quant.linear(x, w), quant.linear_int8(x, w))
    finally:
        native_quant.set_activations(before)


@pytest.fixture
def amx_int8() -> Iterator[None]:
    """Every int8 call of 2 rows or more through AMX-INT8 tiles (skipped without them)."""
    if native_quant.set_amx_int_rows(1) != 1:
        native_quant.set_amx_int_rows(0)
        pytest.skip("no AMX-INT8 here (or an ISA below AVX-512)")
    native_quant.set_amx_bf16_rows(1 << 30)
    native_quant.set_int_rows(1)
    yield
    native_quant.set_amx_int_rows(0)
    native_quant.set_amx_bf16_rows(0)
    native_quant.set_int_rows(0)


@pytest.mark.parametrize("qtype", quant.INT8_TYPES, ids=quant.NAMES.get)
def test_amx_int8_path_matches_reference(amx_int8: None, qtype: int) -> None:
    """x per 32 for every type (`linear_int8(block=32)`): partial 16-row blocks of x, a
    partial panel of 16 features (37), an odd count of 32-chunks (K = 96 for the 32-block
    types: the pairs' last one alone), a bias, x at a row stride."""
    gen = torch.Generator().manual_seed(7)
    ks = (3 * 256,) if quant.activation_block(qtype) == 256 else (3 * 256, 96)
    for k in ks:
        w = random_weight(qtype, 37, k, seed=qtype)
        bias = torch.randn(37, generator=gen)
        for m in (2, 5, 16, 17, 40):
            x = torch.randn((m, k + 9), generator=gen)[:, 3 : 3 + k]
            expected = quant.linear_int8(x, w, bias, block=32)
            assert_int8_near(native_quant.linear(x, w, bias, activations="int8"), expected)


def test_amx_bf16_pass_from_its_threshold() -> None:
    """int8 mode from set_amx_bf16_rows' rows: one bf16 x bf16 tile pass, within bf16's
    rounding of the exact product (about 1e-3 of the largest value), not the int8 result."""
    if native_quant.set_amx_bf16_rows(-1) == 0:
        pytest.skip("no AMX-BF16 here (or an ISA below AVX-512)")
    assert native_quant.set_amx_bf16_rows(-1) == 64  # the measured default
    w = random_weight(quant.Q4_K, 40, 512)
    x = torch.randn((64, 512), generator=torch.Generator().manual_seed(8))
    exact = quant.linear(x, w)
    got = native_quant.linear(x, w, activations="int8")
    err = (got - exact).abs().max().item()
    assert 1e-6 < err <= 4e-3 * exact.abs().max().item(), f"{err=}"
    below = native_quant.linear(x[:63], w, activations="int8")
    block = 256 if BEST == "avx512-vnni" else 32  # the integer panels, or AMX-INT8 tiles
    assert_int8_near(below, quant.linear_int8(x[:63], w, block=block))


def test_int8_paths_flush_denormals_and_restore_the_callers_mode() -> None:
    """Denormal activations read as zero on every int8 path (one row, AMX-INT8 tiles, the
    bf16 pass; a microcode assist each otherwise, which made a 7B step 1.4x slower), while the
    exact path keeps them, and the caller's floating-point mode is as it was after a call."""
    w = random_weight(quant.Q4_K, 64, 512)
    tiny = torch.full((64, 512), 1e-39)  # below FLT_MIN: denormal
    assert tiny[0, 0].item() != 0
    exact = native_quant.linear(tiny[:1], w, activations="fp32")
    assert exact is not None and exact.abs().max() > 0, "the exact path keeps denormals"
    rows = [1, 8]  # 8: qdot_gemm.c's panels on AVX512-VNNI, the row kernels on AVX2
    if native_quant.set_int_isa(None) == "avx512-vnni":
        rows.append(64)  # the panels (on AVX2 64 rows take the exact panel path)
    if native_quant.set_amx_int_rows(-1):
        rows.append(16)  # AMX-INT8 tiles: the integer path held to 4 rows for it
    try:
        for m in rows:
            native_quant.set_int_rows(4 if m == 16 else 0)
            got = native_quant.linear(tiny[:m], w, activations="int8")
            assert got is not None and torch.equal(got, torch.zeros_like(got)), f"{m} rows"
            assert (tiny[:1] * 1.0)[0, 0].item() != 0, f"{m} rows left denormals flushed"
    finally:
        native_quant.set_int_rows(0)


K_TYPES = (quant.Q4_K, quant.Q5_K, quant.Q6_K)


BLOCK32_TYPES = tuple(t for t in quant.INT8_TYPES if quant.activation_block(t) == 32)


@pytest.mark.parametrize("qtype", K_TYPES + BLOCK32_TYPES, ids=quant.NAMES.get)
def test_many_rows_match_reference(qtype: int, no_amx: None) -> None:
    """The integer panels from a few rows to a prefill chunk (qdot_gemm.c for the K types,
    qdot_gemm32.c for the 32-block types, on AVX512-VNNI: 11 16-feature panels, the last one
    of 5, in 3 chunks of 4 over 2 threads; below it the K types' qdot_gemm8.c: 21 8-feature
    panels, the last one of 5, 4 rows at a time; rows 8 at a time and a remainder; x in blocks of
    rows, 300 = 256 + 44 at K = 4096, and 248 + 52 at the 32-block types' K = 4096 + 96,
    not a multiple of 256), from the default threshold and from one row, with a bias into a
    wider out."""
    n, k = 165, 4096 if qtype in K_TYPES else 4096 + 3 * 32
    w = random_weight(qtype, n, k, seed=qtype)
    gen = torch.Generator().manual_seed(9)
    bias = torch.randn(n, generator=gen)
    native_quant.set_int_rows(1 << 20)
    default = native_quant.set_int_gemm_rows(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for m in (1, 5, 8, 17, 64, 300):
            x = torch.randn((m, k + 9), generator=gen)[:, 3 : 3 + k]
            expected = quant.linear_int8(x, w, bias)
            for gemm_rows in (default, 1) if m < 64 else (default,):  # the same path at 64+
                native_quant.set_int_gemm_rows(gemm_rows)
                out = torch.full((m, n + 3), float("nan"))
                native_quant.linear(x, w, bias, out=out[:, 1 : 1 + n], activations="int8")
                assert_int8_near(out[:, 1 : 1 + n], expected)
                assert out[:, 0].isnan().all() and out[:, 1 + n :].isnan().all()
        if qtype not in K_TYPES:  # one row at K = 4096: AVX2's row kernel reorders x for itself
            w, x = random_weight(qtype, n, 4096, seed=qtype), torch.randn((1, 4096), generator=gen)
            for gemm_rows in (default, 1):
                native_quant.set_int_gemm_rows(gemm_rows)
                got = native_quant.linear(x, w, activations="int8")
                assert_int8_near(got, quant.linear_int8(x, w, None))
    finally:
        native_quant.set_int_gemm_rows(0)
        torch.set_num_threads(threads)


LARGEST = {  # the bytes of a block holding its quants (all bits set: each at its largest)
    quant.Q4_K: (16, 144), quant.Q5_K: (16, 176), quant.Q6_K: (0, 192),
    quant.Q4_0: (2, 18), quant.Q4_1: (4, 20), quant.Q5_0: (2, 22), quant.Q5_1: (4, 24),
}  # fmt: skip


@pytest.mark.parametrize("qtype", list(LARGEST), ids=quant.NAMES.get)
def test_panels_take_the_largest_products(int_isa: str, qtype: int, no_amx: None) -> None:
    """Every quant at its largest (Q4 15, Q5 31, Q6_K 63) against x at +-127: the panels'
    partial sums at their bound (AVX2 adds maddubs' int16 pairs over 8, 4 or 2 quads), the
    row kernels' too; within fp32 rounding of the reference."""
    n, k = 24, 512
    w = random_weight(qtype, n, k, seed=5)
    quants = LARGEST[qtype]
    w.data.view(-1, quant.BLOCK[qtype][1])[:, quants[0] : quants[1]] = 0xFF
    x = torch.ones((40, k))
    x[1::2] = -1  # every other row at -127
    x[2, : k // 2] = 0.5  # and a row at 64
    native_quant.set_int_rows(1 << 20)
    for m in (1, 4, 5, 40):
        expected = quant.linear_int8(x[:m], w)
        for gemm_rows in (1 << 20, 1):  # the row kernels, the panels
            native_quant.set_int_gemm_rows(gemm_rows)
            try:
                assert_int8_near(native_quant.linear(x[:m], w, activations="int8"), expected)
            finally:
                native_quant.set_int_gemm_rows(0)


def test_with_amx_the_integer_path_stops_below_the_bf16_pass() -> None:
    """AMX present, by default: a K type on the integer path (256-blocks of x) up to 63 rows
    on AVX512-VNNI (its panels), 8 on a lower ISA (its row kernels), AMX-INT8 (32-blocks of
    x) between; a 32-block type (x in blocks of 32) on AVX512-VNNI's panels up to 40 rows
    (Q4_0, Q5_0, Q8_0) or 63 (Q4_1, Q4_1R, Q5_1: a minimum), AMX-INT8 above: the two agree
    bit for bit on these types, so the threshold moves no result (and no test sees it)."""
    if native_quant.set_amx_int_rows(-1) == 0:
        pytest.skip("no AMX-INT8 here")
    w = random_weight(quant.Q4_K, 40, 512)
    gen = torch.Generator().manual_seed(10)
    cases = {"avx512-vnni": ((5, 256), (8, 256), (17, 256), (63, 256)), "avx2": ((8, 256), (9, 32))}
    for isa, rows in cases.items():
        native_quant.set_int_isa(isa)
        try:
            for m, block in rows:
                x = torch.randn((m, 512), generator=gen)
                expected = quant.linear_int8(x, w, block=block)
                assert_int8_near(native_quant.linear(x, w, activations="int8"), expected)
        finally:
            native_quant.set_int_isa(BEST)
    w32 = random_weight(quant.Q8_0, 40, 512)
    w41 = random_weight(quant.Q4_1R, 40, 512)
    x = torch.randn((63, 512), generator=gen)
    try:  # both paths: each block's exact int32 sum, scaled and summed in the same order
        for w, m in ((w32, 5), (w32, 40), (w32, 41), (w41, 63)):
            got = native_quant.linear(x[:m], w, activations="int8")
            assert_int8_near(got, quant.linear_int8(x[:m], w))
            native_quant.set_amx_int_rows(1 << 30)
            native_quant.set_int_rows(1 << 20)
            panels = native_quant.linear(x[:m], w, activations="int8")
            native_quant.set_amx_int_rows(0)
            native_quant.set_int_rows(4)
            tiles = native_quant.linear(x[:m], w, activations="int8")
            native_quant.set_int_rows(0)
            assert torch.equal(got, panels) and torch.equal(got, tiles), f"{m} rows"
    finally:
        native_quant.set_amx_int_rows(0)
        native_quant.set_int_rows(0)


NO_AMX = """
import sys, torch
sys.path.insert(0, {here!r})
from test_quant import random_weight
from radixflow.kernels import quant
from radixflow.kernels.cpu import quant as native_quant
assert native_quant.set_int_isa({isa!r}) == {isa!r}
for m, qtype in ((17, quant.Q4_K), (64, quant.Q6_K), (300, quant.Q4_K), (5, quant.Q4_0),
                 (63, quant.Q4_1R), (70, quant.Q8_0)):
    w = random_weight(qtype, 40, 1024, seed=m)
    x = torch.randn((m, 1024), generator=torch.Generator().manual_seed(m))
    expected = quant.linear_int8(x, w)
    err = (native_quant.linear(x, w, activations="int8") - expected).abs().max()
    print(m, (err / expected.abs().max()).item())
"""


@pytest.mark.parametrize("isa", ["avx512-vnni", "avx2"])
def test_without_amx_the_integer_path_takes_many_rows(isa: str) -> None:
    """RADIXFLOW_QUANT_AMX=0 (a CPU without AMX, as AMD Zen 3 or 4), by default: on
    AVX512-VNNI every row count of a K type or a 32-block type (Q4_0, Q4_1R: Q4_1 as held on
    AVX-512, Q8_0) on the integer path (its panels), not the fp32 panels (5e-3 away); on AVX2
    the K types at every row count (17, 64 and 300 rows: its panels, qdot_gemm8.c), and the
    32-block types with 4- or 5-bit quants (Q4_0 at 5 rows, Q4_1R at 63: qdot_gemm8_32.c);
    Q8_0 above 4 rows on the exact paths there."""
    if isa == "avx512-vnni" and BEST != isa:
        pytest.skip("no AVX512-VNNI here")
    env = {**os.environ, "RADIXFLOW_QUANT_AMX": "0"}
    code = NO_AMX.format(here=str(Path(__file__).parent), isa=isa)
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    lines = result.stdout.split("\n")[:-1]
    assert len(lines) == 6, result.stderr[-2000:]
    for i, line in enumerate(lines):
        if isa == "avx2" and i == 5:  # exact: the int8 reference's distance from the exact one
            assert float(line.split()[1]) > 1e-4, line
        else:
            assert float(line.split()[1]) <= 2e-6, line
