"""Sliding windows and soft-capped scores: the CPU fast path (layouts, length groups,
shared-prefix runs) against the plain reference, with windows shorter and longer than a
shared run, and a brute-force check of which keys a windowed query sees."""

from __future__ import annotations

import pytest
import torch

from radixflow.kernels import reference
from radixflow.kernels.cpu import attention as cpu_attention

H, HKV, D = 4, 2, 16


def _setup(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    k_buffer = torch.randn(400, HKV, D, generator=g)
    v_buffer = torch.randn(400, HKV, D, generator=g)
    # three requests behind one 80-slot prefix (a shared run), one on its own
    shared = torch.arange(1, 81)
    own = [torch.arange(100 + 30 * b, 100 + 30 * b + n) for b, n in enumerate((7, 20, 3))]
    prefixes = [torch.cat([shared, own[0]]), torch.cat([shared, own[1]]), shared, own[2]]
    return k_buffer, v_buffer, prefixes


def _indptr(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])


@pytest.mark.parametrize("logit_cap", [0.0, 3.0])
@pytest.mark.parametrize("window", [0, 1, 5, 70, 200])
def test_decode_window_and_cap_match_reference(window, logit_cap):
    k_buffer, v_buffer, prefixes = _setup(0)
    q = torch.randn(len(prefixes), H, D, generator=torch.Generator().manual_seed(1))
    kv_indptr, kv_indices = _indptr([len(p) for p in prefixes]), torch.cat(prefixes)
    kw = {"sliding_window": window, "logit_cap": logit_cap}
    want = reference.decode_attention(q, k_buffer, v_buffer, kv_indptr, kv_indices, 0.3, **kw)
    layout = cpu_attention.decode_layout(kv_indptr, kv_indices, window)
    assert bool(layout.shared) == (window == 0 or window > 81)  # runs of >= 64 kept keys
    got = cpu_attention.decode_attention(
        q, k_buffer, v_buffer, kv_indptr, kv_indices, 0.3, layout=layout, **kw
    )
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("logit_cap", [0.0, 3.0])
@pytest.mark.parametrize("window", [0, 1, 5, 70])
def test_extend_window_and_cap_match_reference(window, logit_cap):
    k_buffer, v_buffer, prefixes = _setup(2)
    extend_lens = [9, 1, 20, 12]
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(extend_lens), H, D, generator=g)
    k_new, v_new = torch.randn(2, sum(extend_lens), HKV, D, generator=g)
    args = (k_buffer, v_buffer, _indptr(extend_lens), _indptr([len(p) for p in prefixes]))
    args += (torch.cat(prefixes), 0.3)
    kw = {"sliding_window": window, "logit_cap": logit_cap}
    want = reference.extend_attention(q, k_new, v_new, *args, **kw)
    layout = cpu_attention.make_layout(*args[2:5], window)
    got = cpu_attention.extend_attention(q, k_new, v_new, *args, layout=layout, **kw)
    assert (got - want).abs().max().item() < 1e-5


def test_reference_window_sees_exactly_the_last_keys():
    """Query i of a request with prefix P sees keys j with P + i - W < j <= P + i: changing
    any other key leaves its output alone, changing one of those changes it."""
    window, prefix_len, extend_len = 4, 6, 5
    g = torch.Generator().manual_seed(4)
    k_buffer, v_buffer = torch.randn(2, 20, 1, 8, generator=g)
    q = torch.randn(extend_len, 1, 8, generator=g)
    k_new, v_new = torch.randn(2, extend_len, 1, 8, generator=g)
    meta = (torch.tensor([0, extend_len]), torch.tensor([0, prefix_len]), torch.arange(1, 7))

    def run(v_pool: torch.Tensor, v_ext: torch.Tensor) -> torch.Tensor:
        return reference.extend_attention(
            q, k_new, v_ext, k_buffer, v_pool, *meta, 1.0, sliding_window=window
        )

    base = run(v_buffer, v_new)
    for key in range(prefix_len + extend_len):  # key position
        v_pool, v_ext = v_buffer.clone(), v_new.clone()
        if key < prefix_len:
            v_pool[1 + key] += 1.0
        else:
            v_ext[key - prefix_len] += 1.0
        changed = (run(v_pool, v_ext) - base).abs().amax((1, 2)) > 0  # (E,)
        seen = [prefix_len + i - window < key <= prefix_len + i for i in range(extend_len)]
        assert changed.tolist() == seen, key
