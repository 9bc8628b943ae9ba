"""Quantized weights kept in their GGUF block layout, and the torch reference for multiplying
from them: the spec the native kernels (kernels/cpu/quant.c) are tested against.

Why: dequantizing a GGUF model to fp32 at load makes a 4-bit model 8x bigger in memory, and
decode, which reads every weight once a token, that much slower. A `QuantWeight` keeps the
file's blocks; `dequantize` here gives the exact fp32 bits of gguf's numpy dequantize (the
same products in the same order), so a model built from `QuantWeight`s and one dequantized by
the loader agree.

Integer codes are ggml's `GGMLQuantizationType`, plus two of ours: `I8` (int8 per output
channel, an fp32 scale per row) and `Q4G128` (AWQ/GPTQ 4-bit groups of 128: f32 d, f32 m,
64 bytes of nibbles laid out as Q4_1's, w = d * q + m), and `Q4_1R`: Q4_1's values with a
row's blocks split into its fp16 d's, its fp16 m's, then its 16-byte nibble groups (the same
20 bytes a block; `repack` makes it, `unpack` undoes it). The native one-row kernel reads it
1.1x faster than Q4_1 (16 scales converted at once, nibble loads not straddling blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch
import torch.nn.functional as F

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
I8, Q4G128, Q4_1R, Q8_0R = 1000, 1001, 1002, 1003
BLOCK = {  # qtype: (weights per block, bytes per block)
    F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22),
    Q5_1: (32, 24), Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210),
    I8: (1, 1), Q4G128: (128, 72), Q4_1R: (32, 20), Q8_0R: (32, 34),
}  # fmt: skip
NAMES = {
    F32: "F32", F16: "F16", BF16: "BF16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0",
    Q5_1: "Q5_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K", I8: "I8",
    Q4G128: "Q4G128", Q4_1R: "Q4_1R", Q8_0R: "Q8_0R",
}  # fmt: skip
GGUF_QUANTIZE = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)


@dataclass(frozen=True)
class QuantWeight:
    """A linear layer's weight (N, K) = (out_features, in_features) as `data` (N, row_bytes)
    uint8, contiguous: row n holds output feature n's K // block_size blocks. `scale` (N,) fp32
    is I8's per-row scale, None for every other type."""

    qtype: int
    data: torch.Tensor
    shape: tuple[int, int]
    scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n, k = self.shape
        size, _ = BLOCK[self.qtype]
        assert k % size == 0, f"{self.name}: K={k} not a multiple of its block {size}"
        assert self.data.dtype == torch.uint8 and self.data.shape == (n, self.row_bytes), (
            f"{self.name}: data {self.data.dtype} {tuple(self.data.shape)}, want ({n}, "
            f"{self.row_bytes}) uint8"
        )
        assert (self.scale is not None) == (self.qtype == I8), f"{self.name}: scale"

    @property
    def block_size(self) -> int:
        return BLOCK[self.qtype][0]

    @property
    def type_size(self) -> int:
        return BLOCK[self.qtype][1]

    @property
    def row_bytes(self) -> int:
        return self.shape[1] // self.block_size * self.type_size

    @property
    def nbytes(self) -> int:
        scale = 0 if self.scale is None else self.scale.numel() * 4
        return self.shape[0] * self.row_bytes + scale

    @property
    def name(self) -> str:
        return NAMES[self.qtype]


def _half(b: torch.Tensor) -> torch.Tensor:
    """(..., 2) uint8 -> (..., 1) fp32 from little-endian fp16"""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, split: int) -> torch.Tensor:
    """(blocks, ..., n) bytes -> (blocks, ..., 2 n): low nibbles, then high ones, of each run
    of `split` bytes (gguf's `>> [0, 4]` reshape)."""
    q = qs.reshape(*qs.shape[:-1], -1, 1, split) >> torch.tensor([0, 4], dtype=torch.uint8).view(
        2, 1
    )
    return (q & 15).reshape(*qs.shape[:-1], -1)


