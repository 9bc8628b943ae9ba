"""The decoder every supported family is built from, over a flat ragged batch.

A step's rows are ordered extend tokens first (prefills and chunks), then one row per decoding
request. Extend rows attend through `ops.extend_attention`, decode rows through
`ops.decode_attention`; both read the pooled prefix via `kv_indptr` / `kv_indices`.

The families differ only in what `ModelConfig` switches on (see `models/__init__.py`):
q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3, Gemma 3), sliding windows per layer
(Mistral, Qwen2/3, Phi-3, Gemma), partial rotary and LongRoPE (Phi-3), the (1 + w) RMSNorm,
scaled embeddings, sandwich norms, GELU, query pre-attention scaling and logit soft-capping
(Gemma 2/3). Attention itself is always the shared ops of `radixflow.kernels`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixflow.kernels import AttentionOps
from radixflow.kernels.cpu import native
from radixflow.kernels.cpu.decode_loop import DecodeLoop
from radixflow.runtime.models import UnsupportedModelError, prepack
from radixflow.runtime.models.lora import LoraBatch
from radixflow.runtime.models.rope import ROPE_TYPES, Rope, apply_rope, rope_qk
from radixflow.runtime.models.weights import load_weights

ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


@dataclass(frozen=True)
class ModelConfig:
    """What the decoder needs to know, read once from a Hugging Face config."""

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
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before rope
    norm_offset: float = 0.0  # Gemma's RMSNorm scales by (1 + w)
    sandwich_norm: bool = False  # Gemma: norms after attention and around the MLP
    activation: str = "silu"
    embed_scale: float = 1.0
    attn_scale: float = 0.0  # 0: 1 / sqrt(head_dim)
    attn_logit_cap: float = 0.0  # 0: no soft-capping of attention scores
    final_logit_cap: float = 0.0
    partial_rotary_factor: float = 1.0
    layer_windows: tuple[int, ...] = ()  # per layer; 0 (or empty) = global attention
    # (rope_theta, rope_scaling) of sliding-window layers when they differ (Gemma 3)
    sliding_rope: tuple[float, dict[str, Any] | None] | None = None
    architecture: str = "LlamaForCausalLM"
    # checkpoint name prefixes: {saved prefix: ours} renamed, and prefixes of weights of
    # another modality the text model does not use (skipped, and logged)
    renamed_prefixes: tuple[tuple[str, str], ...] = ()
    skipped_prefixes: tuple[str, ...] = ()
    # multimodal rope (Qwen2.5-VL): rotary frequencies per position axis (t, h, w); empty: off
    mrope_section: tuple[int, ...] = ()

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    @classmethod
    def from_hf(
        cls,
        hf: Any,
        architecture: str,
        rope_parameters: dict[str, Any] | None = None,
        **changes: Any,
    ) -> ModelConfig:
        """The fields every family reads the same way from a transformers config object;
        `changes` are the family's own; `rope_parameters` replaces the config's (Gemma 3
        keeps one entry per layer kind). Raises UnsupportedModelError on options we lack."""
        theta, scaling, partial = split_rope(rope_parameters or hf.rope_parameters)
        heads = hf.num_attention_heads
        activation = getattr(hf, "hidden_activation", None) or hf.hidden_act
        if activation not in ACTIVATIONS:
            raise UnsupportedModelError(f"activation {activation!r} is not supported")
        fields = dict(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            rms_norm_eps=float(hf.rms_norm_eps),
            rope_theta=theta,
            rope_scaling=scaling,
            partial_rotary_factor=partial,
            max_position=int(hf.max_position_embeddings),
            tie_word_embeddings=bool(hf.tie_word_embeddings),
            activation=activation,
            layer_windows=layer_windows(hf),
            architecture=architecture,
        )
        return cls(**{**fields, **changes})


def split_rope(params: dict[str, Any] | None) -> tuple[float, dict[str, Any] | None, float]:
    """transformers' `rope_parameters` -> (theta, scaling or None for plain rope, partial
    rotary factor). Raises UnsupportedModelError for rope types we do not implement."""
    params = dict(params or {})
    theta = float(params.pop("rope_theta", 10000.0))
    partial = float(params.pop("partial_rotary_factor", 1.0))
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise UnsupportedModelError(f"rope type {kind!r} is not supported; supported: {ROPE_TYPES}")
    return theta, (params if kind != "default" else None), partial


def layer_windows(hf: Any) -> tuple[int, ...]:
    """Per layer sliding window (0 = global): `layer_types` where the config has them (Qwen2/3
    with use_sliding_window, Gemma), else the one window on every layer (Mistral, Phi-3)."""
    window = int(getattr(hf, "sliding_window", None) or 0)
    types = getattr(hf, "layer_types", None)
    if not window:
        return ()
    if types is None:
        return (window,) * hf.num_hidden_layers
    return tuple(window if kind == "sliding_attention" else 0 for kind in types)


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
    # (H,) rows whose final hidden state (after the final norm) is wanted: embeddings
    hidden_rows: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None  # (H, hidden) fp32, set by the forward
    # backend index layouts, derived once per forward: {("extend" | "decode", window): layout}
    layouts: dict[tuple[str, int], Any] = field(default_factory=dict)
    lora: LoraBatch | None = None  # the rows under LoRA adapters, by adapter (models/lora.py)
    # images (models/qwen2_5_vl.py): (3, T) mrope positions, and embeddings replacing the
    # token embeddings of rows `embed_rows` (K,) with `embeds` (K, hidden)
    mrope_positions: torch.Tensor | None = None
    embed_rows: torch.Tensor | None = None
    embeds: torch.Tensor | None = None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> torch.Tensor:
    """RMSNorm over the last dim; `offset` 1 is Gemma's (1 + w), scaled in fp32 as there."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (normed * (offset + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float = 0.0,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, rms_norm(h)) for h = x + residual (x alone when residual is None): one native
    pass over fp32 rows where the kernels are built (kernels/cpu/native.py), else `rms_norm`."""
    if not offset:
        fused = native.rms_norm(x, weight, eps, residual)
        if fused is not None:
            return fused
    hidden = x if residual is None else x + residual
    return hidden, rms_norm(hidden, weight, eps, offset)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        c = config
        self.config, self.window, self.index = c, c.window(layer), layer
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.input_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.post_attention_norm = nn.Parameter(torch.ones(c.hidden_size))
        if c.sandwich_norm:
            self.pre_feedforward_norm = nn.Parameter(torch.ones(c.hidden_size))
            self.post_feedforward_norm = nn.Parameter(torch.ones(c.hidden_size))
        if c.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(c.head_dim))
            self.k_norm = nn.Parameter(torch.ones(c.head_dim))
        self.qkv_proj = nn.Linear(c.hidden_size, self.q_size + 2 * self.kv_size, c.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, c.o_bias)
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, c.mlp_bias)
        self.act = ACTIVATIONS[c.activation]

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ops: AttentionOps,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's input is hidden + residual (hidden alone when residual is None); so is
        its output (mlp, hidden): the last residual add is left to the next norm, which does
        it in the same pass (`add_rms_norm`)."""
        c = self.config
        eps, offset = c.rms_norm_eps, c.norm_offset
        hidden, x = add_rms_norm(hidden, self.input_norm, eps, offset, residual=residual)
        attn = self._attention(x, rope, batch, k_cache, v_cache, ops)
        attn = self._project("o_proj", attn, batch)
        if c.sandwich_norm:
            attn = rms_norm(attn, self.post_attention_norm, eps, offset)
            hidden, x = add_rms_norm(attn, self.pre_feedforward_norm, eps, offset, residual=hidden)
            return rms_norm(self._mlp(x, batch), self.post_feedforward_norm, eps, offset), hidden
        hidden, x = add_rms_norm(attn, self.post_attention_norm, eps, offset, residual=hidden)
        return self._mlp(x, batch), hidden

    def _project(self, name: str, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The projection `name` of x, plus the LoRA deltas of the batch's adapter rows."""
        out = getattr(self, name)(x)
        if batch.lora is not None:
            batch.lora.add(self.index, name, x, out)
        return out

    def _mlp(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        gate_up = self._project("gate_up_proj", x, batch)
        fused = native.silu_mul(gate_up) if self.act is F.silu else None
        if fused is not None:
            return self._project("down_proj", fused, batch)
        gate, up = gate_up.chunk(2, dim=-1)
        return self._project("down_proj", self.act(gate) * up, batch)

    def _attention(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ops: AttentionOps,
    ) -> torch.Tensor:
        """-> (T, q_size). Stores this step's K/V, then attends through the shared ops."""
        c, num_tokens = self.config, x.shape[0]
        qkv, stored = self._project("qkv_proj", x, batch), None
        scale = c.attn_scale or 1.0 / math.sqrt(c.head_dim)
        if not (batch.num_extend_tokens or c.qk_norm) and ops.rope_decode_attention is not None:
            fused = ops.rope_decode_attention(
                qkv, c.num_heads, *rope, k_cache, v_cache, batch.out_slots, scale,
                batch.layouts.get(("decode", self.window)), c.attn_logit_cap,
            )  # fmt: skip
            if fused is not None:  # decode only: one call, no intermediate tensors
                return fused.view(num_tokens, self.q_size)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = rms_norm(
                q.view(num_tokens, c.num_heads, c.head_dim),
                self.q_norm,
                c.rms_norm_eps,
                c.norm_offset,
            )
            k = rms_norm(
                k.view(num_tokens, c.num_kv_heads, c.head_dim),
                self.k_norm,
                c.rms_norm_eps,
                c.norm_offset,
            )
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        else:  # q and k are adjacent in the fused output: one rotation pass over both
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, c.head_dim)
            # the native pass also stores the rotated keys and v in the pools (store_kv's
            # semantics on every backend), one call and one pass over k fewer per layer
            stored = native.rope(qk, *rope, store=(k_cache, v_cache, batch.out_slots, v))
            qk = rope_qk(qk, *rope) if stored is None else stored
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]  # (T, H, D), (T, Hkv, D)
        if stored is None:
            ops.store_kv(k_cache, v_cache, batch.out_slots, k, v)
        # Only switched-on features are passed, so plain Llama calls the ops exactly as before.
        extra: dict[str, Any] = {}
        if self.window:
            extra["sliding_window"] = self.window
        if c.attn_logit_cap:
            extra["logit_cap"] = c.attn_logit_cap
        split, parts = batch.num_extend_tokens, []
        if split > 0:
            layout = batch.layouts.get(("extend", self.window))
            kw = {**extra, "layout": layout} if layout is not None else extra
            parts.append(
                ops.extend_attention(
                    q[:split], k[:split], v[:split], k_cache, v_cache,
                    batch.extend_qo_indptr, batch.extend_kv_indptr, batch.extend_kv_indices,
                    scale, **kw,
                )
            )  # fmt: skip
        if split < num_tokens:
            layout = batch.layouts.get(("decode", self.window))
            kw = {**extra, "layout": layout} if layout is not None else extra
            parts.append(
                ops.decode_attention(
                    q[split:], k_cache, v_cache, batch.decode_kv_indptr, batch.decode_kv_indices,
                    scale, **kw,
                )
            )  # fmt: skip
        attn = parts[0] if len(parts) == 1 else torch.cat(parts)  # (T, H, D)
        return attn.reshape(num_tokens, self.q_size)


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head of any supported family."""

    stores_kv = True  # the runner allocates its KV cache (an Encoder's is empty)

    def __init__(self, config: ModelConfig, ops: AttentionOps) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        # on the meta device (a quantized load's build) no random init: Embedding's normal_
        # there imported torch._dynamo, 0.6-0.9 s of the start; a real build draws it
        empty = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=empty if empty.is_meta else None
        )
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope = Rope(config, config.rope_theta, config.rope_scaling)
        self.sliding_rope = Rope(config, *config.sliding_rope) if config.sliding_rope else None
        # tensor parallel: (R, vocabulary shard) -> (R, vocab) logits (models/sharding.py)
        self.gather_logits: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.head_pack: prepack.Packed | None = None  # the LM head's packed copy (prepack.py)
        self.quant_head: nn.Module | None = None  # a head in quantized blocks (quantized.py)
        # CPU: decode-only steps' layers in one compiled call (kernels/cpu/decode_loop.py), set at
        # load where the model qualifies; the layer loop below is its reference
        self.decode_loop: DecodeLoop | None = None
        self._windows: list[int] | None = None  # _prepare_layouts'

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        k_caches: torch.Tensor | Sequence[torch.Tensor],
        v_caches: torch.Tensor | Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """Run the batch, store its K/V, return fp32 logits (R, vocab) of `batch.logit_rows`;
        with `batch.hidden_rows`, also set `batch.hidden_states` (H, hidden) fp32: those rows
        after the final norm (the LM head's input).

        k_caches/v_caches: (num_layers, num_slots, num_kv_heads, head_dim), or the layers'
        pools (num_slots, num_kv_heads, head_dim) in a sequence (views of one, made once).
        """
        self._prepare_layouts(batch)
        hidden = self.embed_tokens(batch.input_ids)  # (T, hidden)
        if self.config.embed_scale != 1.0:
            hidden = hidden * torch.tensor(self.config.embed_scale, dtype=hidden.dtype)
        if batch.embeds is not None:  # an image's rows: its vision embeddings
            hidden = hidden.index_copy(0, batch.embed_rows, batch.embeds.to(hidden.dtype))
        positions = batch.positions if batch.mrope_positions is None else batch.mrope_positions
        rope = self.rope(positions, hidden.dtype)
        local_rope = self.sliding_rope(batch.positions, hidden.dtype) if self.sliding_rope else rope
        residual, looped = None, None
        if self.decode_loop is not None and not batch.num_extend_tokens and batch.lora is None:
            looped = self.decode_loop.run(batch, hidden, rope, k_caches, v_caches)
        if looped is not None:
            hidden, residual = looped
        for i, layer in enumerate(self.layers if looped is None else ()):
            layer_rope = local_rope if layer.window else rope
            hidden, residual = layer(
                hidden, layer_rope, batch, k_caches[i], v_caches[i], self.ops, residual
            )
        rows = batch.logit_rows
        num_logit_rows = len(rows)
        if batch.hidden_rows is not None and len(batch.hidden_rows):
            rows = torch.cat([rows, batch.hidden_rows])  # one norm for the head and the pooling
        c = self.config
        # a decode-only step's logit rows increase (scheduler/batch.py): as many as its rows
        # are every row in order, and the two gathers (some 50 us on a cold CPU step) can go
        every_row = not batch.num_extend_tokens and len(rows) == len(hidden)
        if not every_row:
            hidden, residual = hidden[rows], residual[rows]
        _, hidden = add_rms_norm(
            hidden, self.norm, c.rms_norm_eps, c.norm_offset, residual=residual
        )
        if len(rows) > num_logit_rows:
            batch.hidden_states = hidden[num_logit_rows:].float()  # (H, hidden)
            hidden = hidden[:num_logit_rows]
        if self.quant_head is not None:
            logits = self.quant_head(hidden)
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = prepack.linear(hidden, weight, self.head_pack)  # (R, vocab) or a shard's
        if self.gather_logits is not None:
            logits = self.gather_logits(logits)
        logits = logits.float()
        if c.final_logit_cap:
            logits = torch.tanh(logits / c.final_logit_cap) * c.final_logit_cap
        return logits

    @torch.inference_mode()
    def decode_steps(
        self,
        batch: ForwardBatch,
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
        slots: torch.Tensor,
    ) -> torch.Tensor | None:
        """Greedy decode steps of a decode-only batch in one compiled call: `slots`
        (steps, B) int64 the KV slots of each step (row 0 the batch's own), each step taking
        every row's argmax as its next input. -> the tokens (done, B) of the steps done
        (fewer where one stopped), or None where the loop does not take the batch (run it as
        one step of `forward`)."""
        loop = self.decode_loop
        if loop is None or loop.tail is None or batch.num_extend_tokens or batch.lora is not None:
            return None
        if batch.embeds is not None or batch.mrope_positions is not None:
            return None
        self._prepare_layouts(batch)
        hidden = self.embed_tokens(batch.input_ids)
        steps = torch.arange(len(slots), dtype=batch.positions.dtype)
        rope = self.rope((batch.positions[None, :] + steps[:, None]).reshape(-1), hidden.dtype)
        return loop.run_steps(batch, hidden, rope, k_caches, v_caches, slots)

    def _prepare_layouts(self, batch: ForwardBatch) -> None:
        """One backend layout per (mode, window) in use, shared by every layer of that window.
        A layout the caller put in `batch.layouts` already (the runner's, derived on the host;
        None for none) is kept."""
        ops = self.ops
        if self._windows is None:  # the layers' windows, fixed once built
            self._windows = sorted({layer.window for layer in self.layers})
        for window in self._windows:
            extra = {"sliding_window": window} if window else {}
            if ops.prepare_extend is not None and batch.num_extend_tokens:
                batch.layouts["extend", window] = ops.prepare_extend(
                    batch.extend_qo_indptr, batch.extend_kv_indptr, batch.extend_kv_indices,
                    new_slots=batch.out_slots[: batch.num_extend_tokens], **extra,
                )  # fmt: skip
            supplied = ("decode", window) in batch.layouts
            if (
                ops.prepare_decode is not None
                and not supplied
                and batch.num_extend_tokens < len(batch.input_ids)
            ):
                batch.layouts["decode", window] = ops.prepare_decode(
                    batch.decode_kv_indptr, batch.decode_kv_indices, **extra
                )

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face weights (fusing q/k/v and gate/up when stored apart, as most
        families do; Phi-3 stores them fused). Raises ValueError naming missing, unexpected
        or misshapen weights: nothing is silently ignored."""
        c = self.config
        load_weights(self, state, c.renamed_prefixes, c.skipped_prefixes)
