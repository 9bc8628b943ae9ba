"""Tensor-parallel shards of the shared decoder (Megatron-style), loaded slice by slice.

Rank r of N keeps (`plan_shard`):
- q/k/v (the fused `qkv_proj`) column-parallel by heads: a contiguous run of KV heads and the
  query heads that read them, so the rank's grouped-query layout is again uniform (local
  query head h reads local KV head h // group). KV heads not divisible by N are split
  unevenly (SmolLM2's 3 over 2 ranks: 1 and 2); with fewer KV heads than ranks every rank
  keeps one KV head (replicated on the ranks sharing it) and a share of its query heads.
- gate/up (the fused `gate_up_proj`) column-parallel over the intermediate size.
- o_proj and down_proj row-parallel over the same splits: the partial outputs are summed by
  an all-reduce and the bias added once, after it (`RowParallelLinear`).
- the embedding vocabulary-parallel: ids outside the rank's rows embed to zeros and the
  all-reduce sums (`VocabParallelEmbedding`); the LM head (tied or not) over the same rows, its
  logits gathered to rank 0 for the logit rows only (`CausalLM.gather_logits`).
Norms, rope tables and the residual stream are replicated.

The shard is built at its own sizes (`local_config`: the rank's heads, intermediate size and
vocabulary, so `DecoderLayer` needs no change) and loaded from the checkpoint's slices read
with safetensors' `get_slice` (`read_shard_state`): no rank holds the full weights.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from radixflow.runtime.models import UnsupportedModelError
from radixflow.runtime.models.layers import CausalLM, ModelConfig


class Collectives(Protocol):
    """The group operations a shard needs (runtime/distributed/tensor_parallel.py implements
    them)."""

    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the ranks, in place; every rank gets the sum."""

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (same shape everywhere), in rank order, on rank 0; None
        elsewhere."""


@dataclass(frozen=True)
class Shard:
    """What rank `rank` of `size` keeps; every range is [start, end) in global indices."""

    rank: int
    size: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]


def split(n: int, size: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s contiguous share of n items; shares differ by at most one."""
    return n * rank // size, n * (rank + 1) // size