def _bits(qh: torch.Tensor, count: int, width: int = 1) -> torch.Tensor:
    """(blocks, n) bytes -> (blocks, count, n): field i (`width` bits at i * width) of each"""
    shift = torch.arange(0, count * width, width, dtype=torch.uint8).view(count, 1)
    return (qh.unsqueeze(-2) >> shift) & (1 << width) - 1


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes (blocks, 12) -> six-bit scales and mins (blocks, 8) fp32"""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def _blocks(b: torch.Tensor, qtype: int) -> torch.Tensor:
    """(blocks, type_size) uint8 -> (blocks, block_size) fp32, gguf's formulas"""
    if qtype in (Q4_0, Q8_0):
        d = _half(b[:, :2])
        if qtype == Q8_0:
            return b[:, 2:].view(torch.int8).float() * d
        return d * (_nibbles(b[:, 2:], 16).to(torch.int8) - 8).float()
    if qtype == Q4_1:
        return _half(b[:, :2]) * _nibbles(b[:, 4:], 16).float() + _half(b[:, 2:4])
    if qtype in (Q5_0, Q5_1):
        at = 4 if qtype == Q5_1 else 2
        high = _bits(b[:, at : at + 4], 8).transpose(1, 2).reshape(-1, 32)  # bit j of the u32
        q = _nibbles(b[:, at + 4 :], 16) | (high << 4)
        if qtype == Q5_0:
            return _half(b[:, :2]) * (q.to(torch.int8) - 16).float()
        return _half(b[:, :2]) * q.float() + _half(b[:, 2:4])
    if qtype in (Q4_K, Q5_K):
        sc, mn = _scale_min_k4(b[:, 4:16])
        ds = (_half(b[:, :2]) * sc).unsqueeze(-1)  # (blocks, 8, 1)
        dm = (_half(b[:, 2:4]) * mn).unsqueeze(-1)
        q = _nibbles(b[:, 16:] if qtype == Q4_K else b[:, 48:], 32).view(-1, 8, 32)
        if qtype == Q5_K:
            q = q | (_bits(b[:, 16:48], 8) << 4)
        return (ds * q.float() - dm).reshape(-1, 256)
    if qtype == Q6_K:
        low = _nibbles(b[:, :128].reshape(-1, 2, 64), 64).reshape(-1, 8, 32)
        high = _bits(b[:, 128:192].reshape(-1, 2, 32), 4, 2).reshape(-1, 8, 32)
        q = ((low | (high << 4)).to(torch.int8) - 32).view(-1, 16, 16).float()
        ds = (_half(b[:, 208:]) * b[:, 192:208].view(torch.int8).float()).unsqueeze(-1)
        return (ds * q).reshape(-1, 256)
    if qtype == Q4G128:
        d, m = b[:, :4].contiguous().view(torch.float32), b[:, 4:8].contiguous().view(torch.float32)
        return d * _nibbles(b[:, 8:], 64).float() + m
    raise ValueError(f"no block formula for qtype {qtype}")


REPACKED = {Q4_1: Q4_1R, Q8_0: Q8_0R}  # a file's type -> its rearranged form
UNPACKED = {v: k for k, v in REPACKED.items()}


