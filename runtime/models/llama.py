"""Llama-shaped families: Llama, Mistral, Qwen2/2.5, Qwen3 (the shared decoder of `layers`,
with these switches)."""

from __future__ import annotations

from typing import Any

from radixflow.runtime.models.layers import ModelConfig


def llama(hf: Any, arch: str) -> ModelConfig:
    """Bias on all four attention projections when `attention_bias`, and on the MLP when
    `mlp_bias`."""
    bias = bool(getattr(hf, "attention_bias", False))
    return ModelConfig.from_hf(
        hf, arch, qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(hf, "mlp_bias", False))
    )


def mistral(hf: Any, arch: str) -> ModelConfig:
    """Llama with `sliding_window` (when set) on every layer, as transformers' Mistral does
    even if the config lists layer types."""
    window = int(hf.sliding_window or 0)
    windows = (window,) * hf.num_hidden_layers if window else ()
    return ModelConfig.from_hf(hf, arch, layer_windows=windows)


def qwen2(hf: Any, arch: str) -> ModelConfig:
    """Bias on q/k/v only (never o_proj); sliding windows from `layer_types` when
    `use_sliding_window` is on."""
    return ModelConfig.from_hf(hf, arch, qkv_bias=True)


def qwen3(hf: Any, arch: str) -> ModelConfig:
    """Per-head RMSNorm on q and k before rope; `head_dim` independent of the hidden size."""
    bias = bool(getattr(hf, "attention_bias", False))
    return ModelConfig.from_hf(hf, arch, qkv_bias=bias, o_bias=bias, qk_norm=True)


CONFIGS = {
    "LlamaForCausalLM": llama,
    "MistralForCausalLM": mistral,
    "Qwen2ForCausalLM": qwen2,
    "Qwen3ForCausalLM": qwen3,
}
