"""A model's card from its files' headers: the built-in GGUF (its llama.cpp file type, every
tensor's elements) and a safetensors checkpoint (shapes from the header, dtype or
quant_method from the config), sharded across two files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from radixflow.runtime.models.card import model_card
from radixflow.runtime.models.loader import builtin_gguf, resolve_model_dir


def test_the_builtin_gguf() -> None:
    model_dir = resolve_model_dir("smollm2")
    card = model_card(model_dir, json.loads((model_dir / "config.json").read_text()))
    path = builtin_gguf("smollm2")
    assert (card["format"], card["family"], card["quantization"]) == ("gguf", "llama", "Q4_1")
    assert card["size_bytes"] == path.stat().st_size and card["modified"] == path.stat().st_mtime
    assert 134e6 < card["parameter_count"] < 136e6 and len(card["digest"]) == 64  # "135M"


def test_a_sharded_safetensors_checkpoint(tmp_path: Path) -> None:
    save_file({"a": np.zeros((3, 4), np.float32)}, str(tmp_path / "model-1.safetensors"))
    save_file({"b": np.zeros((5,), np.float32), "c": np.zeros((2, 2, 2), np.float32)},
              str(tmp_path / "model-2.safetensors"), metadata={"format": "pt"})  # fmt: skip
    weight_map = {"a": "model-1.safetensors", "b": "model-2.safetensors"}
    index = {"weight_map": {**weight_map, "c": "model-2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = {"model_type": "qwen2", "torch_dtype": "bfloat16"}
    card = model_card(tmp_path, config)
    assert (card["format"], card["family"], card["quantization"]) == (
        "safetensors",
        "qwen2",
        "BF16",
    )
    assert card["parameter_count"] == 12 + 5 + 8
    files = sorted(tmp_path.glob("*.safetensors"))
    assert card["size_bytes"] == sum(f.stat().st_size for f in files)
    quantized = {**config, "quantization_config": {"quant_method": "awq"}}
    assert model_card(tmp_path, quantized)["quantization"] == "AWQ"
    before = card["digest"]
    save_file({"a": np.zeros((3, 5), np.float32)}, str(tmp_path / "model-1.safetensors"))
    after = model_card(tmp_path, config)
    assert after["digest"] != before and after["parameter_count"] == 15 + 5 + 8
