"""Attention ops with one signature for two backends.

`radixflow.kernels.extend_attention` / `decode_attention` / `store_kv` run the Triton kernels
for CUDA tensors and the torch reference (`radixflow.kernels.reference`) otherwise:
`get_ops(backend, device)` returns the ops object a model is built with (no global state);
`backend="torch"` or `"triton"` forces either (ServerConfig.attention_backend).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from radixflow.kernels import reference


@dataclass(frozen=True)
class AttentionOps:
    """One backend's ops. `prepare_extend(qo_indptr, kv_indptr, kv_indices)` and
    `prepare_decode(kv_indptr, kv_indices)`, when set, derive per-forward index layouts once;
    the result is passed to every layer's call as `layout=`."""

    name: str
    extend_attention: Callable[..., torch.Tensor]
    decode_attention: Callable[..., torch.Tensor]
    store_kv: Callable[..., None]
    prepare_extend: Callable[..., Any] | None = None
    prepare_decode: Callable[..., Any] | None = None


REFERENCE_OPS = AttentionOps(
    "torch",
    reference.extend_attention,
    reference.decode_attention,
    reference.store_kv,
    reference.make_layout,
    reference.decode_layout,
)


def triton_ops() -> AttentionOps:
    """The Triton kernels (imported lazily: triton is optional on CPU machines)."""
    from radixflow.kernels.decode_attention import decode_attention
    from radixflow.kernels.extend_attention import extend_attention

    return AttentionOps("triton", extend_attention, decode_attention, reference.store_kv)


def get_ops(backend: str, device: torch.device) -> AttentionOps:
    """`auto` picks Triton on CUDA and the torch reference elsewhere."""
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return REFERENCE_OPS
    if backend in ("triton", "auto"):
        return triton_ops()
    raise ValueError(f"unknown attention backend {backend!r}")
