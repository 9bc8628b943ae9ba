"""BERT-style encoders (BertModel, RobertaModel, XLMRobertaModel), as sentence-transformers
models ship them: absolute position embeddings (RoBERTa's start after its padding id), token
type embeddings (type 0 for a single input), post-LayerNorm blocks, a GELU MLP, and
bidirectional attention over each input.

Served for embeddings only (--is-embedding). The scheduler runs each request's whole input
in one step, never chunked and nothing taken from or written to the KV pool (the pool's
slots it holds are bookkeeping), so one forward sees every input whole: a ragged batch,
attended padded with a key mask. The scheduler pools the final hidden states it asks for
(`hidden_rows`): the first ([CLS]) or the mean, as the checkpoint's sentence-transformers
pooling config says (`sentence_pooling`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixflow.kernels import AttentionOps
from radixflow.runtime.models import UnsupportedModelError
from radixflow.runtime.models.layers import ForwardBatch
from radixflow.runtime.models.weights import CheckpointError

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
# sentence-transformers' Pooling modes -> ours
POOLING_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
}
# checkpoint name pieces -> ours, in order (the attention's output before the block's)
RENAMES = (
    (r"^embeddings\.word_embeddings\.", "embed_tokens."),
    (r"^embeddings\.position_embeddings\.", "embed_positions."),
    (r"^embeddings\.token_type_embeddings\.", "embed_types."),
    (r"^embeddings\.LayerNorm\.", "embed_norm."),
    (r"^encoder\.layer\.(\d+)\.attention\.self\.query\.", r"layers.\1.q_proj."),
    (r"^encoder\.layer\.(\d+)\.attention\.self\.key\.", r"layers.\1.k_proj."),
    (r"^encoder\.layer\.(\d+)\.attention\.self\.value\.", r"layers.\1.v_proj."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"layers.\1.o_proj."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"layers.\1.attention_norm."),
    (r"^encoder\.layer\.(\d+)\.intermediate\.dense\.", r"layers.\1.up_proj."),
    (r"^encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.down_proj."),
    (r"^encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"layers.\1.mlp_norm."),
)
PREFIXES = ("bert.", "roberta.", "model.")  # a task head's checkpoint nests the encoder
# heads and buffers an embedding does not use
SKIPPED = ("pooler.", "cls.", "lm_head.", "classifier.", "embeddings.position_ids")
SKIPPED += ("embeddings.token_type_ids",)


@dataclass(frozen=True)
class EncoderConfig:
    """What the encoder needs, read once from a transformers BertConfig / XLMRobertaConfig.
    `max_position` is the longest input (RoBERTa's table starts at padding_idx + 1); the
    head counts and layer count also size the KV pool's bookkeeping (kv_sizing.py)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    layer_norm_eps: float
    max_position: int
    position_offset: int  # table row of position 0
    type_vocab_size: int
    activation: str
    architecture: str

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads


def bert(hf: Any, arch: str) -> EncoderConfig:
    """BertModel; RoBERTa's position ids start at padding_idx + 1 (create_position_ids in
    transformers: it counts only non-padding tokens, and our inputs hold none)."""
    kind = getattr(hf, "position_embedding_type", "absolute") or "absolute"
    if kind != "absolute":
        raise UnsupportedModelError(f"position_embedding_type {kind!r} is not supported")
    if getattr(hf, "is_decoder", False) or getattr(hf, "add_cross_attention", False):
        raise UnsupportedModelError(f"{arch} as a decoder is not supported")
    if hf.hidden_act not in ACTIVATIONS:
        raise UnsupportedModelError(f"activation {hf.hidden_act!r} is not supported")
    offset = int(hf.pad_token_id) + 1 if arch != "BertModel" else 0
    heads = hf.num_attention_heads
    return EncoderConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=heads,
        head_dim=hf.hidden_size // heads,
        layer_norm_eps=float(hf.layer_norm_eps),
        max_position=int(hf.max_position_embeddings) - offset,
        position_offset=offset,
        type_vocab_size=int(hf.type_vocab_size),
        activation=hf.hidden_act,
        architecture=arch,
    )


CONFIGS = {"BertModel": bert, "RobertaModel": bert, "XLMRobertaModel": bert}


def sentence_pooling(model_dir: Path) -> str:
    """The pooling of a sentence-transformers checkpoint ("cls" | "mean" | "last"): its
    Pooling module's config (modules.json names the folder; 1_Pooling by default), else
    "mean", sentence-transformers' default for a plain encoder. Raises
    UnsupportedModelError for modules we do not run (Dense layers, max pooling...)."""
    folder = "1_Pooling"
    modules_file = model_dir / "modules.json"
    if modules_file.exists():
        for module in json.loads(modules_file.read_text()):
            kind = str(module.get("type", "")).rsplit(".", 1)[-1]
            if kind == "Pooling":
                folder = module.get("path") or folder
            elif kind not in ("Transformer", "Normalize"):
                raise UnsupportedModelError(f"sentence-transformers module {kind} is not run")
    pooling_file = model_dir / folder / "config.json"
    if not pooling_file.exists():
        return "mean"
    modes = {k for k, v in json.loads(pooling_file.read_text()).items() if v is True}
    modes = {k for k in modes if k.startswith("pooling_mode")}
    if len(modes) != 1 or next(iter(modes)) not in POOLING_MODES:
        raise UnsupportedModelError(f"sentence-transformers pooling {sorted(modes)}: supported "
                                    f"is one of {sorted(POOLING_MODES)}")  # fmt: skip
    return POOLING_MODES[modes.pop()]


