"""A tiny random Qwen2.5-VL checkpoint (2 text layers, a 2-block vision tower with one window
and one full attention block), with a byte-level tokenizer that knows the vision tokens, a
Qwen2-VL chat template and a local image processor; and test images."""

from __future__ import annotations

import io
from pathlib import Path

import torch
import transformers
from family_models import VOCAB, byte_vocab

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]  # fmt: skip
IDS = {name: 257 + i for i, name in enumerate(SPECIALS)}
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112  # 4 to 16 tokens an image
# Qwen2-VL's chat template (its image and video parts), with a short default system prompt
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def vl_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Byte-level BPE without merges: ids 0..255 bytes, 256 EOS, 257.. the chat and vision
    tokens, padded to VOCAB."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = byte_vocab()
    vocab["<|endoftext|>"] = 256
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>"
    )
    extra = [f"<|x{i}|>" for i in range(VOCAB - 257 - len(SPECIALS))]
    fast.add_special_tokens({"additional_special_tokens": SPECIALS + extra})
    fast.chat_template = CHAT_TEMPLATE
    assert (
        len(fast) == VOCAB and fast.convert_tokens_to_ids("<|image_pad|>") == IDS["<|image_pad|>"]
    )
    return fast


def build_vl_model() -> transformers.Qwen2_5_VLForConditionalGeneration:
    text = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        eos_token_id=256,
        bos_token_id=None,
        pad_token_id=None,
        initializer_range=0.25,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )  # head_dim 16: 8 rotary frequencies, split 2 / 3 / 3 over (t, h, w)
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=64,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=56,
        fullatt_block_indexes=[1],
        initializer_range=0.25,
    )  # a window of 2 x 2 merged cells: the window attention path is exercised
    config = transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=IDS["<|image_pad|>"],
        video_token_id=IDS["<|video_pad|>"], vision_start_token_id=IDS["<|vision_start|>"],
        vision_end_token_id=IDS["<|vision_end|>"], tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(25)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                param.normal_(1.0, 0.3)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.3)
    model.config._attn_implementation = "eager"
    return model.float().eval()


def image_processor() -> object:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def save_qwen2_5_vl(root: Path) -> tuple[Path, transformers.PreTrainedModel]:
    """Write the tiny checkpoint (config, safetensors, tokenizer, preprocessor config)."""
    model = build_vl_model()
    path = root / "qwen2_5_vl"
    model.save_pretrained(path, safe_serialization=True)
    vl_tokenizer().save_pretrained(path)
    image_processor().save_pretrained(path)
    return path, model


def png(width: int, height: int, seed: int) -> bytes:
    """A random RGB image as PNG bytes."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(out, format="PNG")
    return out.getvalue()
