"""LoRA adapters (PEFT directories) on the decoder's projections, batched across adapters.

An adapter adds `scaling * (x @ A.T) @ B.T` to a projection's output, with A (r, in) and
B (out, r) per target module; scaling is lora_alpha / r (lora_alpha / sqrt(r) with rslora).
PEFT's separate q/k/v and gate/up modules land on slices of our fused `qkv_proj` and
`gate_up_proj` outputs; Phi-3's own fused modules land on the whole output.

A step's rows each carry an adapter id (0: the base model). `LoraBatch` groups the rows by
adapter once per step and each projection adds, per adapter, the delta of that adapter's rows
only (a segmented matmul, as S-LoRA and Punica do: a contiguous run of rows is a slice, else
a gather and an index_add): base rows cost nothing. The delta is added to the projection's
output whatever computed it (dense, prepacked or a GGUF-quantized base). Adapter weights stay
float32; the delta is cast to the activations' dtype when added.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# PEFT's module name -> (our projection, which part of its output: index into its split; None
# the whole output)
TARGETS: dict[str, tuple[str, int | None]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "qkv_proj": ("qkv_proj", None),  # Phi-3
    "o_proj": ("o_proj", None),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "gate_up_proj": ("gate_up_proj", None),  # Phi-3
    "down_proj": ("down_proj", None),
}
WEIGHT_NAME = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoraError(ValueError):
    """An adapter that cannot be served: a missing file, a config we do not support, weights
    that do not fit the base model. The message names the adapter and the problem."""


@dataclass
class LoraAdapter:
    """One loaded adapter: for each (layer, projection) the parts it changes, each
    (first output column, end column, A (r, in), B (out, r) with the scaling folded in)."""

    name: str
    path: str
    rank: int
    scaling: float
    parts: dict[tuple[int, str], list[tuple[int, int, torch.Tensor, torch.Tensor]]] = field(
        default_factory=dict
    )


def _sizes(config: Any) -> dict[str, tuple[int, list[int]]]:
    """Our projection -> (input size, its output split into the parts TARGETS index)."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    return {
        "qkv_proj": (h, [q, kv, kv]),
        "o_proj": (q, [h]),
        "gate_up_proj": (h, [i, i]),
        "down_proj": (i, [h]),
    }


