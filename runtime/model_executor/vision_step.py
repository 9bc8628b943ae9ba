"""The vision step: a plan's image rows get their images' embeddings, from one batched call
of the vision tower over the images not met before (before the prefill's forward, never
inside decode), and a bounded LRU of encoded images keyed by their pixel hash.

A plan (runtime/scheduler/images.py) lists its image rows and, per run of them, (image,
first token, count): a chunked prefill may cut an image, and a prompt whose cached prefix
ends inside an image needs only its tail.
"""

from __future__ import annotations

import io
import logging
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from radixflow.runtime.models.layers import CausalLM, ForwardBatch
from radixflow.runtime.models.qwen2_5_vl import VisionTower, vision_info
from radixflow.runtime.protocol.plan import BatchPlan

log = logging.getLogger(__name__)
CACHED_IMAGES = 64  # encoded images kept (each num_tokens x hidden)


class VisionStep:
    """Embeddings of image rows; `encoded` (key -> (num_tokens, hidden)) is the LRU cache."""

    def __init__(self, tower: VisionTower, info: dict[str, Any], capacity: int = CACHED_IMAGES):
        self.tower, self.info, self.capacity = tower, info, capacity
        self.encoded: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.num_encoded = 0  # images the tower ran on (the rest came from the cache)

    def splice(self, plan: BatchPlan, batch: ForwardBatch) -> None:
        """Set the batch's mrope positions and image embeddings from the plan."""
        device = batch.input_ids.device
        batch.mrope_positions = torch.from_numpy(plan.mrope_positions).to(device)
        if not plan.image_parts:
            return
        self._encode_missing([image for image, _, _ in plan.image_parts])
        parts = [self.encoded[i.key][first : first + n] for i, first, n in plan.image_parts]
        batch.embed_rows = torch.from_numpy(plan.image_rows).to(device)
        batch.embeds = torch.cat(parts)  # (K, hidden)

    def _encode_missing(self, images: list[Any]) -> None:
        missing = {}
        for image in images:
            if image.key in self.encoded:
                self.encoded.move_to_end(image.key)
            else:
                missing[image.key] = image
        if not missing:
            return
        from PIL import Image  # noqa: PLC0415 (optional: only a vision model decodes images)

        decoded = [Image.open(io.BytesIO(i.data)).convert("RGB") for i in missing.values()]
        outputs = self.tower.encode(decoded)
        self.num_encoded += len(outputs)
        for image, embeds in zip(missing.values(), outputs):
            assert len(embeds) == image.num_tokens, f"{len(embeds)=} {image.num_tokens=}"
            self.encoded[image.key] = embeds
        while len(self.encoded) > max(self.capacity, len(missing)):
            self.encoded.popitem(last=False)


def load_vision(
    model: CausalLM, model_dir: Path, hf_config: Any, state: dict[str, torch.Tensor]
) -> VisionStep | None:
    """The vision step of a checkpoint with a vision tower the runtime serves (Qwen2.5-VL),
    on the text model's device and dtype; None for a text-only model."""
    if not model.config.mrope_section:
        return None
    info = vision_info(model_dir, hf_config)
    tower = VisionTower(hf_config, info)
    tower.load(state)
    param = next(model.parameters())
    log.info("vision tower loaded (%s)", hf_config.vision_config.model_type)
    return VisionStep(tower.to(param.device, param.dtype).eval(), info)
