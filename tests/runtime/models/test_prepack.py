"""CPU fp32 weights prepacked for oneDNN or MKL (runtime/models/prepack.py) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from family_models import save_family
from torch import nn
from tp_ranks import ragged_logits

from radixflow.runtime.config import ServerConfig
from radixflow.runtime.model_executor.model_runner import load_model
from radixflow.runtime.models import prepack

CPU = torch.device("cpu")
# This project's CI machines are x86 with torch's MKL and oneDNN builds; elsewhere prepack
# must be a no-op.
WAYS = prepack.available_ways(CPU, torch.float32)


def test_both_layouts_are_available_on_x86_cpu_builds() -> None:
    import platform

    if platform.machine() in ("x86_64", "AMD64"):
        assert WAYS == ["mkl", "onednn"]
    bf16 = ["onednn"] if torch.ops.mkldnn._is_mkldnn_bf16_supported() else []
    assert prepack.available_ways(CPU, torch.bfloat16) == bf16  # MKL packs fp32 only
    assert not prepack.available(CPU, torch.float16)


@pytest.mark.skipif(not prepack.available(CPU, torch.bfloat16), reason="no oneDNN bf16 on this CPU")
@pytest.mark.parametrize("rows", [1, 5, 64, 130])
def test_bf16_pack_equals_f_linear_to_bf16_rounding(rows: int) -> None:
    """--dtype bfloat16: oneDNN's bf16 pack gives F.linear's bf16 result to bf16's rounding
    (both accumulate in fp32), and the pack-time check accepts it."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(96, 40, generator=gen).bfloat16()
    x = torch.randn(rows, 40, generator=gen).bfloat16()
    packed = prepack.pack(weight, "onednn", min_rows=1)
    got = prepack.linear(x, weight, packed)
    assert got.dtype == torch.bfloat16
    exact = x.double() @ weight.double().T
    torch.testing.assert_close(got.double(), exact, rtol=1e-2, atol=2e-2)
    assert prepack.agrees(weight, packed)


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("shape", [(1,), (5,), (64,), (130,), (3, 7), (0,)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(way: str, shape: tuple[int, ...], bias: bool) -> None:
    """Any number of rows (the pack was made for 64), 3-D inputs, bias: F.linear's result to
    fp32 rounding, whether the rows go through the pack (min_rows 1) or F.linear."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 40, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(*shape, 40, generator=gen)
    for min_rows in (1, prepack.PACKED_MIN_ROWS):
        got = prepack.linear(x, weight, prepack.pack(weight, way, min_rows), b)
        assert got.shape == (*shape, 96)
        torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("way", WAYS)
def test_agrees_rejects_a_pack_of_other_weights(way: str) -> None:
    """The pack-time check that guards against a layout that depends on the rows."""
    weight = torch.randn(32, 16)
    assert prepack.agrees(weight, prepack.pack(weight, way))
    assert not prepack.agrees(weight, prepack.pack(weight + 0.01, way))


def test_choose_keeps_the_fastest_way_by_a_margin(monkeypatch) -> None:
    """`choose` keeps the fastest way at DECODE_ROWS rows, a later way only when it beats the
    earlier by MARGIN; single rows go through the pack only when it wins there too; the
    choice is made once per process for a set of shapes."""
    timings: dict[int, dict[str, float]] = {}
    calls: list[int] = []

    def fake_times(ways_calls: dict, rows: int, rounds: int = 5) -> dict[str, float]:
        calls.append(rows)
        return {way: timings[rows][way] for way in ways_calls}

    monkeypatch.setattr(prepack, "_median_times", fake_times)
    monkeypatch.setattr(prepack, "_CHOICES", {})
    weights = [torch.randn(8, 4)]
    timings[64] = {"linear": 10.0, "mkl": 8.0, "onednn": 7.5}  # onednn within MARGIN of mkl
    timings[1] = {"linear": 1.0, "mkl": 0.5, "onednn": 0.5}
    assert prepack.choose(weights, ["mkl", "onednn"]) == ("mkl", 1)
    assert prepack.choose(weights, ["mkl", "onednn"]) == ("mkl", 1)  # memoized
    assert calls == [64, 1]
    timings[64] = {"linear": 10.0, "mkl": 9.5, "onednn": 5.0}
    timings[1] = {"linear": 1.0, "mkl": 0.5, "onednn": 0.95}  # not faster at one row
    assert prepack.choose([torch.randn(8, 5)], ["mkl", "onednn"]) == ("onednn", 4)
    timings[64] = {"linear": 10.0, "mkl": 9.5}
    assert prepack.choose([torch.randn(8, 6)], ["mkl"]) == ("linear", 4)


def test_cpu_matmul_is_checked() -> None:
    with pytest.raises(ValueError, match="cpu_matmul"):
        ServerConfig(cpu_matmul="blas")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepack")
    return {family: save_family(family, root)[0] for family in ("qwen2", "qwen3")}


@pytest.mark.parametrize("way", ["onednn", "mkl"])
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])  # tied and untied LM heads
def test_loaded_model_is_packed_and_equal_to_unpacked(checkpoints, family: str, way: str) -> None:
    packed = load_model(checkpoints[family], ServerConfig(cpu_matmul=way), CPU, torch.float32)
    plain = load_model(
        checkpoints[family], ServerConfig(disable_cpu_weight_prepack=True), CPU, torch.float32
    )
    assert not any(type(m) is prepack.PackedLinear for m in plain.modules())
    assert plain.head_pack is None
    if way in WAYS:
        assert not any(type(m) is nn.Linear for m in packed.modules())
        ways = {m.packed.way for m in packed.modules() if type(m) is prepack.PackedLinear}
        assert ways == {way} and packed.head_pack.way == way
    torch.testing.assert_close(ragged_logits(packed), ragged_logits(plain), rtol=1e-5, atol=1e-5)


def test_choose_leaves_torch_global_generator_alone(monkeypatch) -> None:
    """The load-time timing draws its inputs from its own generator: loading a model must not
    move the sequence a caller seeded."""
    monkeypatch.setattr(prepack, "_CHOICES", {})
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    way, min_rows = prepack.choose([torch.ones(16, 8)], WAYS)
    assert way in ("linear", *WAYS) and min_rows in (1, prepack.PACKED_MIN_ROWS)
    assert torch.equal(torch.rand(3), want)
