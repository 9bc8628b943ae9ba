"""Gemma 2 and Gemma 3 (text): the (1 + w) RMSNorm, embeddings scaled by sqrt(hidden),
norms after attention and around the MLP, GELU (tanh), query pre-attention scaling, final
logit soft-capping, local (sliding-window) layers alternating with global ones. Gemma 2
soft-caps attention scores; Gemma 3 adds q/k norms and its own rope for local layers."""

from __future__ import annotations

import dataclasses
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
        hf,
        arch,
        rope_parameters=rope["full_attention"],
        **_gemma(hf, arch, qk_norm=True, sliding_rope=(local_theta, local_scaling)),
    )


def gemma3_multimodal(hf: Any, arch: str) -> ModelConfig:
    """The text model of a Gemma 3 image-text checkpoint (4B and up ship only these): the
    vision tower and projector weights are skipped; images are not supported."""
    config = gemma3(hf.text_config, arch)
    renamed = (("language_model.model.", "model."), ("model.language_model.", "model."))
    renamed += (("language_model.lm_head.", "lm_head."),)
    skipped = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.")
    skipped += ("model.multi_modal_projector.",)
    # transformers' image-text Gemma 3 does not soft-cap the final logits (null in every
    # released config anyway); the checkpoint's own flag, not its text config's, ties lm_head
    tied = getattr(hf, "tie_word_embeddings", None)
    return dataclasses.replace(
        config,
        renamed_prefixes=renamed,
        skipped_prefixes=skipped,
        final_logit_cap=0.0,
        tie_word_embeddings=config.tie_word_embeddings if tied is None else bool(tied),
    )


CONFIGS = {
    "Gemma2ForCausalLM": gemma2,
    "Gemma3ForCausalLM": gemma3,
    "Gemma3ForConditionalGeneration": gemma3_multimodal,
}
