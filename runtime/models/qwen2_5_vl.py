"""Qwen2.5-VL (and Qwen2-VL's layout): the Qwen2 text decoder with multimodal rope (mrope),
and the vision tower that turns an image into embeddings spliced at its placeholder tokens.

The text model is the shared decoder (`layers.py`) with q/k/v bias and `mrope_section` set:
its rope then takes (3, T) positions (temporal, height, width; the three are equal for text).
The vision tower and merger are transformers' own module (`Qwen2_5_VisionTransformer...`),
run in torch on the model's device as a step of their own before prefill
(`model_executor/vision_step.py`); its weights come from the same checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from radixflow.runtime.models.layers import ModelConfig

VISUAL_PREFIXES = ("model.visual.", "visual.")  # transformers 5 saves the first, 4.x the second


def qwen2_5_vl(hf: Any, arch: str) -> ModelConfig:
    """The text model of a Qwen2.5-VL / Qwen2-VL checkpoint: Qwen2's decoder (q/k/v bias)
    with mrope; the vision tower's weights are skipped here (loaded by `VisionTower`)."""
    text = copy.copy(hf.text_config)
    # transformers 5 keeps the flag on the outer config only (older saves on the text config)
    text.tie_word_embeddings = bool(getattr(hf, "tie_word_embeddings", False))
    rope = dict(text.rope_parameters)
    section = tuple(int(s) for s in rope.pop("mrope_section", ()) or ())
    if rope.get("rope_type") == "mrope":
        rope["rope_type"] = "default"
    config = ModelConfig.from_hf(text, arch, rope_parameters=rope, qkv_bias=True)
    renamed = (("model.language_model.", "model."), ("language_model.model.", "model."))
    renamed += (("language_model.lm_head.", "lm_head."),)
    return dataclasses.replace(
        config, renamed_prefixes=renamed, skipped_prefixes=VISUAL_PREFIXES, mrope_section=section
    )


CONFIGS = {
    "Qwen2_5_VLForConditionalGeneration": qwen2_5_vl,
}

# the image processor's defaults (Qwen2VLImageProcessor's), overridden by the checkpoint's
# preprocessor_config.json
PROCESSOR_DEFAULTS = {
    "min_pixels": 56 * 56,
    "max_pixels": 28 * 28 * 1280,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}


def vision_info(model_dir: Path, hf_config: Any) -> dict[str, Any]:
    """What the server needs to expand an image's placeholder (plain data for model_info):
    the special token ids and the processor's sizes (to count an image's tokens)."""
    processor = dict(PROCESSOR_DEFAULTS)
    path = model_dir / "preprocessor_config.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    size = saved.get("size") or {}
    processor["min_pixels"] = saved.get("min_pixels") or size.get("shortest_edge") or 56 * 56
    processor["max_pixels"] = saved.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280
    for key in ("patch_size", "temporal_patch_size", "merge_size"):
        processor[key] = int(saved.get(key) or PROCESSOR_DEFAULTS[key])
    return {
        "image_token_id": int(hf_config.image_token_id),
        "video_token_id": int(hf_config.video_token_id),
        "vision_start_token_id": int(hf_config.vision_start_token_id),
        "vision_end_token_id": int(hf_config.vision_end_token_id),
        "processor": processor,
    }


class VisionTower(nn.Module):
    """Images -> their embeddings (one row per placeholder token), and the pixels' processing.
    `encode` takes a batch of decoded RGB images at once (one tower call for all)."""

    def __init__(self, hf_config: Any, info: dict[str, Any]) -> None:
        super().__init__()
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (  # noqa: PLC0415 (heavy: only a VLM loads it)
            Qwen2_5_VisionTransformerPretrainedModel,
        )
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (  # noqa: PLC0415 (heavy: only a VLM loads it)
            Qwen2VLImageProcessorPil,
        )

        vision_config = hf_config.vision_config
        vision_config._attn_implementation = "sdpa"
        self.tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(vision_config)
        p = info["processor"]
        self.processor = Qwen2VLImageProcessorPil(
            min_pixels=p["min_pixels"], max_pixels=p["max_pixels"], patch_size=p["patch_size"],
            temporal_patch_size=p["temporal_patch_size"], merge_size=p["merge_size"],
        )  # fmt: skip

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """The tower's weights from a checkpoint's state dict (its visual.* names), strictly."""
        own = {}
        for name, value in state.items():
            for prefix in VISUAL_PREFIXES:
                if name.startswith(prefix):
                    own[name.removeprefix(prefix)] = value
        missing, unexpected = self.tower.load_state_dict(own, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"vision tower weights: missing {missing[:8]}, unexpected {unexpected[:8]}"
            )

    @torch.inference_mode()
    def encode(self, images: list[Any]) -> list[torch.Tensor]:
        """Decoded RGB images (PIL) -> [(num_tokens_i, text hidden)] in one tower call."""
        batch = self.processor(images=images, return_tensors="pt")
        param = next(self.tower.parameters())
        pixels = batch["pixel_values"].to(param.device, param.dtype)  # (patches, C*T*P*P)
        grid = batch["image_grid_thw"].to(param.device)  # (N, 3)
        merged = self.tower(pixels, grid_thw=grid).pooler_output  # (sum tokens, hidden)
        unit = self.tower.spatial_merge_size**2
        return list(torch.split(merged, (grid.prod(-1) // unit).tolist()))
