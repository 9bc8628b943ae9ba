"""The offline Engine's features measured one by one, side by side in one run.

    python -m radixflow.bench.engine_features              # everything
    python -m radixflow.bench.engine_features decode       # 1 and 16 streams vs transformers
    python -m radixflow.bench.engine_features load         # cold (fresh cache dir) and cached
    python -m radixflow.bench.engine_features radix        # shared 600-token prefix, cache on/off
    python -m radixflow.bench.engine_features chunked      # ITL p99 while long prompts arrive
    python -m radixflow.bench.engine_features constrained  # 16 JSON-schema requests vs plain

Greedy, fixed token counts (ignore_eos), same prompts for every system. Only the Engine's
public API (`generate`, `submit`/`step` for arrivals during decoding, `stats`, `with_config`),
so a refactor cannot change these numbers without changing what users see.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from radixflow.runtime import Engine
from radixflow.runtime.models.loader import weight_files

STORY = (
    "The lighthouse keeper kept a log of every ship that passed the northern cape. Over forty "
    "years he recorded storms, wrecks, rescues and the slow change of the coastline. "
)


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def bench_decode(engine: Engine) -> None:
    tok = engine.tokenizer
    model_dir = Path(engine.model_info["model_path"])
    weight_files(model_dir)  # a GGUF's directory gets its fp32 safetensors, once
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.eval()
    one = chat("Write a long story about a dragon.")
    params = {"max_new_tokens": 128, "temperature": 0, "ignore_eos": True}
    engine.generate(one, {**params, "max_new_tokens": 8})  # warm-up
    ours, _ = timed(lambda: engine.generate(one, params))
    ids = tok(one, return_tensors="pt").input_ids
    with torch.no_grad():
        theirs, _ = timed(
            lambda: hf.generate(
                ids,
                max_new_tokens=128,
                min_new_tokens=128,
                do_sample=False,
                pad_token_id=tok.eos_token_id,
            )
        )
    print(
        f"single stream, 128 new tokens: radixflow {128 / ours:.1f} tok/s, "
        f"transformers {128 / theirs:.1f} tok/s, ratio {theirs / ours:.2f}x"
    )
    prompts = [chat(f"Question {i}: describe a city you like, in detail.") for i in range(16)]
    p64 = {**params, "max_new_tokens": 64}
    ours, _ = timed(lambda: engine.generate(prompts, p64))
    tok.padding_side = "left"
    batch = tok(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        theirs, _ = timed(
            lambda: hf.generate(
                **batch,
                max_new_tokens=64,
                min_new_tokens=64,
                do_sample=False,
                pad_token_id=tok.eos_token_id,
            )
        )
    total = 16 * 64
    print(
        f"16 prompts x 64 new tokens: radixflow {total / ours:.1f} tok/s, transformers batched "
        f"{total / theirs:.1f} tok/s, ratio {theirs / ours:.2f}x"
    )


def bench_load() -> None:
    code = (
        "import time; t=time.perf_counter(); from radixflow.runtime import Engine; "
        "e=Engine(max_total_tokens=1024); print(f'{time.perf_counter()-t:.2f}')"
    )
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "RADIXFLOW_CACHE": cache}
        cold = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
        warm = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
    print(f"model load (process start to ready Engine): cold {cold} s, cached {warm} s")


def bench_radix(engine: Engine) -> None:
    tok = engine.tokenizer
    prefix = tok.encode(STORY * 20, add_special_tokens=False)[:600]
    rng = np.random.default_rng(0)
    words = tok.encode(
        " harbour storm ship rope lamp cliff tide gull wreck oar", add_special_tokens=False
    )
    questions = [prefix + rng.choice(words, 20).tolist() for _ in range(32)]
    params = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    for name, eng in (
        ("cache on", engine.with_config()),
        ("cache off", engine.with_config(disable_radix_cache=True)),
    ):
        wall, _ = timed(lambda e=eng: e.generate(input_ids=questions, sampling_params=params))
        stats = eng.stats()
        print(
            f"32 x (600 shared + 20) tokens, 32 new, {name}: wall {wall:.1f} s, "
            f"prefill tokens computed {stats['prefill_tokens_computed']}, "
            f"hit rate {stats['cache_hit_rate']:.3f}"
        )


def bench_chunked(engine: Engine) -> None:
    """16 chats decode; after the 10th step two 2000-token prompts arrive (`submit` between
    `step`s). ITL is the gaps between the chats' tokens, as each request recorded them."""
    tok = engine.tokenizer
    short = [chat(f"Chat {i}: tell me about the sea.") for i in range(16)]
    long_ids = [
        tok.encode((STORY * 80)[: 9000 + i], add_special_tokens=False)[:2000] for i in range(2)
    ]
    chat_params = {"max_new_tokens": 96, "temperature": 0, "ignore_eos": True}
    long_params = {"max_new_tokens": 8, "temperature": 0}
    for name, size in (("chunked 256", 256), ("chunking off", -1)):
        eng = engine.with_config(chunked_prefill_size=size, max_prefill_tokens=4096)
        chats, longs = eng.submit(short, chat_params), []
        start = time.perf_counter()
        steps = 0
        while eng.step():
            steps += 1
            if steps == 10:  # two long prompts arrive while the chats decode
                longs = eng.submit(input_ids=long_ids, sampling_params=long_params)
        wall = time.perf_counter() - start
        gaps = np.concatenate([np.diff(h.token_times) for h in chats])
        out_tokens = sum(h.num_output_tokens for h in chats + longs)
        print(
            f"16 decoding chats + 2 x 2000-token prompts, {name}: ITL p99 "
            f"{np.percentile(gaps, 99) * 1000:.0f} ms, max {gaps.max() * 1000:.0f} ms, "
            f"throughput {out_tokens / wall:.1f} tok/s, wall {wall:.1f} s"
        )


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "maxDigits": 3},
        "city": {"enum": ["Paris", "Rome", "Oslo", "Lima"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 20},
                "zip": {"type": "integer", "maxDigits": 5},
            },
            "required": ["street", "zip"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "tags", "address", "active"],
}


