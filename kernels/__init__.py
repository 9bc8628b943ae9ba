"""Attention ops with one signature for every backend, and the dispatch between them.

`get_ops(backend, device)` returns the ops object a model is built with (no global state):
  reference  `radixflow.kernels.reference`, the plain-torch spec (any device; slow)
  torch      the CPU fast path `radixflow.kernels.cpu.attention` on CPU, the reference elsewhere
             (the fast path calls torch's fused CPU attention kernel)
  triton     the Triton kernels (`decode_attention`, `extend_attention`)
  auto       Triton on CUDA, the CPU fast path on CPU, the reference elsewhere
`ServerConfig.attention_backend` chooses among them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from radixflow.kernels import reference
from radixflow.kernels.cpu import attention as cpu_attention


@dataclass(frozen=True)
class AttentionOps:
    """One backend's ops. `prepare_extend(qo_indptr, kv_indptr, kv_indices, new_slots=)`
    (new_slots: where the layers store the new tokens' K/V before attending) and
    `prepare_decode(kv_indptr, kv_indices)`, when set, derive per-forward index layouts once;
    the result is passed to every layer's call as `layout=`. `rope_decode_attention`, when
    set, does a decode-only step's rope, KV store and attention in one call (or returns None,
    having touched nothing, and the layer does them one by one)."""

    name: str
    extend_attention: Callable[..., torch.Tensor]
    decode_attention: Callable[..., torch.Tensor]
    store_kv: Callable[..., None]
    prepare_extend: Callable[..., Any] | None = None
    prepare_decode: Callable[..., Any] | None = None
    rope_decode_attention: Callable[..., torch.Tensor | None] | None = None


REFERENCE_OPS = AttentionOps(
    "reference", reference.extend_attention, reference.decode_attention, reference.store_kv
)

CPU_OPS = AttentionOps(
    "torch",
    cpu_attention.extend_attention,
    cpu_attention.decode_attention,
    cpu_attention.store_kv,
    cpu_attention.make_layout,
    cpu_attention.decode_layout,
    cpu_attention.rope_decode_attention,
)


def triton_ops() -> AttentionOps:
    """The Triton kernels (imported lazily: triton is optional on CPU machines). Decode
    reads KV runs shared by several requests once per group (`decode_layout`)."""
    from radixflow.kernels.triton.decode_attention import (  # noqa: PLC0415 (triton)
        decode_attention,
        decode_layout,
    )
    from radixflow.kernels.triton.extend_attention import extend_attention  # noqa: PLC0415 (triton)

    return AttentionOps(
        "triton", extend_attention, decode_attention, reference.store_kv, None, decode_layout
    )


def get_ops(backend: str, device: torch.device) -> AttentionOps:
    """The ops of `backend` (see the module docstring) for tensors on `device`."""
    if backend not in ("reference", "torch", "triton", "auto"):
        raise ValueError(f"unknown attention backend {backend!r}")
    if backend == "triton" or (backend == "auto" and device.type == "cuda"):
        return triton_ops()
    if backend != "reference" and device.type == "cpu":
        return CPU_OPS
    return REFERENCE_OPS
