"""What the desk says about its models without asking them: OpenAI's /v1/models cards,
Ollama's /api/tags and /api/ps entries (from the plan and, once a model has been loaded, its
own /get_model_info) and the desk's Prometheus lines."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

from radixflow.runtime.desk.desk import Desk, Slot
from radixflow.runtime.server.metrics import PREFIX
from radixflow.runtime.server.ollama_api import FOREVER, human_count, rfc3339

STARTED = int(time.time())
COUNTED = ("loads", "unloads", "evictions", "load_failures", "refused", "busy", "crashes")


def openai_card(slot: Slot) -> dict[str, Any]:
    return {
        "id": slot.name,
        "object": "model",
        "created": STARTED,
        "owned_by": "radixflow",
        "root": slot.entry.path,
        "max_model_len": slot.info.get("context_length"),
    }


def details(slot: Slot) -> dict[str, Any]:
    card = slot.info.get("card") or {}
    family = card.get("family", "unknown")
    path = Path(slot.entry.path)
    kind = "gguf" if path.suffix == ".gguf" or path.name == "smollm2" else "safetensors"
    return {
        "parent_model": "",
        "format": card.get("format", kind),
        "family": family,
        "families": [family],
        "parameter_size": human_count(card.get("parameter_count", 0)),
        "quantization_level": card.get("quantization", "unknown"),
    }


def ollama_entry(slot: Slot) -> dict[str, Any]:
    name = slot.name if ":" in slot.name else f"{slot.name}:latest"
    path = Path(slot.entry.path)
    modified = path.stat().st_mtime if path.exists() else STARTED
    return {
        "name": name,
        "model": name,
        "modified_at": rfc3339(modified),
        "size": slot.need.weights,
        "digest": hashlib.sha256(f"{slot.name}={slot.entry.path}".encode()).hexdigest(),
        "details": details(slot),
    }


def ps_entry(desk: Desk, slot: Slot) -> dict[str, Any]:
    """An /api/ps entry: `size` is what the desk counts the model for (weights, KV pool and
    reserve); `expires_at` when it unloads if no request comes (busy: keep-alive from now)."""
    now = time.monotonic()
    if slot.active:
        expires = None if desk.keep_alive is None else now + desk.keep_alive
    else:
        expires = slot.expires
    return {
        **ollama_entry(slot),
        "size": slot.need.total,
        "size_vram": 0,
        "expires_at": FOREVER if expires is None else rfc3339(time.time() + expires - now),
        "context_length": slot.info.get("context_length"),
        # radixflow's own: the child's process id, requests in flight, the KV pool's tokens
        "pid": slot.child.pid if slot.child is not None else None,
        "active_requests": slot.active,
        "kv_tokens": slot.need.kv_tokens,
    }


def metrics_text(desk: Desk) -> str:
    """The desk's counters and gauges in Prometheus' text format (version 0.0.4)."""
    lines = []
    for event in COUNTED:
        name = f"{PREFIX}desk_{event}_total"
        lines.append(f"# TYPE {name} counter")
        for model in desk.slots:
            lines.append(f'{name}{{model="{model}"}} {desk.counts[(event, model)]}')
    resident = [s for s in desk.slots.values() if s.state == "loaded"]
    gauges = {
        "desk_resident_models": len(resident),
        "desk_resident_bytes": desk.resident_bytes(),
        "desk_memory_cap_bytes": desk.cap,
    }
    for gauge, value in gauges.items():
        lines += [f"# TYPE {PREFIX}{gauge} gauge", f"{PREFIX}{gauge} {value}"]
    lines.append(f"# TYPE {PREFIX}desk_model_loaded gauge")
    for model, slot in desk.slots.items():
        lines.append(f'{PREFIX}desk_model_loaded{{model="{model}"}} {int(slot in resident)}')
    return "\n".join(lines) + "\n"
