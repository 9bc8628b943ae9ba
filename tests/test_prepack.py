"""CPU fp32 weights prepacked for MKL (runtime/models/prepack.py) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from family_models import save_family
from torch import nn
from tp_ranks import ragged_logits

from radixflow.runtime.config import ServerConfig
from radixflow.runtime.model_runner import load_model
from radixflow.runtime.models import prepack

CPU = torch.device("cpu")
# This project's CI machines are x86 with torch's MKL build; elsewhere prepack must be a no-op.
HAS_MKL = prepack.available(CPU, torch.float32)


def test_prepack_is_available_on_x86_cpu_builds() -> None:
    import platform

    if platform.machine() in ("x86_64", "AMD64"):
        assert HAS_MKL
    assert not prepack.available(CPU, torch.bfloat16)


@pytest.mark.skipif(not HAS_MKL, reason="torch without MKL: nothing is packed")
@pytest.mark.parametrize("shape", [(1,), (5,), (64,), (130,), (3, 7), (0,)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(shape: tuple[int, ...], bias: bool) -> None:
    """Any number of rows (the pack was made for 64), 3-D inputs, bias: F.linear's result to
    fp32 rounding."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 40, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(*shape, 40, generator=gen)
    got = prepack.linear(x, weight, prepack.pack(weight), b)
    assert got.shape == (*shape, 96)
    torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not HAS_MKL, reason="torch without MKL: nothing is packed")
def test_agrees_rejects_a_pack_of_other_weights() -> None:
    """The pack-time check that guards against an MKL whose layout depends on the rows."""
    weight = torch.randn(32, 16)
    assert prepack.agrees(weight, prepack.pack(weight))
    assert not prepack.agrees(weight, prepack.pack(weight + 0.01))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepack")
    return {family: save_family(family, root)[0] for family in ("qwen2", "qwen3")}


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])  # tied and untied LM heads
def test_loaded_model_is_packed_and_equal_to_unpacked(checkpoints, family: str) -> None:
    packed = load_model(checkpoints[family], ServerConfig(), CPU, torch.float32)
    plain = load_model(
        checkpoints[family], ServerConfig(disable_cpu_weight_prepack=True), CPU, torch.float32
    )
    assert not any(type(m) is prepack.PackedLinear for m in plain.modules())
    assert plain.head_pack is None
    if HAS_MKL:
        assert not any(type(m) is nn.Linear for m in packed.modules())
        assert packed.head_pack is not None
    torch.testing.assert_close(ragged_logits(packed), ragged_logits(plain), rtol=1e-5, atol=1e-5)
