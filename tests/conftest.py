"""Shared fixtures: one loaded SmolLM2 per test session; engines with other configs share it."""

from __future__ import annotations

import os

import pytest

# Tests use the machine's two cores; torch's default is fine, but keep tokenizers quiet.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a CPU does in one sentence.",
    "Say hello in Spanish.",
]


def chat(text: str) -> str:
    """SmolLM2's ChatML prompt for one user turn (with its default system prompt)."""
    return (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        f"Face<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.fixture(scope="session")
def engine():
    from radixflow.runtime import Engine

    with Engine(model="smollm2", self_check=True, max_total_tokens=16384) as eng:
        yield eng


@pytest.fixture(scope="session")
def make_engine(engine):
    """make_engine(**config) -> an Engine sharing the session's weights (self_check on)."""
    made = []

    def make(**changes):
        eng = engine.with_config(**{"self_check": True, **changes})
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.shutdown()


@pytest.fixture(scope="session")
def hf_model(engine):
    """transformers' LlamaForCausalLM on the very same converted weights."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        engine.model_info["model_path"], dtype=torch.float32
    )
    return model.eval()
