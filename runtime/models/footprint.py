"""What a checkpoint's weights will take in memory, read from file headers alone.

The KV pool is sized, and an explicit size refused, before any weight is read
(runtime/model_executor/kv_sizing.py), so the estimate comes from the tensor tables: a GGUF's
(kept block types at their size, the rest dequantized to fp32, as `gguf_file.read_state`
loads them) or the safetensors headers (each floating tensor at the load dtype). It is an
estimate; the sizing takes the larger of it and the weights as loaded.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import gguf
import numpy as np
import torch

from radixflow.runtime.config import ServerConfig
from radixflow.runtime.models import gguf_file
from radixflow.runtime.models.loader import gguf_source, weight_files

SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2}


def gguf_bytes(path: Path, dequantize: bool, dtype_bytes: int) -> int:
    """Bytes the tensors of GGUF `path` take once loaded: kept block types at their own size
    (unless `dequantize`), every other tensor at `dtype_bytes` an element."""
    total = 0
    for tensor in gguf_file.read_layout(path).tensors:
        numel = int(np.prod(tensor.dims, dtype=np.int64))
        if tensor.qtype in gguf_file.KEPT and len(tensor.dims) == 2 and not dequantize:
            block, size = gguf.GGML_QUANT_SIZES[gguf_file.T(tensor.qtype)]
            total += numel // block * size
        else:
            total += numel * dtype_bytes
    return total


def safetensors_tensors(path: Path) -> list[tuple[str, int]]:
    """(dtype, element count) of each tensor in a safetensors file, from its header."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return [
        (info["dtype"], int(np.prod(info["shape"], dtype=np.int64)))
        for name, info in header.items()
        if name != "__metadata__"
    ]


def holds_quantized(model_dir: Path, config: ServerConfig) -> bool:
    """Whether the model's matrices will be held quantized (a GGUF's blocks, AWQ/GPTQ,
    --quantization int8), known before loading it."""
    if config.dequantize_weights:
        return False
    if config.quantization or gguf_source(model_dir) is not None:
        return True
    return "quantization_config" in json.loads((model_dir / "config.json").read_text())


def weight_bytes_estimate(
    model_dir: Path, config: ServerConfig, device: torch.device, dtype: torch.dtype
) -> int:
    """Bytes the model in `model_dir` will hold in memory once loaded with `config` on
    `device` in `dtype`: a GGUF's blocks as stored, a checkpoint's floating tensors at
    `dtype` (int8 weight-only at a byte an element), packed fp32 CPU matmuls counted twice
    (the oneDNN/MKL packs are a second copy)."""
    item = torch.empty(0, dtype=dtype).element_size()
    source = gguf_source(model_dir)
    if source is not None:
        return gguf_bytes(source, config.dequantize_weights, item)
    files = weight_files(model_dir)
    if holds_quantized(model_dir, config) and config.quantization != "int8":
        return sum(f.stat().st_size for f in files)
    per_element = 1 if config.quantization == "int8" else item
    total = 0
    for file in files:
        for kind, numel in safetensors_tensors(file):
            floating = kind in ("F64", "F32", "F16", "BF16")
            total += numel * (per_element if floating else SAFETENSORS_BYTES.get(kind, 1))
    packed = (
        device.type == "cpu"
        and dtype == torch.float32
        and config.quantization == ""
        and config.cpu_matmul != "linear"
        and not config.disable_cpu_weight_prepack
    )
    return total * 2 if packed else total
