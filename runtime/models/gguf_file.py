"""A GGUF file's tensors under Hugging Face names, the matrices kept in their quantized blocks.

llama.cpp's files store each weight matrix row by row (one row per output feature, each row
whole blocks of its type), which is the layout the quantized kernels read
(`radixflow.kernels.quant.QuantWeight`): the file's bytes are the weights, with no
conversion and no fp32 copy. So a 98 MB SmolLM2 file is about 98 MB of weights in memory,
not the 540 MB of its fp32 form, and a 4.4 GB 7B file fits a 24 GiB machine.

- Kept as blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16 (`KEPT`). Any
  other type is dequantised here with gguf's reference, with a log line naming the type and
  what the fp32 copy costs. F32 matrices stay fp32 and take the plain fp32 path.
- Vectors (norms, biases) become fp32 tensors.
- The names are mapped back through gguf's own table (`gguf.get_tensor_name_map`), and the
  two changes llama.cpp's converter makes are undone as transformers' GGUF loader undoes
  them: q and k rows of the `llama` architecture are permuted for its rope layout (undone on
  whole rows, so on quantized rows too), and Gemma's norm weights are stored plus one.
- The tensors are copied out of the memory map into process memory: a page-cache mapping is
  cheaper to start but its pages can be dropped under pressure and read back in the middle
  of a decode step.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from radixflow.kernels import quant

log = logging.getLogger(__name__)

T = gguf.GGMLQuantizationType
KEPT = frozenset(
    int(T[name])
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16")
)
SPLIT = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
FUSED = ("self_attn.qkv_proj", "mlp.gate_up_proj")  # Phi-3 stores these fused
LAYER_MODULES = (
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "mlp.down_proj",
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
Weight = quant.QuantWeight | torch.Tensor


def architecture(reader: gguf.GGUFReader) -> str:
    field = reader.fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def _name_map(arch_name: str, num_layers: int, fused: bool) -> dict[str, str]:
    """GGUF tensor base name -> Hugging Face module name, for this architecture's tensors."""
    arch = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}[arch_name]
    table = gguf.get_tensor_name_map(arch, num_layers)
    modules = ["model.embed_tokens", "model.norm", "lm_head"]
    for i in range(num_layers):
        own = (*LAYER_MODULES, *(FUSED if fused else SPLIT))
        modules += [f"model.layers.{i}.{m}" for m in own]
    names = {}
    for module in modules:
        base = table.get_name(module)
        if base is not None:
            names[base] = module
    return names


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rope permutation of q or k rows (whole rows: any block type)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def read_state(path: Path, hf_config: Any) -> dict[str, Weight]:
    """Hugging Face name -> weight: a QuantWeight for each matrix of a kept type, else an
    fp32 tensor. Raises ValueError for a tensor it cannot place."""
    reader = gguf.GGUFReader(str(path))
    arch = architecture(reader)
    fused = "phi3" in arch
    names = _name_map(arch, hf_config.num_hidden_layers, fused)
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    state: dict[str, Weight] = {}
    costs: dict[str, int] = {}
    for tensor in reader.tensors:
        base, _, kind = tensor.name.rpartition(".")
        if base not in names:
            raise ValueError(f"{path}: tensor {tensor.name} has no place in a {arch} model")
        name = f"{names[base]}.{kind}"
        qtype = int(tensor.tensor_type)
        data = np.asarray(tensor.data)
        if arch == "llama" and base.endswith((".attn_q", ".attn_k")):
            data = _unpermute(data, heads if base.endswith(".attn_q") else kv_heads)
        matrix = len(tensor.shape) == 2
        if matrix and qtype in KEPT:
            n, k = int(tensor.shape[1]), int(tensor.shape[0])
            raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(n, -1).copy())
            state[name] = quant.QuantWeight(qtype, raw, (n, k))
            continue
        if qtype not in (T.F32, T.F16, T.BF16):
            dims = [int(d) for d in reversed(tensor.shape)]
            data = gguf.quants.dequantize(data, tensor.tensor_type).reshape(dims)
            if matrix:
                costs[tensor.tensor_type.name] = (
                    costs.get(tensor.tensor_type.name, 0) + data.size * 4
                )
        elif qtype == T.BF16:
            data = gguf.quants.dequantize(data, tensor.tensor_type)
        value = torch.from_numpy(np.array(data, dtype=np.float32))
        if arch.startswith("gemma") and kind == "weight" and base.endswith("norm"):
            value = value - 1  # llama.cpp stores Gemma's (1 + w) norms as 1 + w
        state[name] = value
    for type_name, cost in costs.items():
        log.warning(
            "%s: %s matrices have no quantized kernel: dequantised to fp32 at load (%.1f MiB)",
            path.name, type_name, cost / 2**20,
        )  # fmt: skip
    return state