def repack(w: QuantWeight) -> QuantWeight:
    """A Q4_1 weight as Q4_1R (rows of [d x nb][m x nb][nibbles x nb]) or a Q8_0 one as Q8_0R
    ([d x nb][bytes x nb]): the same values, each block's parts apart in its row."""
    assert w.qtype in REPACKED, w.name
    n, k = w.shape
    size = BLOCK[w.qtype][1]
    b = w.data.view(n, k // 32, size)
    cuts = [0, 2, 4, size] if w.qtype == Q4_1 else [0, 2, size]
    data = torch.cat([b[:, :, a:z].reshape(n, -1) for a, z in zip(cuts, cuts[1:])], dim=1)
    return QuantWeight(REPACKED[w.qtype], data.contiguous(), (n, k))


def unpack(w: QuantWeight) -> QuantWeight:
    """A Q4_1R or Q8_0R weight back in its file type's blocks."""
    assert w.qtype in UNPACKED, w.name
    n, k = w.shape
    nb = k // 32
    widths = [2, 2, 16] if w.qtype == Q4_1R else [2, 32]
    parts, at = [], 0
    for width in widths:
        parts.append(w.data[:, at : at + width * nb].reshape(n, nb, width))
        at += width * nb
    blocks = torch.cat(parts, dim=2)
    return QuantWeight(UNPACKED[w.qtype], blocks.reshape(n, -1).contiguous(), (n, k))


def dequantize(w: QuantWeight) -> torch.Tensor:
    """(N, K) fp32, bit-exact with gguf.quants.dequantize for the GGUF types."""
    if w.qtype in UNPACKED:
        w = unpack(w)
    n, k = w.shape
    if w.qtype in (F32, F16, BF16):
        dtype = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}[w.qtype]
        return w.data.view(dtype).float()
    if w.qtype == I8:
        return w.scale.unsqueeze(1) * w.data.view(torch.int8).float()
    blocks = w.data.reshape(n * (k // w.block_size), w.type_size)
    return _blocks(blocks, w.qtype).reshape(n, k)


def linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) fp32 -> (M, N): F.linear with the dequantized weight."""
    return F.linear(x, dequantize(w), bias)


def embedding(ids: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """Rows `ids` (T,) of the dequantized weight -> (T, K)."""
    return dequantize(w)[ids]


def quantize(weight: torch.Tensor, qtype: int) -> QuantWeight:
    """(N, K) float -> QuantWeight: Q4_0..Q8_0 by gguf's quantizer, I8 per row (absmax / 127,
    rounded to nearest), F16, BF16 (round to nearest even). Raises ValueError for others."""
    weight = weight.detach().float().contiguous()
    n, k = weight.shape
    if qtype in GGUF_QUANTIZE:
        data = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType(qtype))
        return QuantWeight(qtype, torch.from_numpy(np.ascontiguousarray(data)), (n, k))
    if qtype in (F16, BF16):
        dtype = torch.float16 if qtype == F16 else torch.bfloat16
        return QuantWeight(qtype, weight.to(dtype).view(torch.uint8).reshape(n, 2 * k), (n, k))
    if qtype == I8:
        scale = weight.abs().amax(dim=1) / 127
        q = torch.round(weight / torch.where(scale == 0, 1, scale).unsqueeze(1))
        data = q.clamp(-127, 127).to(torch.int8).view(torch.uint8)
        return QuantWeight(I8, data, (n, k), scale)
    raise ValueError(f"quantize does not make {NAMES.get(qtype, qtype)}")


def from_groups(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int = 128
) -> QuantWeight:
    """AWQ/GPTQ 4-bit weights: q (N, K) values 0..15, scales and zeros (N, K // group) ->
    Q4G128 with d = s, m = -z * s, so d * q + m = (q - z) * s exactly where s is an fp16 (or
    bf16) value and z an integer, as those checkpoints store them (where q == z and s < 0, +0
    for -0)."""
    assert group == 128, f"Q4G128 holds groups of 128, not {group}"
    n, k = q.shape
    assert scales.shape == zeros.shape == (n, k // group), f"{scales.shape=} {zeros.shape=}"
    s = scales.float().flatten().unsqueeze(1)  # (N * K / 128, 1), unit strides
    m = -(zeros.float().flatten().unsqueeze(1) * s)
    nib = q.to(torch.uint8).reshape(-1, 2, 64)
    packed = (nib[:, 0] & 15) | ((nib[:, 1] & 15) << 4)  # byte j: element j, j + 64
    data = torch.cat([s.view(torch.uint8), m.view(torch.uint8), packed], dim=1)
    return QuantWeight(Q4G128, data.reshape(n, -1).contiguous(), (n, k))


# ---- the integer path's spec (kernels/cpu/qdot.c) ----
INT8_TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_1R, Q4_K, Q5_K, Q6_K)


def activation_block(qtype: int) -> int:
    """The block over which the integer path quantizes x against a weight of `qtype`: 256 for
    the K types (llama.cpp's Q8_K), 32 for the others (its Q8_0)."""
    return 256 if qtype in (Q4_K, Q5_K, Q6_K) else 32


def quantize_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) fp32 -> (q (M, K) int8, d (M, K // block) fp32): per block d = max|x| / 127
    and q = x * (1 / d) rounded half to even (0 where the block is all zeros)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // block, block)
    d = xb.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv.unsqueeze(-1)).to(torch.int8)
    return q.reshape(m, k), d


def linear_int8(
    x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None, block: int = 0
) -> torch.Tensor:
    """What the integer paths compute, in float64: x's 8-bit values (`quantize_activations`
    over `block`, by default `activation_block`'s; the AMX-INT8 path's is 32 for every type)
    times the dequantized weight. The native paths differ from it only by the fp32 roundings
    of their block scales and sums."""
    q, d = quantize_activations(x, block or activation_block(w.qtype))
    block = x.shape[1] // d.shape[1]
    xq = (q.double().reshape(len(q), -1, block) * d.double().unsqueeze(-1)).reshape(q.shape)
    y = xq @ dequantize(w).double().T
    return (y if bias is None else y + bias.double()).float()
