"""Engine-level measurements, side by side in one run (issues 2 and 3).

    python programs/bench_engine.py            # everything
    python programs/bench_engine.py decode     # single stream + 16 streams vs transformers
    python programs/bench_engine.py load       # cold (fresh cache dir) and cached load
    python programs/bench_engine.py radix      # shared 600-token prefix, cache on vs off
    python programs/bench_engine.py chunked    # ITL p99 while long prompts arrive
    python programs/bench_engine.py constrained  # 16 JSON-schema requests vs unconstrained

Greedy, fixed token counts (ignore_eos), same prompts for every system.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from radixflow.runtime import Engine
from radixflow.runtime.protocol.sampling import SamplingParams
from radixflow.runtime.scheduler.request import Req

STORY = (
    "The lighthouse keeper kept a log of every ship that passed the northern cape. Over forty "
    "years he recorded storms, wrecks, rescues and the slow change of the coastline. "
)


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def bench_decode(engine: Engine) -> None:
    from transformers import AutoModelForCausalLM

    tok = engine.tokenizer
    hf = AutoModelForCausalLM.from_pretrained(engine.model_info["model_path"], dtype=torch.float32)
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
    tok = engine.tokenizer
    short = [chat(f"Chat {i}: tell me about the sea.") for i in range(16)]
    long_ids = [
        tok.encode((STORY * 80)[: 9000 + i], add_special_tokens=False)[:2000] for i in range(2)
    ]
    for name, size in (("chunked 256", 256), ("chunking off", -1)):
        eng = engine.with_config(chunked_prefill_size=size, max_prefill_tokens=4096)
        sched = eng.scheduler
        reqs = []
        sp = SamplingParams.from_dict({"max_new_tokens": 96, "temperature": 0, "ignore_eos": True})
        for i, text in enumerate(short):
            req = Req(
                rid=f"s{i}", input_ids=tok.encode(text, add_special_tokens=False), sampling=sp
            )
            reqs.append(req)
            sched.add_request(req)
        start = time.perf_counter()
        step = 0
        while sched.has_work:
            sched.step()
            step += 1
            if step == 10:  # two long prompts arrive while the chats decode
                for ids in long_ids:
                    sched.add_request(
                        Req(
                            rid=f"l{step}-{len(ids)}",
                            input_ids=list(ids),
                            sampling=SamplingParams.from_dict(
                                {"max_new_tokens": 8, "temperature": 0}
                            ),
                        )
                    )
        wall = time.perf_counter() - start
        gaps = np.concatenate([np.diff(r.token_times) for r in reqs])
        out_tokens = sum(len(r.output_ids) for r in reqs) + 2 * 8
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
    cold and cached compile time of the schema."""
    import json

    grammars = engine.scheduler.grammars
    key = ("json", json.dumps(SCHEMA))
    cold, _ = timed(lambda: grammars.get(key))
    cached, _ = timed(lambda: grammars.get(key))
    print(f"schema compile: cold {cold * 1000:.0f} ms, cached {cached * 1e6:.0f} us")
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


def main(argv: list[str]) -> None:
    parts = argv or ["load", "decode", "radix", "chunked", "constrained"]
    print(f"torch threads {torch.get_num_threads()}, {time.strftime('%Y-%m-%d %H:%M')}")
    if "load" in parts:
        bench_load()
    engine = Engine(max_total_tokens=65536) if set(parts) - {"load"} else None
    benches = (
        ("decode", bench_decode),
        ("radix", bench_radix),
        ("chunked", bench_chunked),
        ("constrained", bench_constrained),
    )
    for name, fn in benches:
        if name in parts:
            fn(engine)


if __name__ == "__main__":
    main(sys.argv[1:])
