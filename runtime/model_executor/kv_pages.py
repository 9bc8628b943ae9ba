"""PoolPages: copies of KV pool rows as bytes, for the disk tier (runtime/cache/tiered.py).

A row is one position's keys and values of every layer, token-major so that a run of rows is
a slice, seen as uint8 (num_tokens, bytes_per_token). A float pool's row is
(2, layers, kv_heads, head_dim) in the storage dtype: the pool's, or a compact one
(--hicache-storage-dtype: float16/bfloat16, lossy for an fp32 pool). An int8 pool's row is
its tensors one after another, each as stored: the keys' int8 (layers, kv_heads, head_dim),
their fp32 scales (layers, kv_heads), then the values' two (kernels/kv_int8.py): the scales
move with their values, and the row is exact.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from radixflow.kernels.kv_int8 import Int8KV, pool_tensors
from radixflow.runtime.model_executor.model_runner import DTYPES, ModelRunner


class PoolPages:
    def __init__(self, runner: ModelRunner, storage_dtype: str = "auto") -> None:
        pools = (runner.k_caches, runner.v_caches)  # each (layers, slots, ...)
        quantized = isinstance(runner.k_caches, Int8KV)
        if quantized and storage_dtype != "auto":
            raise ValueError(
                f"--hicache-storage-dtype {storage_dtype}: an int8 KV pool is stored as it is "
                "(its int8 values and their scales); use auto"
            )
        self.dtype = runner.k_caches.dtype if storage_dtype == "auto" else DTYPES[storage_dtype]
        # every tensor a row is made of, with the dtype it is stored in
        self.parts = [t for pool in pools for t in pool_tensors(pool)]
        self.dtypes = [t.dtype if quantized else self.dtype for t in self.parts]
        self.shapes = [(t.shape[0], *t.shape[2:]) for t in self.parts]  # one slot's
        self.sizes = [math.prod(s) * d.itemsize for s, d in zip(self.shapes, self.dtypes)]
        self.bytes_per_token = sum(self.sizes)

    def read(self, slots: np.ndarray) -> np.ndarray:
        """A copy of `slots`' KV: (len(slots), bytes_per_token) uint8."""
        index = self._index(slots)
        columns = []
        for tensor, dtype in zip(self.parts, self.dtypes):
            rows = tensor[:, index].movedim(1, 0).to(dtype).contiguous().cpu()  # (n, layers, ..)
            columns.append(rows.view(torch.uint8).reshape(len(slots), -1))
        return torch.cat(columns, dim=1).numpy()

    def write(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """Store `rows` (as `read` returns them) into `slots`."""
        assert rows.shape == (len(slots), self.bytes_per_token), f"{rows.shape=}"
        data = torch.from_numpy(np.array(rows, dtype=np.uint8))  # a writable copy
        index, start = self._index(slots), 0
        for tensor, dtype, shape, size in zip(self.parts, self.dtypes, self.shapes, self.sizes):
            part = data[:, start : start + size].contiguous().view(dtype)
            part = part.reshape(len(slots), *shape).to(tensor.device, tensor.dtype)
            tensor[:, index] = part.movedim(0, 1)
            start += size

    def _index(self, slots: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.asarray(slots, dtype=np.int64)).to(self.parts[0].device)