def layer_norm(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


class EncoderLayer(nn.Module):
    """One post-LayerNorm block: x = norm(x + attention(x)); x = norm(x + mlp(x))."""

    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        self.config = c
        h = c.hidden_size
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(h, h) for _ in range(3))
        self.o_proj = nn.Linear(h, h)
        self.attention_norm = nn.LayerNorm(h, eps=c.layer_norm_eps)
        self.up_proj = nn.Linear(h, c.intermediate_size)
        self.down_proj = nn.Linear(c.intermediate_size, h)
        self.mlp_norm = nn.LayerNorm(h, eps=c.layer_norm_eps)
        self.act = ACTIVATIONS[c.activation]

    def forward(self, x: torch.Tensor, padding: Padding) -> torch.Tensor:
        x = layer_norm(x + self.o_proj(self._attention(x, padding)), self.attention_norm)
        return layer_norm(x + self.down_proj(self.act(self.up_proj(x))), self.mlp_norm)

    def _attention(self, x: torch.Tensor, padding: Padding) -> torch.Tensor:
        """(T, hidden) -> (T, hidden): every token attends to every token of its own input."""
        c = self.config
        q, k, v = (padding.pad(p(x).view(-1, c.num_heads, c.head_dim))
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # fmt: skip
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=padding.mask)  # (B, H, L, D)
        return padding.unpad(attn).reshape(x.shape[0], c.hidden_size)


class Padding:
    """A ragged batch (inputs back to back, `qo_indptr` their bounds) as a padded one:
    (B, H, L, D) with a key mask, L the longest input."""

    def __init__(self, qo_indptr: torch.Tensor) -> None:
        bounds = qo_indptr.tolist()  # on the host: one sync a forward, not one a layer
        lengths = qo_indptr.diff()  # (B,)
        self.num_inputs = len(bounds) - 1
        self.longest = max(b - a for a, b in zip(bounds, bounds[1:]))
        device = qo_indptr.device
        which = torch.repeat_interleave(torch.arange(self.num_inputs, device=device), lengths)
        offsets = torch.arange(bounds[-1], device=device) - qo_indptr[which]
        self.index = which * self.longest + offsets  # (T,) row in the padded (B * L) rows
        keys = torch.arange(self.longest, device=device)
        self.mask = (keys[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, L)

    def pad(self, t: torch.Tensor) -> torch.Tensor:
        """(T, H, D) -> (B, H, L, D), zeros past each input's end."""
        out = t.new_zeros(self.num_inputs * self.longest, *t.shape[1:])
        out[self.index] = t
        return out.view(self.num_inputs, self.longest, *t.shape[1:]).transpose(1, 2)

    def unpad(self, t: torch.Tensor) -> torch.Tensor:
        """(B, H, L, D) -> (T, H, D)."""
        _, heads, _, head_dim = t.shape
        return t.transpose(1, 2).reshape(-1, heads, head_dim)[self.index]


class Encoder(nn.Module):
    """Embeddings and encoder blocks; the ModelRunner calls it as it calls CausalLM."""

    stores_kv = False  # the runner allocates no KV cache for it

    def __init__(self, config: EncoderConfig, ops: AttentionOps) -> None:
        super().__init__()
        c = self.config = config
        self.ops = ops  # unused: the model info reports its name
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_positions = nn.Embedding(c.max_position + c.position_offset, c.hidden_size)
        self.embed_types = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.embed_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(c) for _ in range(c.num_layers))

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        k_caches: torch.Tensor | Sequence[torch.Tensor],
        v_caches: torch.Tensor | Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """Encode the batch's inputs (extend rows only, each a whole input: no prefix, no
        decode rows) and set `batch.hidden_states` (H, hidden) fp32 of `batch.hidden_rows`;
        returns no logits (0 rows). The caches are not touched."""
        assert batch.num_extend_tokens == len(batch.input_ids), "an encoder does not decode"
        assert not len(batch.extend_kv_indices), "an encoder's input has no cached prefix"
        assert not len(batch.logit_rows), "an encoder gives no logits"
        c = self.config
        positions = batch.positions + c.position_offset  # (T,)
        hidden = self.embed_tokens(batch.input_ids) + self.embed_positions(positions)
        hidden = layer_norm(hidden + self.embed_types.weight[0], self.embed_norm)  # (T, hidden)
        padding = Padding(batch.extend_qo_indptr)
        for layer in self.layers:
            hidden = layer(hidden, padding)
        if batch.hidden_rows is not None and len(batch.hidden_rows):
            batch.hidden_states = hidden[batch.hidden_rows].float()  # (H, hidden)
        return hidden.new_zeros((0, c.vocab_size), dtype=torch.float32)

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a Hugging Face BERT / RoBERTa checkpoint strictly (the pooler and task heads
        skipped). Raises CheckpointError naming missing, unexpected or misshapen weights."""
        renamed = {}
        for name, value in state.items():
            name = next((name.removeprefix(p) for p in PREFIXES if name.startswith(p)), name)
            if name.startswith(SKIPPED):
                continue
            for pattern, ours in RENAMES:
                name = re.sub(pattern, ours, name)
            renamed[name] = value
        own = dict(self.named_parameters())
        missing = sorted(set(own) - set(renamed))
        unexpected = sorted(set(renamed) - set(own))
        misshapen = sorted(n for n in set(own) & set(renamed) if own[n].shape != renamed[n].shape)
        if missing or unexpected or misshapen:
            raise CheckpointError(
                f"{self.config.architecture} checkpoint: missing {missing[:8]}, "
                f"unexpected {unexpected[:8]}, misshapen {misshapen[:8]}"
            )
        self.load_state_dict(renamed)
