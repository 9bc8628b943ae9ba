"""Rotary position embeddings: the tables (default, linear, Llama 3 and LongRoPE scaling, as
transformers computes them) and their application to queries and keys."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from radixflow.kernels.cpu import native

ROPE_TYPES = ("default", "linear", "llama3", "longrope")
TABLE_POSITIONS = 4096  # positions a host table covers when first built (Rope.forward)


def rope_inv_freq(
    theta: float, scaling: dict[str, Any] | None, dim: int, max_position: int
) -> tuple[torch.Tensor, torch.Tensor | None, int, float]:
    """-> (inv_freq (dim/2,), long_inv_freq or None, original_max_position, cos/sin scale),
    as transformers computes them (fp32), for the rope types in ROPE_TYPES."""
    # on the CPU even under a meta-device build (a quantized load builds the model there):
    # the tables are real numbers, and a meta `div` imports torch._dynamo (0.9 s)
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (theta**exponent)
    scaling = scaling or {}
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        middle = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(middle, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    elif kind == "longrope":
        original = int(scaling["original_max_position_embeddings"])
        factor = scaling.get("factor") or max_position / original
        attention = scaling.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        short, long = (
            torch.tensor(scaling[k], dtype=torch.float32, device="cpu")
            for k in ("short_factor", "long_factor")
        )
        return 1.0 / (short * theta**exponent), 1.0 / (long * theta**exponent), original, attention
    elif kind != "default":
        raise ValueError(f"unsupported rope type {kind!r}; supported: {ROPE_TYPES}")
    return inv_freq, None, 0, 1.0


class Rope(nn.Module):
    """Rotary tables of one layer kind. LongRoPE picks the long factors for positions at or
    past `original_max_position`, per position: transformers picks by sequence length per
    call, which is the same token for token when the prompt fits the original window."""

    def __init__(self, config: Any, theta: float, scaling: dict[str, Any] | None) -> None:
        """`config`: a ModelConfig (its head_dim, partial_rotary_factor, max_position)."""
        super().__init__()
        dim = int(config.head_dim * config.partial_rotary_factor)
        inv_freq, long_inv_freq, original, scale = rope_inv_freq(
            theta, scaling, dim, config.max_position
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("long_inv_freq", long_inv_freq, persistent=False)
        self.original_max_position, self.scale = original, scale
        # mrope: which position axis (t, h, w) each frequency reads (Qwen2.5-VL); None: 1-D
        section = tuple(getattr(config, "mrope_section", ()) or ())
        axes = [i % 3 for i, n in enumerate(section) for _ in range(n)]
        assert not section or len(axes) == len(inv_freq), f"{section=} {len(inv_freq)=}"
        self.mrope_axes = torch.tensor(axes, dtype=torch.int64) if section else None
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # host cos, sin
        self.max_position = config.max_position

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions (T,), or (3, T) with mrope -> cos, sin (T, 1, rotary_dim) in the
        rotate-half layout. Host positions read rows of a table of every position so far (the
        same numbers, element by element: a decode step's eight ops took 90 us)."""
        if positions.dim() == 2:
            return self.mrope(positions, dtype)
        if (
            positions.device.type != "cpu"
            or self.inv_freq.device.type != "cpu"
            or not len(positions)
        ):
            return self.compute(positions, dtype)
        cos, sin = self._host_table(int(positions.max()) + 1, dtype)
        return cos[positions], sin[positions]

    def _host_table(self, needed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (N, 1, rotary_dim) of positions 0 .. N-1, N >= needed: built at first use
        for TABLE_POSITIONS, doubled (up to the model's context) as positions pass its end."""
        table = self._tables.get(dtype)
        if table is None or len(table[0]) < needed:
            grown = max(TABLE_POSITIONS, 2 * len(table[0]) if table else 0)
            size = max(needed, min(grown, self.max_position))
            positions = torch.arange(size, device=self.inv_freq.device)
            table = self._tables[dtype] = self.compute(positions, dtype)
        return table

    def compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """forward's cos, sin for 1-D positions, computed for these positions alone."""
        inv_freq = self.inv_freq[None, :]  # (1, rotary_dim/2)
        if self.long_inv_freq is not None:
            is_long = (positions >= self.original_max_position)[:, None]
            inv_freq = torch.where(is_long, self.long_inv_freq[None, :], inv_freq)
        freqs = positions[:, None].float() * inv_freq  # (T, rotary_dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (T, 1, rotary_dim)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)

    def mrope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions (3, T) -> cos, sin (T, 1, rotary_dim): frequency j rotates by the position
        on axis `mrope_axes[j]` (transformers' mrope_section split); a 1-D table when equal."""
        assert self.mrope_axes is not None, "(3, T) positions given to a model without mrope"
        freqs = positions[:, :, None].float() * self.inv_freq  # (3, T, rotary_dim/2)
        axes = self.mrope_axes.to(positions.device)[None, :].expand(positions.shape[1], -1)
        freqs = freqs.gather(0, axes[None]).squeeze(0)  # (T, rotary_dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (T, 1, rotary_dim)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, D); cos/sin (T, 1, R) rotate the first R dims (partial rotary: R < D).
    The reference form (rotate-half spelled out); `rope_qk` computes the same in fewer passes."""
    rotary = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary], x[..., rotary:]
    half = rotary // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = x_rot * cos + rotated * sin
    return out if x_pass.shape[-1] == 0 else torch.cat((out, x_pass), dim=-1)


def rope_qk(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope` of q and k heads at once: qk (T, H + Hkv, D), a strided view of the fused
    qkv output. Each half is written straight into the result (x1·cos - x2·sin, then
    x2·cos + x1·sin), with no concatenated rotate-half copy: 2.2x faster than two calls at
    64 decode rows (SmolLM2 shapes, 1 thread). Assumes cos/sin repeat their two halves, as
    `Rope` builds them. One native pass where the kernels are built (kernels/cpu/native.py);
    `DecoderLayer._attention` calls that pass with the KV store folded in first."""
    fused = native.rope(qk, cos, sin)
    if fused is not None:
        return fused
    rotary, (t, heads, dim) = cos.shape[-1], qk.shape
    half = rotary // 2
    c, s_ = cos[..., :half], sin[..., :half]
    out = torch.empty((t, heads, dim), dtype=qk.dtype, device=qk.device)
    x1, x2 = qk[..., :half], qk[..., half:rotary]
    o1, o2 = out[..., :half], out[..., half:rotary]
    torch.mul(x1, c, out=o1)
    o1.sub_(x2 * s_)
    torch.mul(x2, c, out=o2)
    o2.addcmul_(x1, s_)
    if rotary < dim:
        out[..., rotary:] = qk[..., rotary:]
    return out
