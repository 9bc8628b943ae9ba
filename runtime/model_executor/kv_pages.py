"""PoolPages: copies of KV pool rows as bytes, for the disk tier (runtime/cache/tiered.py).

A row is one position's keys and values of every layer, token-major so that a run of rows is
a slice: (num_tokens, 2, layers, kv_heads, head_dim) in the storage dtype, seen as uint8
(num_tokens, bytes_per_token). The storage dtype is the pool's, or a compact one
(--hicache-storage-dtype: float16/bfloat16, lossy for an fp32 pool).
"""

from __future__ import annotations

import numpy as np
import torch

from radixflow.runtime.model_executor.model_runner import DTYPES, ModelRunner


class PoolPages:
    def __init__(self, runner: ModelRunner, storage_dtype: str = "auto") -> None:
        self.k, self.v = runner.k_caches, runner.v_caches  # (layers, slots, kv_heads, head_dim)
        self.dtype = self.k.dtype if storage_dtype == "auto" else DTYPES[storage_dtype]
        layers, _, heads, dim = self.k.shape
        self.row_shape = (2, layers, heads, dim)
        self.bytes_per_token = 2 * layers * heads * dim * self.dtype.itemsize

    def read(self, slots: np.ndarray) -> np.ndarray:
        """A copy of `slots`' KV: (len(slots), bytes_per_token) uint8."""
        index = torch.from_numpy(np.asarray(slots, dtype=np.int64)).to(self.k.device)
        kv = torch.stack([self.k[:, index], self.v[:, index]])  # (2, layers, n, heads, dim)
        rows = kv.permute(2, 0, 1, 3, 4).to(self.dtype).contiguous().cpu()  # (n, 2, L, H, D)
        return rows.view(torch.uint8).reshape(len(slots), -1).numpy()

    def write(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """Store `rows` (as `read` returns them) into `slots`."""
        assert rows.shape == (len(slots), self.bytes_per_token), f"{rows.shape=}"
        data = torch.from_numpy(np.array(rows, dtype=np.uint8))  # a writable copy
        kv = data.view(self.dtype).reshape(len(slots), *self.row_shape).to(self.k.device)
        kv = kv.permute(1, 2, 0, 3, 4).to(self.k.dtype)  # (2, layers, n, heads, dim)
        index = torch.from_numpy(np.asarray(slots, dtype=np.int64)).to(self.k.device)
        self.k[:, index] = kv[0]
        self.v[:, index] = kv[1]
