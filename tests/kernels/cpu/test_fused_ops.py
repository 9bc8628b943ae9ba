"""The decoder's fused elementwise ops against their reference forms (exact or to rounding)."""

from __future__ import annotations

import pytest
import torch

from radixflow.runtime.models.layers import ModelConfig
from radixflow.runtime.models.rope import Rope, apply_rope, rope_qk


def rope_tables(head_dim: int, partial: float, positions: torch.Tensor, dtype: torch.dtype):
    config = ModelConfig(
        vocab_size=8, hidden_size=4 * head_dim, intermediate_size=8, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=None, max_position=4096, tie_word_embeddings=True,
        partial_rotary_factor=partial,
    )  # fmt: skip
    return Rope(config, config.rope_theta, None)(positions, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rope_qk_equals_apply_rope_on_q_and_k(partial: float, dtype: torch.dtype) -> None:
    """One pass over the fused qkv output's q and k heads gives what two reference calls give
    (to rounding: the products are summed in another order)."""
    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, dim = 37, 6, 2, 32
    qkv = torch.randn((tokens, (heads + 2 * kv_heads) * dim), generator=gen).to(dtype)
    cos, sin = rope_tables(dim, partial, torch.randint(0, 3000, (tokens,), generator=gen), dtype)
    qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, -1, dim)  # strided, as in the layer
    fused = rope_qk(qk, cos, sin)
    q = apply_rope(qkv[:, : heads * dim].view(tokens, heads, dim), cos, sin)
    k = apply_rope(
        qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim), cos, sin
    )
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}
    torch.testing.assert_close(fused[:, :heads], q, **tol)
    torch.testing.assert_close(fused[:, heads:], k, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "scaling",
    [None, {"rope_type": "longrope", "original_max_position_embeddings": 64,
            "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}],
)  # fmt: skip
def test_host_positions_read_the_same_numbers_from_the_table(scaling, dtype) -> None:
    """Host positions take cos/sin from a table of every position (a decode step's row
    read instead of eight ops): the same bits as computing those positions alone, LongRoPE's
    long factors past its original window included, and past the table's first end, where
    it grows."""
    config = ModelConfig(
        vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=scaling, max_position=6000, tie_word_embeddings=True,
    )  # fmt: skip
    rope = Rope(config, config.rope_theta, scaling)
    for positions in ([5], [0, 63, 64, 65, 4095], [4096], [5000, 3, 5001]):
        at = torch.tensor(positions)
        cos, sin = rope(at, dtype)
        want_cos, want_sin = rope.compute(at, dtype)
        assert cos.shape == (len(positions), 1, 16) and cos.is_contiguous()
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert 5002 <= len(rope._tables[dtype][0]) <= config.max_position  # grown, within the context
    if scaling:  # the long factors apply past the original window: the rows differ
        assert not torch.equal(rope(torch.tensor([70]), dtype)[0], rope_tables_default(70, dtype))


def rope_tables_default(position: int, dtype: torch.dtype) -> torch.Tensor:
    return rope_tables(16, 1.0, torch.tensor([position]), dtype)[0]
