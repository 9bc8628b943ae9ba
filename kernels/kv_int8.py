"""The int8 KV pool (`--kv-cache-dtype int8`): keys and values stored as int8 with one fp32
scale per (slot, KV head), in a tensor of its own beside the data.

Layout: `data` (..., num_slots, Hkv, D) int8 and `scale` (..., num_slots, Hkv) fp32; a head's
D values x are stored as q = round-half-even(x / s) with s = max |x| / 127 (symmetric, so
q is in [-127, 127]; an all-zero head has s = 0 and reads back as zeros), and read back as
q * s. That is llama.cpp's q8_0 with the block a whole head (64 or 128 values) instead of 32:
a token costs 2 x layers x Hkv x (D + 4) bytes, 0.52 of a bf16 pool's at D = 128.

`quantize` / `dequantize` are the spec the native kernels (kernels/cpu/native.c, kv_type 3)
are tested against: they store with the same arithmetic, bit for bit, and read int8 * scale
in registers, never a dequantized copy of the pool. The torch paths (the reference ops, the
CPU fallbacks) index an `Int8KV` like a pool tensor: `pool[slots]`, `pool[a:b]` and
`pool.index_select(0, index)` return the indexed rows dequantized to fp32 (a working copy of
those rows only, as a bf16 pool's rows are widened by `.float()`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

QMAX = 127.0
SCALE_BYTES = 4  # one fp32 scale per (slot, KV head)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> (int8 (..., D), fp32 scale (...)): s = max |x| / 127 per row, q =
    round(x / s) (0 where s is 0)."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / QMAX  # (...,)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.where(scale[..., None] > 0, x / safe[..., None], torch.zeros_like(x))
    return q.round().clamp(-QMAX, QMAX).to(torch.int8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 (..., D) and scale (...) -> fp32 (..., D)."""
    return q.float() * scale[..., None]


@dataclass(frozen=True)
class Int8KV:
    """One int8 pool (every layer's stacked, or one layer's): see the module docstring.
    Reads dequantize only the rows indexed; `store` quantizes rows into slots (mutates)."""

    data: torch.Tensor  # (..., num_slots, Hkv, D) int8
    scale: torch.Tensor  # (..., num_slots, Hkv) fp32

    @classmethod
    def zeros(cls, shape: tuple[int, ...], device: torch.device) -> Int8KV:
        """A zero pool: every slot reads as zeros (finite, as masked reads need)."""
        return cls(
            torch.zeros(shape, dtype=torch.int8, device=device),
            torch.zeros(shape[:-1], dtype=torch.float32, device=device),
        )

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def is_cpu(self) -> bool:
        return self.data.is_cpu

    def is_contiguous(self) -> bool:
        return self.data.is_contiguous() and self.scale.is_contiguous()

    def __getitem__(self, index: Any) -> torch.Tensor:
        """The indexed slots (leading dims), dequantized: fp32 (..., Hkv, D)."""
        return dequantize(self.data[index], self.scale[index])

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        assert dim == 0, f"{dim=}: pools are indexed by slot"
        return dequantize(self.data.index_select(0, index), self.scale.index_select(0, index))

    def store(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """rows (n, Hkv, D) quantized into `slots` (n,)."""
        q, scale = quantize(rows)
        self.data[slots] = q
        self.scale[slots] = scale

    def unbind(self, dim: int = 0) -> tuple[Int8KV, ...]:
        """Each layer's pool of a stacked one, as views."""
        assert dim == 0, f"{dim=}: a stacked pool unbinds by layer"
        return tuple(Int8KV(d, s) for d, s in zip(self.data.unbind(0), self.scale.unbind(0)))

    def zero_(self) -> Int8KV:
        self.data.zero_()
        self.scale.zero_()
        return self

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes


def pool_tensors(pool: torch.Tensor | Int8KV) -> tuple[torch.Tensor, ...]:
    """Every tensor a page copy of a stacked pool (layers, num_slots, ...) must move, each
    indexed by slot on dim 1: the pool itself, or an int8 pool's data and its scales. A
    tier that saves pages and loads them back moves all of them, or the int8 values come
    back under another token's scales."""
    return (pool.data, pool.scale) if isinstance(pool, Int8KV) else (pool,)


def copy_slots(pool: torch.Tensor | Int8KV, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Slots `src` of a stacked pool (layers, num_slots, ...) copied to `dst`, every layer:
    an int8 pool's scales with its data (copy-on-write pages)."""
    for tensor in pool_tensors(pool):
        tensor[:, dst] = tensor[:, src]
