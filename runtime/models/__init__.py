"""Model families: which Hugging Face architectures we serve, and their configs.

Importing this package does not import torch (the loader checks names with it); the family
modules (`llama`, `phi3`, `gemma`) map a transformers config object to the shared decoder's
`ModelConfig` (`layers.py`), refusing options they do not implement; `bert` maps an encoder's
to its own `EncoderConfig` (embeddings only).
"""

from __future__ import annotations

import importlib
from typing import Any

# architecture -> the family module that maps its config
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",
    "Gemma3ForConditionalGeneration": "gemma",  # its text model; the vision tower is skipped
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",  # text model, mrope and vision tower
    # encoders, for embeddings only (--is-embedding)
    "BertModel": "bert",
    "RobertaModel": "bert",
    "XLMRobertaModel": "bert",
}
ENCODERS = ("BertModel", "RobertaModel", "XLMRobertaModel")
# model_type (config.json) -> architecture, for configs that name no architecture
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "bert": "BertModel",
    "roberta": "RobertaModel",
    "xlm-roberta": "XLMRobertaModel",
}


class UnsupportedModelError(ValueError):
    """The model exists but its architecture (or one of its options) is not implemented."""


def architecture_of(config: dict[str, Any]) -> str:
    """The supported architecture a config.json dict names; raises UnsupportedModelError."""
    names = list(config.get("architectures") or [])
    for name in names:
        if name in ARCHITECTURES:
            return name
    if not names and config.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[config["model_type"]]
    found = names or [f"model_type {config.get('model_type')!r}"]
    raise UnsupportedModelError(
        f"architecture {', '.join(found)} is not supported; supported: {', '.join(ARCHITECTURES)}"
    )


def model_config(hf_config: Any) -> Any:
    """transformers config object -> `layers.ModelConfig` (`bert.EncoderConfig` for an
    encoder); raises UnsupportedModelError."""
    arch = architecture_of(hf_config.to_dict())  # quantization_config: checkpoint_quant.py
    family = importlib.import_module(f"radixflow.runtime.models.{ARCHITECTURES[arch]}")
    return family.CONFIGS[arch](hf_config, arch)
