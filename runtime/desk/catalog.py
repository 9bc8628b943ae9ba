"""What a desk serves: its models by name (`--model-path NAME=PATH` given several times,
`--models-dir`), and the values its flags and Ollama's `keep_alive` take (durations, sizes).
Torch-free: the desk process never loads a model."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import psutil

from radixflow.runtime.config import ServerConfig

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
ENV_AVAILABLE = "RADIXFLOW_AVAILABLE_MEMORY"  # as kv_sizing reads it: a machine of that size
OS_SHARE = 0.05  # of the machine's total, left to the OS (kv_sizing's RESERVE_SHARE)


class DeskConfigError(ValueError):
    """A desk flag that cannot be used (a bad NAME=PATH, duration, size or folder)."""


@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: str


def named(text: str) -> ModelEntry | None:
    """`NAME=PATH` as an entry, or None for a plain path."""
    name, sep, path = text.partition("=")
    if sep and path and NAME.match(name) and not Path(text).exists():
        return ModelEntry(name, path)
    return None


def is_desk(config: ServerConfig) -> bool:
    """Whether `config` asks for several models (more than one NAME=PATH, or a folder)."""
    parts = config.model_path.split(",")
    return bool(config.models_dir) or (len(parts) > 1 and all(named(p) for p in parts))


def single_model(config: ServerConfig) -> ServerConfig:
    """One `--model-path NAME=PATH`: the plain server, serving PATH under NAME."""
    entry = named(config.model_path)
    if entry is None or config.served_model_name:
        return config
    return config.replace(model_path=entry.path, served_model_name=entry.name)


def model_entries(config: ServerConfig) -> list[ModelEntry]:
    """Every model of the desk, in order (the first is the default); raises DeskConfigError.
    With --models-dir, --model-path adds only its NAME=PATH entries (the default model path
    is not served)."""
    entries = []
    for part in config.model_path.split(","):
        entry = named(part)
        if entry is None and not config.models_dir:
            raise DeskConfigError(f"--model-path {part!r}: several models are each NAME=PATH")
        if entry is not None:
            entries.append(entry)
    if config.models_dir:
        entries += folder_entries(Path(config.models_dir))
    names = [e.name for e in entries]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise DeskConfigError(f"model names given twice: {', '.join(twice)}")
    if not entries:
        raise DeskConfigError(f"no model in {config.models_dir} (.gguf files or HF directories)")
    return entries


def folder_entries(folder: Path) -> list[ModelEntry]:
    """A folder's .gguf files (named by their stem) and Hugging Face directories (a
    config.json inside; named by the directory), sorted by name."""
    if not folder.is_dir():
        raise DeskConfigError(f"--models-dir {folder}: not a directory")
    entries = []
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.suffix == ".gguf":
            entries.append(ModelEntry(path.stem, str(path)))
        elif path.is_dir() and (path / "config.json").is_file():
            entries.append(ModelEntry(path.name, str(path)))
    return [e for e in entries if NAME.match(e.name)]


def parse_duration(value: object) -> float | None:
    """Ollama's keep_alive: seconds (a number, or a string of one) or a Go duration ("5m",
    "1h30m", "250ms"); None for "never" (any negative). Raises DeskConfigError."""
    if isinstance(value, bool):
        raise DeskConfigError(f"keep_alive {value!r}: a duration (5m) or seconds")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            seconds = go_duration(text)
    else:
        raise DeskConfigError(f"keep_alive {value!r}: a duration (5m) or seconds")
    if math.isnan(seconds):
        raise DeskConfigError("keep_alive must be a number")
    return None if seconds < 0 else seconds


def go_duration(text: str) -> float:
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    parts = DURATION.findall(body)
    if not body or "".join(n + u for n, u in parts) != body:
        raise DeskConfigError(f"keep_alive {text!r}: a duration (5m, 1h30m) or seconds")
    return sign * sum(float(n) * UNIT_S[u] for n, u in parts)


def parse_size(text: str) -> int:
    """'8G', '512M', '1.5GiB' or bytes -> bytes. Raises DeskConfigError."""
    clean = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = SIZE_UNITS.get(clean[-1:], 1)
    try:
        number = float(clean[:-1] if scale > 1 else clean)
    except ValueError as e:
        raise DeskConfigError(f"{text!r} is not a size (8G, 512M, bytes)") from e
    if not number > 0:
        raise DeskConfigError(f"{text!r}: a size must be positive")
    return int(number * scale)


def memory_cap(config: ServerConfig) -> tuple[int, str]:
    """(bytes the loaded models may take together, where the figure comes from):
    --models-memory, else the available RAM (or RADIXFLOW_AVAILABLE_MEMORY) less OS_SHARE of
    the total."""
    if config.models_memory:
        return parse_size(config.models_memory), "--models-memory"
    override = os.environ.get(ENV_AVAILABLE)
    if override:
        size = parse_size(override)
        return size - int(OS_SHARE * size), ENV_AVAILABLE
    memory = psutil.virtual_memory()
    return int(memory.available) - int(OS_SHARE * memory.total), "available RAM at start"
