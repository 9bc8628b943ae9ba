"""Tiny random-weight checkpoints of every supported family, built from transformers' own
config classes with each family's special features switched on, saved as safetensors."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import transformers

VOCAB = 272  # 256 byte tokens + specials, padded
WINDOW = 8  # sliding windows shorter than every test prompt
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    max_position_embeddings=256,
    initializer_range=0.25,  # peaked distributions: greedy ties are unlikely
    bos_token_id=None,
    eos_token_id=256,
    pad_token_id=None,
)
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.3, 1.7, 2.2],  # one per rotary frequency (16 * 0.5 / 2)
    "long_factor": [1.5, 2.5, 4.0, 6.0],
    "original_max_position_embeddings": 72,  # prompt + 32 new tokens fit in the tests
}


def _configs() -> dict[str, tuple[type, dict[str, Any]]]:
    return {
        # llama3 rope scaling, bias on attention and MLP projections
        "llama": (
            transformers.LlamaConfig,
            dict(attention_bias=True, mlp_bias=True, rope_parameters={
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
                "rope_theta": 10000.0,
            }),
        ),
        # bias on q/k/v only; tied embeddings; windows on layers >= max_window_layers
        "qwen2": (
            transformers.Qwen2Config,
            dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=WINDOW,
                 max_window_layers=1),
        ),
        # per-head q/k RMSNorm; head_dim (24) independent of hidden / heads (16); untied
        "qwen3": (transformers.Qwen3Config, dict(head_dim=24, tie_word_embeddings=False)),
        # one sliding window on every layer
        "mistral": (transformers.MistralConfig, dict(sliding_window=WINDOW, head_dim=16)),
        # fused qkv / gate_up, partial rotary (half of head_dim), LongRoPE
        "phi3": (
            transformers.Phi3Config,
            dict(partial_rotary_factor=0.5, rope_parameters=LONGROPE,
                 original_max_position_embeddings=72),
        ),
        # (1 + w) norms, scaled embeddings, sandwich norms, attention + final soft-capping,
        # query pre-attention scaling, local/global alternation
        "gemma2": (
            transformers.Gemma2Config,
            dict(head_dim=16, query_pre_attn_scalar=20, sliding_window=WINDOW,
                 attn_logit_softcapping=4.0, final_logit_softcapping=6.0,
                 tie_word_embeddings=False),
        ),
        # as Gemma 2 plus q/k norms, local rope theta apart from the global (linear-scaled)
        "gemma3": (
            transformers.Gemma3TextConfig,
            dict(head_dim=16, query_pre_attn_scalar=20, sliding_window=WINDOW,
                 sliding_window_pattern=2, final_logit_softcapping=6.0,
                 tie_word_embeddings=False,
                 rope_parameters={
                     "full_attention": {"rope_type": "linear", "factor": 2.0,
                                        "rope_theta": 100000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                 }),
        ),
    }  # fmt: skip


FAMILIES = tuple(_configs())


@contextmanager
def one_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and on a shared machine spinning
    worker threads cost far more than they save; restore the count for later tests."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def build_hf_model(family: str, **overrides: Any) -> transformers.PreTrainedModel:
    """transformers' model of `family` with random weights: every norm, bias and matrix
    drawn, so a skipped bias, norm or offset changes the logits. `overrides` change the
    config (head counts for the tensor-parallel tests)."""
    config_class, extra = _configs()[family]
    config = config_class(**{**COMMON, **extra, **overrides})
    torch.manual_seed(sum(map(ord, family)))
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    gemma = family.startswith("gemma")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0 if gemma else 1.0, 0.3)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.3)
    return model.float().eval()


def byte_vocab() -> dict[str, int]:
    """Byte-level BPE's 256 characters, id i for byte i (GPT-2's byte-to-character table:
    printable Latin-1 bytes are themselves, the rest shift to 256 and up). A fixed order:
    `ByteLevel.alphabet()` comes from a hash set, so its order (and every id) changed with
    each process and a test's tokens with it."""
    kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
    shifted = iter(range(256, 512))
    return {chr(b if b in kept else next(shifted)): b for b in range(256)}


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Byte-level BPE without merges: ids 0..255 are bytes, 256 is EOS, then specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = byte_vocab()
    vocab["<|endoftext|>"] = 256
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>"
    )
    fast.add_special_tokens({"additional_special_tokens": [f"<|x{i}|>" for i in range(15)]})
    assert len(fast) == VOCAB, len(fast)
    return fast


def save_family(
    family: str, root: Path, name: str = "", **overrides: Any
) -> tuple[Path, transformers.PreTrainedModel]:
    """Write `family`'s tiny checkpoint (config.json, safetensors, tokenizer) under
    root / (name or family); `overrides` as for build_hf_model."""
    model = build_hf_model(family, **overrides)
    path = root / (name or family)
    model.save_pretrained(path, safe_serialization=True)
    tiny_tokenizer().save_pretrained(path)
    return path, model


def save_gemma3_multimodal(root: Path) -> tuple[Path, transformers.PreTrainedModel]:
    """A Gemma 3 image-text checkpoint (a tiny SigLIP tower beside the text model), as the
    4B and larger Gemma 3 models ship."""
    _, text = _configs()["gemma3"]
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
    config = transformers.Gemma3Config(
        text_config={**COMMON, **text}, vision_config=vision, mm_tokens_per_image=4
    )
    torch.manual_seed(3)
    model = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and "language_model" in name:
                param.normal_(0.0, 0.3)
    path = root / "gemma3-multimodal"
    model.save_pretrained(path, safe_serialization=True)
    tiny_tokenizer().save_pretrained(path)
    return path, model
