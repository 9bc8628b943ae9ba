"""Tiny random-weight models of every GGUF family, written as GGUF files the way llama.cpp's
converter (convert_hf_to_gguf.py) lays them out, with their matrices in a chosen type.

- Names through gguf's own table (`gguf.get_tensor_name_map`); Phi-3's fused qkv and
  gate_up stay fused (attn_qkv, ffn_up), as llama.cpp stores them.
- Architecture `llama` (Llama and Mistral: llama.cpp writes Mistral as `llama`, named
  "mistral") has its q and k rows permuted for ggml's rope layout (llama.cpp's `permute`,
  the inverse of transformers' `_reverse_permute_weights`).
- Gemma norms are stored as 1 + w.
- The metadata keys transformers' GGUF loader reads (integrations/ggml.py), so the config it
  builds from the file is the source model's: each family's tiny config sets only what those
  keys carry (head_dim through rope.dimension_count or key_length, rope theta, eps, sliding
  window) and leaves the rest at the defaults transformers will assume; Gemma 2's soft-caps
  are written too, as llama.cpp writes them, at the values transformers assumes.
- Matrices (embedding and head included) in one type, or per tensor through `overrides`:
  Q4_0..Q8_0 quantized by gguf's writer-side `quantize`; K types (and Q2_K/Q3_K, which
  radixflow dequantizes at load) as random blocks with small finite fp16 scales, since gguf
  cannot quantize them (random blocks are valid data: the file's values are whatever
  gguf's `dequantize` makes of them); F16 and BF16 rounded from the fp32 weights. Vectors
  (norms, biases) stay F32, as in llama.cpp's files.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import transformers
from family_models import VOCAB, WINDOW, tiny_tokenizer

T = gguf.GGMLQuantizationType
# K types are built from random bytes: where their fp16 d (and dmin) sit in a block, and a
# bound on d that gives the weights a standard deviation near 0.25
K_TYPES = {"Q2_K": (80, 82, 4e-3), "Q3_K": (108, None, 4e-3), "Q4_K": (0, 2, 1e-3),
           "Q5_K": (0, 2, 5e-4), "Q6_K": (208, None, 2.5e-4)}  # fmt: skip
KEPT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16")
GGUF_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
GGUF_ARCH = {"mistral": "llama"}  # llama.cpp writes Mistral as llama (named "mistral")
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=256,  # K types: rows of whole 256-weight blocks
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA: k is permuted with its own head count
    head_dim=64,
    max_position_embeddings=256,
    rms_norm_eps=float(np.float32(1e-5)),  # as the file stores it
    initializer_range=0.25,  # peaked distributions: greedy ties are unlikely
    bos_token_id=None,
    eos_token_id=256,
    pad_token_id=256,  # transformers reads it from the file (Phi-3 defaults past VOCAB)
)


def _configs() -> dict[str, tuple[type, dict[str, Any]]]:
    """Each family's config: COMMON plus what its GGUF metadata carries."""
    return {
        "llama": (transformers.LlamaConfig, dict(rope_theta=50000.0)),
        "mistral": (transformers.MistralConfig, dict()),
        # bias on q/k/v; tied embeddings
        "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
        # q/k norms; head_dim 128 (transformers reads no key_length for qwen3: its default)
        "qwen3": (transformers.Qwen3Config, dict(head_dim=128)),
        # fused qkv and gate_up
        "phi3": (transformers.Phi3Config, dict(head_dim=None)),
        # (1 + w) norms, sandwich norms, soft-capping, sliding window on every other layer;
        # no output tensor in gguf's gemma2 table: tied
        "gemma2": (transformers.Gemma2Config,
                   dict(sliding_window=WINDOW, tie_word_embeddings=True)),
        # q/k norms on top; both layers sliding (the default pattern is 5 local : 1 global)
        "gemma3": (transformers.Gemma3TextConfig,
                   dict(sliding_window=WINDOW, tie_word_embeddings=False)),
    }  # fmt: skip


