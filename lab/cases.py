"""Workloads for `radixflow diagnose --workload`: the bench's, and the lab's constructed cases,
each small enough for a CPU, each a known shape of load:

  long_outputs      6 requests, 24-word prompts, 12 new tokens each (KV-hungry on a small
                    pool; admission-capped with --max-running-requests 2)
  long_prompts_mix  2 chats decoding when a ~320-word prompt arrives (chunked prefill)
  timestamp_prefix  4 programs whose shared instructions sit behind a varying timestamp
  small_chat        3 short requests (a healthy load)

`run_case` runs one on the real engine (or in simulate) and returns the scheduler's stats.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from typing import Any

from radixflow.bench.workloads import WORDS, WORKLOADS, Call, Codec, Workload, server_codec
from radixflow.lab.profiles import load_profile
from radixflow.lab.simulate import VirtualClock, drive, sim_scheduler, word_codec
from radixflow.runtime.config import ServerConfig
from radixflow.runtime.config.cli import config_from_args


def _sentence(rng: random.Random, words: list[str], n: int) -> str:
    return " ".join(rng.choice(words) for _ in range(n)).capitalize() + "."


def lab_workload(name: str, codec: Any, quick: bool = False) -> Any:
    """A lab case as a bench Workload (rounds of Calls). Raises ValueError if unknown."""

    if name in WORKLOADS:
        return WORKLOADS[name](codec, quick)
    rng, words = random.Random(16), list(WORDS)

    def encode(text: str) -> tuple[int, ...]:
        return tuple(codec.encode(text))

    if name == "long_outputs":
        calls = [Call(encode(_sentence(rng, words, 24)), 12) for _ in range(6)]
    elif name == "long_prompts_mix":
        calls = [Call(encode(_sentence(rng, words, 12)), 16) for _ in range(2)]
        calls += [
            Call(encode(_sentence(rng, words, 320)), 2, after_tokens=4 + 6 * i) for i in range(1)
        ]
    elif name == "timestamp_prefix":
        shared = "Follow these instructions. " + _sentence(rng, words, 48) + "\n"
        calls = [
            Call(
                encode(
                    f"[2026-12-01 09:{14 + i:02d}:{(37 * i) % 60:02d}.{(7919 * i) % 10**6:06d}]"
                    f" {shared}Question: {_sentence(rng, words, 8)}\nAnswer:"
                ),
                4,
            )
            for i in range(4)
        ]
    elif name == "small_chat":
        calls = [Call(encode(_sentence(rng, words, 8)), 6) for _ in range(3)]
    else:
        known = sorted([*WORKLOADS, *LAB_CASES])
        raise ValueError(f"unknown workload {name!r}; one of {known}")

    def rounds() -> Any:
        yield calls

    return Workload(name, len(calls), rounds(), codec)


LAB_CASES = ("long_outputs", "long_prompts_mix", "timestamp_prefix", "small_chat")


def run_case(
    name: str,
    config: ServerConfig,
    quick: bool = False,
    simulate: str | None = None,
    engine: Any = None,
) -> tuple[dict[str, Any], float]:
    """Run workload `name` on `config`: in simulate (a profile name or file), on `engine`
    (tests pass one sharing loaded weights), or on a new Engine. -> (stats, best hit rate)."""

    if simulate:
        clock, codec = VirtualClock(), word_codec()
        scheduler = sim_scheduler(config, load_profile(simulate), codec, clock)
        row = drive(
            scheduler, lab_workload(name, Codec(codec.encode, codec.decode), quick), clock.now
        )
        return scheduler.stats(), row["best_hit_rate"]
    owned = engine is None
    if owned:
        from radixflow.runtime.engine import Engine  # noqa: PLC0415 (torch: only a run on the real model loads it)

        engine = Engine(**dataclasses.asdict(config))
    try:
        workload = lab_workload(name, server_codec(engine.tokenizer), quick)
        row = drive(engine.scheduler, workload, time.monotonic, constrained=True)
        return engine.stats(), row["best_hit_rate"]
    finally:
        if owned:
            engine.shutdown()


def config_with_file(args: argparse.Namespace) -> tuple[ServerConfig, list[str]]:
    """The flags' config, under the values of `--config FILE` (JSON, SGLang's names; flags
    given explicitly win). -> (config, the file's settings radixflow does not have)."""
    config = config_from_args(args)
    if not getattr(args, "config", None):
        return config, []
    with open(args.config) as f:
        data = json.load(f)
    names = {f.name for f in dataclasses.fields(ServerConfig)}
    defaults = ServerConfig()
    explicit = {n for n in names if getattr(config, n) != getattr(defaults, n)}
    ignored = [
        f"{k}={v!r} (radixflow has no such setting)" for k, v in data.items() if k not in names
    ]
    known = {k: v for k, v in data.items() if k in names and k not in explicit}
    return config.replace(**known), ignored