def split_heads(num_heads: int, num_kv_heads: int, size: int, rank: int) -> tuple[range, range]:
    """-> (query heads, KV heads) of `rank`, chosen so the local heads group uniformly."""
    if num_heads < size:
        raise UnsupportedModelError(f"--tp-size {size} exceeds the {num_heads} attention heads")
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        kv = range(*split(num_kv_heads, size, rank))
        return range(kv.start * group, kv.stop * group), kv
    # fewer KV heads than ranks: each rank keeps one, shared by the ranks around it
    kv_head = num_kv_heads * rank // size
    sharing = [r for r in range(size) if num_kv_heads * r // size == kv_head]
    start, stop = split(group, len(sharing), sharing.index(rank))
    base = kv_head * group
    return range(base + start, base + stop), range(kv_head, kv_head + 1)


def plan_shard(config: ModelConfig, size: int, rank: int) -> Shard:
    """Rank `rank`'s shard of `config` (raises UnsupportedModelError when a split is empty)."""
    heads, kv_heads = split_heads(config.num_heads, config.num_kv_heads, size, rank)
    if config.intermediate_size < size or config.vocab_size < size:
        raise UnsupportedModelError(f"--tp-size {size} exceeds the MLP or vocabulary size")
    return Shard(
        rank,
        size,
        (heads.start, heads.stop),
        (kv_heads.start, kv_heads.stop),
        split(config.intermediate_size, size, rank),
        split(config.vocab_size, size, rank),
    )


def local_config(config: ModelConfig, shard: Shard) -> ModelConfig:
    """The config a `CausalLM` is built with to hold exactly `shard`'s weights."""
    return dataclasses.replace(
        config,
        num_heads=shard.heads[1] - shard.heads[0],
        num_kv_heads=shard.kv_heads[1] - shard.kv_heads[0],
        intermediate_size=shard.intermediate[1] - shard.intermediate[0],
        vocab_size=shard.vocab[1] - shard.vocab[0],
    )


def _pieces(name: str, config: ModelConfig, shard: Shard) -> tuple[int, list[range]] | None:
    """A checkpoint tensor's (dim, row or column ranges concatenated along it) in `shard`;
    None for a tensor every rank keeps whole (norms, biases of row-parallel layers)."""
    d, inter = config.head_dim, config.intermediate_size
    q = range(shard.heads[0] * d, shard.heads[1] * d)
    kv = range(shard.kv_heads[0] * d, shard.kv_heads[1] * d)
    i = range(*shard.intermediate)
    q_size, kv_size = config.num_heads * d, config.num_kv_heads * d
    shift = lambda r, by: range(r.start + by, r.stop + by)  # noqa: E731
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return 0, [range(*shard.vocab)]
    module, kind = name.rsplit(".", 1)
    own = ".".join(module.split(".")[-2:])
    rules = {
        "self_attn.q_proj": (0, [q]),
        "self_attn.k_proj": (0, [kv]),
        "self_attn.v_proj": (0, [kv]),
        "self_attn.qkv_proj": (0, [q, shift(kv, q_size), shift(kv, q_size + kv_size)]),
        "mlp.gate_proj": (0, [i]),
        "mlp.up_proj": (0, [i]),
        "mlp.gate_up_proj": (0, [i, shift(i, inter)]),
    }
    if own in rules:
        return rules[own]
    if own in ("self_attn.o_proj", "mlp.down_proj"):
        return (1, [q if own == "self_attn.o_proj" else i]) if kind == "weight" else None
    return None


def read_shard_state(
    files: list[Path], config: ModelConfig, shard: Shard
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (Hugging Face names) cut to `shard`, read slice by slice; the
    weights of another modality's tower (`config.skipped_prefixes`) are not read at all."""
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if config.skipped_prefixes and name.startswith(config.skipped_prefixes):
                    continue
                pieces = _pieces(name, config, shard)
                if pieces is None:
                    state[name] = f.get_tensor(name)
                    continue
                dim, ranges = pieces
                tensor = f.get_slice(name)
                parts = [tensor[r.start : r.stop] if dim == 0 else tensor[:, r.start : r.stop]
                         for r in ranges]  # fmt: skip
                state[name] = parts[0] if len(parts) == 1 else torch.cat(parts, dim)
    return state


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard @ W_shard^T) + b: the rank's input columns, summed over ranks,
    the bias (whole on every rank) added once after the sum."""

    def __init__(self, linear: nn.Linear, collectives: Collectives) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.collectives = collectives

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)  # (T, out), this rank's part of the sum
        self.collectives.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + n) of the embedding: other ids embed to zeros, the all-reduce
    sums the ranks' rows. `weight` is the shard, also the tied LM head's."""

    def __init__(self, embedding: nn.Embedding, start: int, collectives: Collectives) -> None:
        super().__init__()
        self.weight, self.start = embedding.weight, start
        self.collectives = collectives

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)  # (T, hidden)
        hidden.masked_fill_(outside[:, None], 0.0)
        self.collectives.all_reduce(hidden)
        return hidden


def gather_vocab(logits: torch.Tensor, vocab_size: int, collectives: Collectives) -> torch.Tensor:
    """(R, vocab shard) on every rank -> (R, vocab) on rank 0 (the shard elsewhere). Shards
    differ in width by at most one, so each is padded to the widest for the gather."""
    bounds = [split(vocab_size, collectives.size, r) for r in range(collectives.size)]
    widest = max(stop - start for start, stop in bounds)
    padded = F.pad(logits, (0, widest - logits.shape[1])).contiguous()  # (R, widest)
    parts = collectives.gather(padded)
    if parts is None:
        return logits
    return torch.cat([p[:, : stop - start] for p, (start, stop) in zip(parts, bounds)], dim=1)


def parallelize(model: CausalLM, full: ModelConfig, shard: Shard, collectives: Collectives) -> None:
    """Turn a loaded `local_config` model into its rank's part of the whole: row-parallel
    o/down projections, the vocabulary-parallel embedding, the logits gather; `model.config`
    keeps the rank's head and MLP sizes (its KV pool's shape) and the full vocabulary."""
    for layer in model.layers:
        layer.o_proj = RowParallelLinear(layer.o_proj, collectives)
        layer.down_proj = RowParallelLinear(layer.down_proj, collectives)
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, shard.vocab[0], collectives)
    model.decode_loop = None  # the compiled loop has no all-reduce after o_proj, down_proj
    model.gather_logits = partial(gather_vocab, vocab_size=full.vocab_size, collectives=collectives)
    model.config = dataclasses.replace(model.config, vocab_size=full.vocab_size)