def build_model(family: str) -> transformers.PreTrainedModel:
    """transformers' `family` model with random weights, norms and biases drawn too."""
    config_class, extra = _configs()[family]
    settings = {**COMMON, **extra}
    if settings.get("head_dim") is None:
        settings.pop("head_dim")
    theta = settings.pop("rope_theta", None)
    config = config_class(**settings)
    if theta is not None:
        config.rope_parameters["rope_theta"] = theta
    torch.manual_seed(sum(map(ord, family)))
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    gemma = family.startswith("gemma")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0 if gemma else 1.0, 0.3)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.3)
        if family == "gemma2":  # tied and scaled by sqrt(hidden): keep the input token's own
            model.model.embed_tokens.weight.normal_(0.0, 0.02)  # logit from drowning the rest
    return model.float().eval()


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `permute`: each head's rotary halves interleaved, as ggml's rope reads q/k."""
    return (
        rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def random_blocks(type_name: str, rows: int, cols: int, seed: int, std: float) -> np.ndarray:
    """(rows, row_bytes) uint8 of a K type: random bytes, fp16 d (and dmin) overwritten with
    small finite values, so every quant, scale and min bit pattern occurs and none is inf/nan;
    the weights come out with a standard deviation near `std`."""
    qtype = T[type_name]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    d_at, dmin_at, scale = K_TYPES[type_name]
    for at in (d_at, dmin_at):
        if at is not None:
            d = (rng.random(len(blocks)) * 2 - 1) * scale * std / 0.25
            blocks[:, at : at + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def encode(weight: np.ndarray, type_name: str, seed: int) -> np.ndarray:
    """(rows, cols) fp32 -> (rows, row_bytes) uint8 of `type_name`, rows whole blocks."""
    if type_name in K_TYPES:
        return random_blocks(type_name, *weight.shape, seed, float(weight.std()))
    return gguf.quants.quantize(weight, T[type_name]).view(np.uint8)


def _gguf_arch(model: transformers.PreTrainedModel) -> str:
    model_type = model.config.model_type
    return GGUF_ARCH.get(model_type, model_type.removesuffix("_text"))


def quantize_model(
    model: transformers.PreTrainedModel, type_name: str, overrides: Mapping[str, str]
) -> dict[str, tuple[str, str, np.ndarray]]:
    """Put every matrix of `model` in `type_name` (`overrides`: GGUF base name -> type) and
    give the model the values those blocks hold, so it is the exact reference for the file.
    -> Hugging Face name -> (GGUF name, type, bytes in the model's row order, or the fp32
    values of a vector)."""
    c = model.config
    arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[_gguf_arch(model)]
    table = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    out = {}
    with torch.no_grad():
        for i, (name, param) in enumerate(model.named_parameters()):  # a tied head once
            module, _, kind = name.rpartition(".")
            base = table.get_name(module)
            assert base is not None, f"{arch}: no GGUF name for {module}"
            value = param.float().numpy()
            if value.ndim == 1:
                if "norm" in name and _gguf_arch(model).startswith("gemma"):
                    value = (value + 1) - 1  # so the file's 1 + w comes back as w
                    param.copy_(torch.from_numpy(value))
                out[name] = (f"{base}.{kind}", "F32", value)
                continue
            type_name_here = overrides.get(base, type_name)
            blocks = encode(value, type_name_here, seed=i)
            values = gguf.quants.dequantize(blocks, T[type_name_here]).reshape(value.shape)
            param.copy_(torch.from_numpy(values))
            out[name] = (f"{base}.{kind}", type_name_here, blocks)
    return out


def _metadata(writer: gguf.GGUFWriter, config: Any, family: str) -> None:
    writer.add_name(family)  # transformers reads a `llama` file named "mistral" as Mistral
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if family in ("llama", "mistral"):
        writer.add_rope_dimension_count(head_dim)
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    rope = config.rope_parameters
    theta = rope.get("full_attention", rope)["rope_theta"]
    writer.add_rope_freq_base(theta)
    if family.startswith("gemma"):
        writer.add_sliding_window(config.sliding_window)
    if family == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)


def _tokenizer(writer: gguf.GGUFWriter) -> None:
    """family_models' byte-level vocabulary as a gpt2 tokenizer (merges derived from it)."""
    tokenizer = tiny_tokenizer()
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.eos_token_id)


def write_gguf(
    path: Path,
    model: transformers.PreTrainedModel,
    type_name: str,
    overrides: Mapping[str, str] | None = None,
    extra: Mapping[str, np.ndarray] | None = None,
    metadata: Mapping[str, float | int] | None = None,
) -> dict[str, str]:
    """Quantize `model` in place (`quantize_model`) and write it to `path` as llama.cpp lays
    it out, with `extra` fp32 tensors beside the weights (llama.cpp's `rope_freqs`) and
    `metadata` keys beside its own.
    -> GGUF tensor name -> type written."""
    c = model.config
    arch = _gguf_arch(model)
    tensors = quantize_model(model, type_name, overrides or {})
    writer = gguf.GGUFWriter(str(path), arch)
    _metadata(writer, c, c.model_type.removesuffix("_text"))
    _tokenizer(writer)
    for key, value in (metadata or {}).items():  # more keys (general.sampling.*)
        if isinstance(value, int):
            writer.add_int32(key, value)
        else:
            writer.add_float32(key, value)
    for name, (gguf_name, kind, data) in tensors.items():
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = c.num_attention_heads if "attn_q" in gguf_name else c.num_key_value_heads
            data = _permute(data, heads)  # whole rows: the same for blocks as for values
        if kind == "F32":
            data = data + 1 if arch.startswith("gemma") and "norm" in name else data
            writer.add_tensor(gguf_name, data.astype(np.float32))
        else:
            writer.add_tensor(gguf_name, data, raw_dtype=T[kind])
    for gguf_name, values in (extra or {}).items():
        writer.add_tensor(gguf_name, values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {gguf_name: kind for gguf_name, kind, _ in tensors.values()}
