"""Gemma 2 and Gemma 3 (text): the (1 + w) RMSNorm, embeddings scaled by sqrt(hidden),
norms after attention and around the MLP, GELU (tanh), query pre-attention scaling, final
logit soft-capping, local (sliding-window) layers alternating with global ones. Gemma 2
soft-caps attention scores; Gemma 3 adds q/k norms and its own rope for local layers."""

from __future__ import annotations

from typing import Any

from radixflow.runtime.models import UnsupportedModelError
from radixflow.runtime.models.layers import ModelConfig, split_rope


def _gemma(hf: Any, arch: str, **changes: Any) -> dict[str, Any]:
    bias = bool(getattr(hf, "attention_bias", False))
    return dict(
        qkv_bias=bias,
        o_bias=bias,
        norm_offset=1.0,
        sandwich_norm=True,
        embed_scale=hf.hidden_size**0.5,
        attn_scale=hf.query_pre_attn_scalar**-0.5,
        final_logit_cap=float(hf.final_logit_softcapping or 0.0),
        **changes,
    )


def gemma2(hf: Any, arch: str) -> ModelConfig:
    cap = float(hf.attn_logit_softcapping or 0.0)
    return ModelConfig.from_hf(hf, arch, **_gemma(hf, arch, attn_logit_cap=cap))


def gemma3(hf: Any, arch: str) -> ModelConfig:
    """transformers' Gemma 3 attention does not apply `attn_logit_softcapping` (None in every
    released config), so neither do we."""
    if getattr(hf, "use_bidirectional_attention", False):
        raise UnsupportedModelError("Gemma 3 with use_bidirectional_attention is not supported")
    rope = hf.rope_parameters
    local_theta, local_scaling, _ = split_rope(rope.get("sliding_attention") or {})
    return ModelConfig.from_hf(
        # from_hf reads rope_parameters: give it the global layers' entry
        _Rope(hf, rope["full_attention"]),
        arch,
        **_gemma(hf, arch, qk_norm=True, sliding_rope=(local_theta, local_scaling)),
    )


class _Rope:
    """`hf` with `rope_parameters` replaced by one layer kind's entry."""

    def __init__(self, hf: Any, rope_parameters: dict[str, Any]) -> None:
        self._hf, self.rope_parameters = hf, rope_parameters

    def __getattr__(self, name: str) -> Any:
        return getattr(self._hf, name)


CONFIGS = {"Gemma2ForCausalLM": gemma2, "Gemma3ForCausalLM": gemma3}
