"""A model's card for listings (Ollama's `/api/tags`, `/api/show`): what its weights are on
disk, read from file headers only, no tensor.

`model_card(model_dir, hf_config)` -> {format ("gguf" or "safetensors"), family (the
config's model_type), parameter_count (tensor elements as stored: a packed quantized
checkpoint counts its packed ints), quantization (the GGUF file type, "Q4_1", or a
checkpoint's quant_method or dtype, "BF16"), size_bytes, modified (POSIX seconds of the newest
file), digest (sha256 of each file's path, size and mtime: an identity, not the bytes' hash,
which would cost a read of the whole file at every start)}.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path
from typing import Any

import gguf

from radixflow.runtime.models.gguf_file import read_layout
from radixflow.runtime.models.loader import gguf_source, weight_files

DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on its JSON header


def model_card(model_dir: Path, hf_config: dict[str, Any]) -> dict[str, Any]:
    source = gguf_source(model_dir)
    if source is not None:
        layout = read_layout(source)
        files = [source]
        count = sum(math.prod(t.dims) for t in layout.tensors)
        quantization = gguf_file_type(layout.fields.get("general.file_type"))
    else:
        files = weight_files(model_dir)  # a checkpoint's own files: nothing is converted
        count = sum(safetensors_count(f) for f in files)
        quantization = checkpoint_quantization(hf_config)
    stats = [f.stat() for f in files]
    identity = "".join(f"{f.resolve()}:{s.st_size}:{s.st_mtime_ns};" for f, s in zip(files, stats))
    return {
        "format": "gguf" if source is not None else "safetensors",
        "family": hf_config.get("model_type", "unknown"),
        "parameter_count": count,
        "quantization": quantization,
        "size_bytes": sum(s.st_size for s in stats),
        "modified": max((s.st_mtime for s in stats), default=0.0),
        "digest": hashlib.sha256(identity.encode()).hexdigest(),
    }


def gguf_file_type(value: Any) -> str:
    """llama.cpp's file type number as its name ("Q4_K_M", "F16"), as Ollama shows it."""
    try:
        name = gguf.LlamaFileType(value).name
    except ValueError:
        return "unknown"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def checkpoint_quantization(hf_config: dict[str, Any]) -> str:
    method = (hf_config.get("quantization_config") or {}).get("quant_method")
    if isinstance(method, str):
        return method.upper()
    dtype = hf_config.get("torch_dtype") or hf_config.get("dtype")
    return DTYPES.get(str(dtype), "unknown")


def safetensors_count(path: Path) -> int:
    """Tensor elements of one safetensors file, from its JSON header."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: a safetensors header of {size:,} bytes (a damaged file)")
        header = json.loads(f.read(size))
    return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
