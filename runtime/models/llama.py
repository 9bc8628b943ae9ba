"""The Llama family over a flat ragged batch: no padding, KV read and written through slots.

A step's rows are ordered extend tokens first (prefills and chunks), then one row per decoding
request. Extend rows attend through `extend_attention`, decode rows through
`decode_attention`; both read the pooled prefix via `kv_indptr` / `kv_indices`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixflow.kernels import AttentionOps


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> LlamaConfig:
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        theta = float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        num_heads = config["num_attention_heads"]
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
            max_position=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
        )


@dataclass
class ForwardBatch:
    """Tensors of one step (built by the model runner from the scheduler's plan)."""

    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    out_slots: torch.Tensor  # (T,) int64, where each row's K/V is stored
    num_extend_tokens: int  # rows [0, num_extend_tokens) are extend rows, the rest decode
    extend_qo_indptr: torch.Tensor  # (Be+1,)
    extend_kv_indptr: torch.Tensor  # (Be+1,) prefix lengths
    extend_kv_indices: torch.Tensor  # prefix slots
    decode_kv_indptr: torch.Tensor  # (Bd+1,) full lengths including the new token
    decode_kv_indices: torch.Tensor
    logit_rows: torch.Tensor  # (R,) rows whose next-token logits are wanted
    extend_layout: Any = None  # backend index layouts, derived once per forward
    decode_layout: Any = None


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,), with the rope-scaling variants Llama configs use."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type") or scaling.get("type")
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
        inv_freq = torch.where(middle, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope scaling {kind!r}")
    return inv_freq.float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, D); cos/sin (T, 1, D) in the rotate-half layout."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.input_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.post_attention_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.qkv_proj = nn.Linear(c.hidden_size, self.q_size + 2 * self.kv_size, c.attention_bias)
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, c.attention_bias)
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, c.mlp_bias)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ops: AttentionOps,
    ) -> torch.Tensor:
        c = self.config
        num_tokens = hidden.shape[0]
        x = rms_norm(hidden, self.input_norm, c.rms_norm_eps)
        qkv = self.qkv_proj(x)  # (T, q_size + 2 * kv_size)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(num_tokens, c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(k.view(num_tokens, c.num_kv_heads, c.head_dim), cos, sin)
        v = v.view(num_tokens, c.num_kv_heads, c.head_dim)
        ops.store_kv(k_cache, v_cache, batch.out_slots, k, v)
        attn = self._attention(q, k, v, batch, k_cache, v_cache, ops)  # (T, H, D)
        hidden = hidden + self.o_proj(attn.reshape(num_tokens, self.q_size))
        x = rms_norm(hidden, self.post_attention_norm, c.rms_norm_eps)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return hidden + self.down_proj(F.silu(gate) * up)

    def _attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ops: AttentionOps,
    ) -> torch.Tensor:
        scale = 1.0 / math.sqrt(self.config.head_dim)
        split = batch.num_extend_tokens
        parts = []
        if split > 0:
            kw = {"layout": batch.extend_layout} if batch.extend_layout is not None else {}
            parts.append(
                ops.extend_attention(
                    q[:split],
                    k[:split],
                    v[:split],
                    k_cache,
                    v_cache,
                    batch.extend_qo_indptr,
                    batch.extend_kv_indptr,
                    batch.extend_kv_indices,
                    scale,
                    **kw,
                )
            )
        if split < q.shape[0]:
            kw = {"layout": batch.decode_layout} if batch.decode_layout is not None else {}
            parts.append(
                ops.decode_attention(
                    q[split:],
                    k_cache,
                    v_cache,
                    batch.decode_kv_indptr,
                    batch.decode_kv_indices,
                    scale,
                    **kw,
                )
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig, ops: AttentionOps) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaLayer(config) for _ in range(config.num_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, k_caches: torch.Tensor, v_caches: torch.Tensor
    ) -> torch.Tensor:
        """Run the batch, store its K/V, return logits (R, vocab) of `batch.logit_rows`.

        k_caches/v_caches: (num_layers, num_slots, num_kv_heads, head_dim).
        """
        ops = self.ops
        if ops.prepare_extend is not None and batch.num_extend_tokens:
            batch.extend_layout = ops.prepare_extend(
                batch.extend_qo_indptr, batch.extend_kv_indptr, batch.extend_kv_indices
            )
        if ops.prepare_decode is not None and batch.num_extend_tokens < len(batch.input_ids):
            batch.decode_layout = ops.prepare_decode(
                batch.decode_kv_indptr, batch.decode_kv_indices
            )
        hidden = self.embed_tokens(batch.input_ids)  # (T, hidden)
        freqs = batch.positions[:, None].float() * self.inv_freq[None, :]  # (T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (T, 1, D)
        cos, sin = emb.cos().to(hidden.dtype), emb.sin().to(hidden.dtype)
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, cos, sin, batch, k_caches[i], v_caches[i], self.ops)
        hidden = hidden[batch.logit_rows]
        hidden = rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face Llama weights, fusing q/k/v and gate/up projections."""
        own = dict(self.named_parameters())
        loaded: set[str] = set()

        def put(name: str, value: torch.Tensor) -> None:
            target = own[name]
            if target.shape != value.shape:
                raise ValueError(f"weight {name}: shape {tuple(value.shape)} != {target.shape}")
            target.data.copy_(value)
            loaded.add(name)

        put("embed_tokens.weight", state["model.embed_tokens.weight"])
        put("norm", state["model.norm.weight"])
        if self.lm_head is not None:
            put("lm_head.weight", state["lm_head.weight"])
        for i in range(self.config.num_layers):
            p = f"model.layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            put(f"layers.{i}.input_norm", state[p + "input_layernorm.weight"])
            put(f"layers.{i}.post_attention_norm", state[p + "post_attention_layernorm.weight"])
            for kind in ("weight", "bias"):
                names = [f"{attn}{x}_proj.{kind}" for x in "qkv"]
                if names[0] in state:
                    put(f"layers.{i}.qkv_proj.{kind}", torch.cat([state[n] for n in names]))
                if f"{attn}o_proj.{kind}" in state:
                    put(f"layers.{i}.o_proj.{kind}", state[f"{attn}o_proj.{kind}"])
                names = [f"{mlp}gate_proj.{kind}", f"{mlp}up_proj.{kind}"]
                if names[0] in state:
                    put(f"layers.{i}.gate_up_proj.{kind}", torch.cat([state[n] for n in names]))
                if f"{mlp}down_proj.{kind}" in state:
                    put(f"layers.{i}.down_proj.{kind}", state[f"{mlp}down_proj.{kind}"])
        missing = sorted(set(own) - loaded)
        if missing:
            raise ValueError(f"weights missing from checkpoint: {missing[:5]}")