def bench_constrained(engine: Engine) -> None:
    """16 JSON-schema requests vs the same 16 unconstrained, equal token counts; plus the
    first request under the schema (its grammar compiled) and a second (compiled: cached)."""
    probe = {"max_new_tokens": 1, "temperature": 0, "json_schema": SCHEMA}
    cold, _ = timed(lambda: engine.generate(chat("Describe a person as JSON."), probe))
    cached, _ = timed(lambda: engine.generate(chat("Describe a person as JSON."), probe))
    print(
        f"one token under a new schema: {cold * 1000:.0f} ms (compile included), "
        f"again {cached * 1000:.0f} ms (grammar cached)"
    )
    prompts = [chat(f"Describe person {i} as JSON.") for i in range(16)]
    constrained = {"max_new_tokens": 128, "temperature": 0, "json_schema": SCHEMA}
    wall_c, outs = timed(lambda: engine.generate(prompts, constrained))
    tokens = [o["meta_info"]["completion_tokens"] for o in outs]
    plain = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in tokens]
    wall_p, _ = timed(lambda: engine.generate(prompts, plain))
    total = sum(tokens)
    print(
        f"16 requests, {total} tokens: JSON schema {total / wall_c:.1f} tok/s, unconstrained "
        f"{total / wall_p:.1f} tok/s, ratio {wall_p / wall_c:.2f}"
    )


PARTS = ("load", "decode", "radix", "chunked", "constrained")


def main(argv: list[str]) -> int:
    parts = argv or list(PARTS)
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        print(f"unknown parts {unknown}; choose from {', '.join(PARTS)}", file=sys.stderr)
        return 2
    print(f"torch threads {torch.get_num_threads()}, {time.strftime('%Y-%m-%d %H:%M')}")
    if "load" in parts:
        bench_load()
    if set(parts) == {"load"}:
        return 0
    with Engine(model="smollm2", max_total_tokens=65536) as engine:
        benches = (
            ("decode", bench_decode),
            ("radix", bench_radix),
            ("chunked", bench_chunked),
            ("constrained", bench_constrained),
        )
        for name, fn in benches:
            if name in parts:
                fn(engine)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
