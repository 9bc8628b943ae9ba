"""A step's tensors on the model's device: the plan's numpy arrays, uploaded without a sync.

On CUDA the int64 arrays of a plan (and the Triton decode layout, derived on the host from
the plan's own numpy metadata, so no device-to-host copy is needed to find shared runs) go
into one pinned host buffer and cross in one non-blocking copy. The host never waits for
it: the copy is ordered before the forward's kernels on the stream, and torch's pinned
allocator keeps the buffer until the copy is done. The one wait of a step is its result
(`sampler.sample`). On CPU the arrays are wrapped where they lie (`torch.from_numpy`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from radixflow.runtime.models.layers import CausalLM, ForwardBatch
from radixflow.runtime.protocol.plan import BatchPlan

ALIGN = 2  # int64 elements: every segment starts 16-byte aligned, as Triton specializes on it
BATCH_ARRAYS = (
    "input_ids",
    "positions",
    "out_slots",
    "extend_qo_indptr",
    "extend_kv_indptr",
    "extend_kv_indices",
    "decode_kv_indptr",
    "decode_kv_indices",
    "logit_rows",
    "hidden_rows",
)


def upload_int64(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """1-D integer arrays -> int64 tensors on `device`, in one pinned non-blocking copy on
    CUDA (views of one device buffer, each 16-byte aligned); wrapped in place on CPU."""
    if device.type == "cpu":
        return [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in arrays]
    sizes = [len(a) for a in arrays]
    starts = np.concatenate([[0], np.cumsum([-(-n // ALIGN) * ALIGN for n in sizes])])
    host = torch.empty(int(starts[-1]), dtype=torch.int64, pin_memory=True)
    staging = host.numpy()
    for array, start, size in zip(arrays, starts, sizes):
        staging[start : start + size] = array
    on_device = host.to(device, non_blocking=True)
    return [on_device[start : start + size] for start, size in zip(starts, sizes)]


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Any numpy array (a grammar bitmask) on `device`, non-blocking from pinned memory."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def supplies_decode_layout(model: CausalLM) -> bool:
    """Whether the runner derives the decode layout on the host (the Triton ops, whose
    `decode_layout` would otherwise copy device metadata back to find shared runs)."""
    return model.ops.name == "triton"


class StepInputs:
    """Builds the ForwardBatch of a plan on the model's device. With the Triton ops it also
    supplies the decode layout (shared-prefix runs), or none when `shared_prefix` is off:
    then every request reads all its keys in the split-KV kernel (the ablation)."""

    def __init__(self, model: CausalLM, shared_prefix: bool = True) -> None:
        self.device = next(model.parameters()).device
        self.shared_prefix = shared_prefix
        self.host_layout = supplies_decode_layout(model)
        if not shared_prefix and not self.host_layout:
            raise ValueError(
                "shared-prefix attention can only be switched off for the Triton decode "
                f"(attention backend {model.ops.name!r} always reads shared runs once)"
            )

    def forward_batch(self, plan: BatchPlan) -> ForwardBatch:
        arrays = [getattr(plan, name) for name in BATCH_ARRAYS]
        decodes = plan.num_extend_tokens < plan.num_tokens
        layout = None
        if decodes and self.host_layout and self.shared_prefix:
            from radixflow.kernels.triton.shared_prefix_attention import (  # noqa: PLC0415 (triton)
                LAYOUT_TENSORS,
                host_decode_layout,
            )

            layout = host_decode_layout(
                torch.from_numpy(plan.decode_kv_indptr), torch.from_numpy(plan.decode_kv_indices)
            )
            arrays += [getattr(layout, name).numpy() for name in LAYOUT_TENSORS]
        tensors = upload_int64(arrays, self.device)
        batch = ForwardBatch(
            num_extend_tokens=plan.num_extend_tokens,
            **dict(zip(BATCH_ARRAYS, tensors[: len(BATCH_ARRAYS)])),
        )
        if plan.num_extend_tokens and self.host_layout:  # the grid size, without a sync
            from radixflow.kernels.triton.extend_attention import ExtendLayout  # noqa: PLC0415 (triton)

            longest = int(np.diff(plan.extend_qo_indptr).max())
            batch.layouts["extend", 0] = ExtendLayout(longest)
        if decodes and self.host_layout:  # the model derives no layout of its own then
            if layout is not None:
                fields = dict(zip(LAYOUT_TENSORS, tensors[len(BATCH_ARRAYS) :]))
                layout = type(layout)(**fields, max_group_size=layout.max_group_size)
            batch.layouts["decode", 0] = layout
        return batch
