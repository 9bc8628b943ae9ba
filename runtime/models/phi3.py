"""Phi-3 / Phi-3.5 / Phi-4-mini: fused qkv and gate_up projections in the checkpoint (the
loader takes them as they are), partial rotary, LongRoPE, one sliding window on every layer
when the config sets it."""

from __future__ import annotations

import dataclasses
from typing import Any

from radixflow.runtime.models.layers import ModelConfig


def phi3(hf: Any, arch: str) -> ModelConfig:
    window = int(getattr(hf, "sliding_window", None) or 0)
    windows = (window,) * hf.num_hidden_layers if window else ()
    config = ModelConfig.from_hf(hf, arch, layer_windows=windows)
    scaling = config.rope_scaling
    if scaling and "original_max_position_embeddings" not in scaling:  # older configs
        original = getattr(hf, "original_max_position_embeddings", None) or config.max_position
        scaling = {**scaling, "original_max_position_embeddings": original}
        config = dataclasses.replace(config, rope_scaling=scaling)
    return config


CONFIGS = {"Phi3ForCausalLM": phi3}