def read_config(path: Path, name: str, max_rank: int) -> tuple[int, float]:
    """adapter_config.json -> (rank, scaling); raises LoraError on what we do not serve."""
    file = path / CONFIG_FILE
    if not file.is_file():
        raise LoraError(f"adapter {name!r}: no {CONFIG_FILE} in {path}")
    try:
        cfg = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise LoraError(f"adapter {name!r}: {CONFIG_FILE} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"adapter {name!r}: peft_type must be LORA")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(rank, int) or rank <= 0 or not isinstance(alpha, (int, float)):
        raise LoraError(f"adapter {name!r}: r must be a positive int and lora_alpha a number")
    unsupported = [
        key
        for key, off in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none"))
        if cfg.get(key, off) not in (off, None)
    ] + [key for key in ("rank_pattern", "alpha_pattern", "modules_to_save") if cfg.get(key)]
    if unsupported:
        raise LoraError(f"adapter {name!r}: unsupported options {unsupported}")
    if max_rank and rank > max_rank:
        raise LoraError(f"adapter {name!r}: rank {rank} exceeds --max-lora-rank {max_rank}")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def load_adapter(path: str, name: str, config: Any, max_rank: int = 0) -> LoraAdapter:
    """Read a PEFT adapter directory for a decoder of `config` (a ModelConfig). Raises
    LoraError naming any file, option or weight that does not fit."""
    root = Path(path)
    rank, scaling = read_config(root, name, max_rank)
    if not (root / WEIGHTS_FILE).is_file():
        raise LoraError(f"adapter {name!r}: no {WEIGHTS_FILE} in {root}")
    try:
        state = load_file(str(root / WEIGHTS_FILE))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types for a bad file
        raise LoraError(f"adapter {name!r}: cannot read {WEIGHTS_FILE}: {e}") from e
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        match = WEIGHT_NAME.search(key)
        if match is None or match[2] not in TARGETS:
            raise LoraError(f"adapter {name!r}: unsupported weight {key!r}")
        pairs.setdefault((int(match[1]), match[2]), {})[match[3]] = value.float()
    adapter = LoraAdapter(name, str(root), rank, scaling)
    sizes = _sizes(config)
    for (layer, module), ab in sorted(pairs.items()):
        _add_part(adapter, config, sizes, layer, module, ab)
    if not adapter.parts:
        raise LoraError(f"adapter {name!r}: no LoRA weights in {WEIGHTS_FILE}")
    return adapter


def _add_part(
    adapter: LoraAdapter,
    config: Any,
    sizes: dict[str, tuple[int, list[int]]],
    layer: int,
    module: str,
    ab: dict[str, torch.Tensor],
) -> None:
    where = f"adapter {adapter.name!r}: layer {layer} {module}"
    if set(ab) != {"A", "B"}:
        raise LoraError(f"{where}: needs both lora_A and lora_B")
    if layer >= config.num_layers:
        raise LoraError(f"{where}: the base model has {config.num_layers} layers")
    projection, part = TARGETS[module]
    in_size, splits = sizes[projection]
    start = sum(splits[:part]) if part is not None else 0
    out_size = splits[part] if part is not None else sum(splits)
    a, b = ab["A"], ab["B"]  # (r, in), (out, r)
    if a.shape != (adapter.rank, in_size) or b.shape != (out_size, adapter.rank):
        raise LoraError(
            f"{where}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit "
            f"(r={adapter.rank}, in={in_size}, out={out_size})"
        )
    parts = adapter.parts.setdefault((layer, projection), [])
    parts.append((start, start + out_size, a.contiguous(), (b * adapter.scaling).contiguous()))


class LoraBatch:
    """The adapter rows of one step, grouped by adapter (built once per forward)."""

    def __init__(self, adapter_ids: np.ndarray, adapters: dict[int, LoraAdapter]) -> None:
        # (T,) int64 adapter id per row; 0: the base model
        self.groups: list[tuple[LoraAdapter, slice | torch.Tensor]] = []
        for uid in np.unique(adapter_ids[adapter_ids != 0]).tolist():
            rows = np.flatnonzero(adapter_ids == uid)
            run = rows[-1] - rows[0] + 1 == len(rows)
            where = slice(int(rows[0]), int(rows[-1]) + 1) if run else torch.from_numpy(rows)
            self.groups.append((adapters[uid], where))

    def add(self, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out (T, out) += each adapter's delta on its rows of x (T, in); in place."""
        for adapter, rows in self.groups:
            for start, end, a, b in adapter.parts.get((layer, projection), ()):
                if isinstance(rows, slice):
                    delta = (x[rows].float() @ a.T) @ b.T  # (rows, out part)
                    out[rows, start:end] += delta.to(out.dtype)
                else:
                    delta = (x.index_select(0, rows).float() @ a.T) @ b.T
                    out[:, start:end].index_add_(0, rows, delta.to(out.dtype))


class LoraStore:
    """The adapters a model runner holds, by id (ids come from the scheduler's LoraTable and
    are never reused, so KV and weights of an unloaded adapter are never mistaken for a new
    one's)."""

    def __init__(self, config: Any, max_rank: int = 0) -> None:
        self.config, self.max_rank = config, max_rank
        self.adapters: dict[int, LoraAdapter] = {}

    def load(self, uid: int, name: str, path: str) -> None:
        """Raises LoraError; nothing changes then."""
        assert uid > 0 and uid not in self.adapters, f"{uid=} {list(self.adapters)=}"
        self.adapters[uid] = load_adapter(path, name, self.config, self.max_rank)

    def unload(self, uid: int) -> None:
        self.adapters.pop(uid, None)

    def batch(self, adapter_ids: np.ndarray) -> LoraBatch | None:
        """The step's LoraBatch; None when every row is the base model's."""
        if not len(adapter_ids) or not adapter_ids.any():
            return None
        return LoraBatch(adapter_ids, self.adapters)
