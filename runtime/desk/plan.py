"""The memory each model of a desk needs, planned as `radixflow serve` plans its own start
(runtime/model_executor/kv_sizing.py) but against the desk's memory cap: its weights (from
the file headers), its KV pool and the fixed reserve a server process keeps (activations,
tokenizer, grammars, the server). Without --max-total-tokens each model's pool is the one
`radixflow serve` would choose on a machine of cap / (number of models), or on the whole cap
when that share is too small; a model whose weights, smallest pool and reserve exceed the whole
cap cannot fit even alone and is refused.

Planning imports torch and reads the checkpoints (converting a GGUF once), so the desk runs
it in a short child process at start (`python -m radixflow.runtime.desk.plan`): the desk
process itself stays torch-free and small.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass

from radixflow.runtime.config import ServerConfig, config_from_kwargs
from radixflow.runtime.desk.catalog import ModelEntry

PLAN_TIMEOUT_S = 600.0  # a first start converts each GGUF once
RESERVE_FIXED = 1 << 30  # kv_sizing's: activations, tokenizer, grammars, the server process


@dataclass(frozen=True)
class Need:
    """What one model takes once loaded (bytes), or why it cannot be served (`error`)."""

    weights: int = 0
    kv_tokens: int = 0
    kv_bytes: int = 0
    reserve: int = RESERVE_FIXED
    error: str = ""

    @property
    def total(self) -> int:
        return self.weights + self.kv_bytes + self.reserve


def plan_one(config: ServerConfig, cap: int, count: int) -> Need:
    """The need of `config.model_path` under `cap` shared by `count` models."""
    from radixflow.runtime import models  # noqa: PLC0415 (torch: this child process only)
    from radixflow.runtime.model_executor import kv_sizing  # noqa: PLC0415 (torch)
    from radixflow.runtime.model_executor.model_runner import (  # noqa: PLC0415 (torch)
        pick_device,
        pick_dtype,
    )
    from radixflow.runtime.models.footprint import (  # noqa: PLC0415 (torch)
        holds_quantized,
        weight_bytes_estimate,
    )
    from radixflow.runtime.models.loader import (  # noqa: PLC0415 (torch)
        load_hf_config,
        resolve_model_dir,
    )

    model_dir = resolve_model_dir(config.model_path, config.revision)
    device = pick_device(config.device)
    dtype = pick_dtype(config.dtype, device)
    model_config = models.model_config(load_hf_config(model_dir))
    weights = weight_bytes_estimate(model_dir, config, device, dtype)
    half = device.type == "cpu" and (
        holds_quantized(model_dir, config) or weights >= kv_sizing.LARGE_MODEL_BYTES
    )
    kv_dtype = kv_sizing.kv_cache_dtype(config.kv_cache_dtype, dtype, half)

    def pool(available: int) -> kv_sizing.KVSizing:
        reserve = kv_sizing.reserve_bytes(available)
        where = "of the desk's memory cap (--models-memory)"
        plan = kv_sizing.MemoryPlan(available, weights, reserve, kv_dtype, where)
        return kv_sizing.choose_pool(config, plan, model_config, device.type)

    try:
        try:
            sizing = pool(cap // count) if count > 1 and not config.max_total_tokens else pool(cap)
        except kv_sizing.MemoryBudgetError:
            sizing = pool(cap)  # it fits only with fewer others loaded
    except kv_sizing.MemoryBudgetError as e:
        return Need(weights, error=f"cannot fit even alone: {e}")
    kv_bytes = sizing.num_tokens * sizing.bytes_per_token
    return Need(weights, sizing.num_tokens, kv_bytes)


def plan_models(
    config: ServerConfig, entries: list[ModelEntry], cap: int, log_level: str
) -> dict[str, Need]:
    """Every entry's Need, planned in a child process; a model that fails to plan (no such
    file, an unknown architecture) gets its error."""
    cmd = [sys.executable, "-m", "radixflow.runtime.desk.plan", "--cap", str(cap)]
    cmd += ["--config-json", json.dumps(dataclasses.asdict(config))]
    cmd += ["--models-json", json.dumps([[e.name, e.path] for e in entries])]
    cmd += ["--log-level", log_level]
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    done = subprocess.run(
        cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env, timeout=PLAN_TIMEOUT_S
    )
    needs = {}
    for line in done.stdout.decode(errors="replace").splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            name = row.pop("name")
            needs[name] = Need(**row)
    for e in entries:
        needs.setdefault(e.name, Need(error=f"planning failed (exit {done.returncode})"))
    return needs


def main() -> int:
    parser = argparse.ArgumentParser(prog="radixflow.runtime.desk.plan")
    parser.add_argument("--cap", type=int, required=True)
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--models-json", required=True)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args()
    logging.basicConfig(stream=sys.stderr, level=args.log_level.upper())
    base = config_from_kwargs(**json.loads(args.config_json))
    entries = json.loads(args.models_json)
    for name, path in entries:
        config = base.replace(model_path=path, models_dir="")
        try:
            need = plan_one(config, args.cap, len(entries))
        except (OSError, ValueError, KeyError) as e:  # no such file, a format we do not read
            need = Need(error=f"cannot be planned: {type(e).__name__}: {e}")
        print(json.dumps({"name": name, **dataclasses.asdict(need)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
