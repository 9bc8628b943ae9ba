"""`sgl.VertexAI`: named as in SGLang so a program that mentions it gets a clear answer."""

from __future__ import annotations

from typing import Any


class VertexAI:
    """Not supported: constructing one raises NotImplementedError saying what to use."""

    def __init__(self, model_name: str, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"radixflow does not support the Vertex AI backend (model {model_name!r}): use "
            "sgl.OpenAI with Vertex AI's OpenAI-compatible endpoint (base_url=...), or "
            "sgl.LiteLLM with a 'vertex_ai/...' model"
        )
