"""KV pool dtypes side by side on one model, through the Engine: fp32, bf16, fp16 and int8
(which one `--kv-cache-dtype auto` should pick for quantized weights, and what int8's scaled
pool costs in accuracy and speed).

    python -m radixflow.bench.kv_dtype [--model smollm2] [--new-tokens 256] [--repeats 3]
        [--dtypes fp32,bf16,fp16,int8] [--streams 1,16]

- accuracy: greedy continuations of the chat prompts, each pool against the fp32 pool: the
  share of tokens equal up to the first divergence and after it (top-1 agreement), and the
  mean and max absolute difference of the chosen tokens' log-probs over the common prefix
  (the logit error as the user sees it: the log-softmax removes only a per-row shift).
- memory: each pool's bytes per token (an int8 pool's scales included), from model_info.
- speed: decode tokens/s at 1 and 16 streams, the pools interleaved round by round, medians
  of `--repeats` rounds (each engine's start log gives its pool's bytes per token).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from radixflow.bench.harness import wait_until_quiet
from radixflow.bench.quantized import PROMPTS, chat

DTYPES = ("fp32", "bf16", "fp16", "int8")


def greedy(engine: Any, prompts: list[str], new_tokens: int) -> list[dict[str, Any]]:
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    return engine.generate(prompts, params, return_logprob=True)


def compare(reference: list[dict[str, Any]], other: list[dict[str, Any]]) -> dict[str, float]:
    """Token agreement and log-prob error of `other` against `reference`, prompt by prompt."""
    same, total, errors, first_split = 0, 0, [], []
    for want, got in zip(reference, other):
        a, b = want["output_ids"], got["output_ids"]
        split = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        first_split.append(split)
        same += sum(x == y for x, y in zip(a, b))
        total += len(a)
        lp_a = [e[0] for e in want["meta_info"]["output_token_logprobs"][:split]]
        lp_b = [e[0] for e in got["meta_info"]["output_token_logprobs"][:split]]
        errors += [abs(x - y) for x, y in zip(lp_a, lp_b)]
    return {
        "token_agreement": same / total,
        "first_divergence_median": statistics.median(first_split),
        "logprob_err_mean": statistics.fmean(errors) if errors else 0.0,
        "logprob_err_max": max(errors, default=0.0),
    }


def decode_rate(engine: Any, prompts: list[str], new_tokens: int) -> float:
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    engine.generate(prompts, {**params, "max_new_tokens": 1})  # the prompts cached
    start = time.perf_counter()
    out = engine.generate(prompts, params)
    return sum(o["meta_info"]["completion_tokens"] for o in out) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    from radixflow.runtime import Engine  # noqa: PLC0415 (torch: after the arguments parse)

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", default="1,16")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="fp32 first: the reference")
    parser.add_argument("--max-total-tokens", type=int, default=16384)
    args = parser.parse_args(argv)
    dtypes = args.dtypes.split(",")
    assert dtypes[0] == "fp32", "the fp32 pool is the reference: name it first"
    prompts = [chat(p) for p in PROMPTS]
    engines = {
        d: Engine(model=args.model, kv_cache_dtype=d, max_total_tokens=args.max_total_tokens)
        for d in dtypes
    }
    outputs = {d: greedy(e, prompts, args.new_tokens) for d, e in engines.items()}
    rows = {d: compare(outputs["fp32"], outputs[d]) for d in dtypes}
    for d, engine in engines.items():
        rows[d]["bytes_per_token"] = engine.model_info["kv_pool"]["bytes_per_token"]
    streams = [int(s) for s in args.streams.split(",")]
    rates: dict[tuple[str, int], list[float]] = {(d, n): [] for d in dtypes for n in streams}
    for round_ in range(args.repeats):
        turn = round_ % len(dtypes)
        order = dtypes[turn:] + dtypes[:turn]
        for n in streams:
            batch = [prompts[i % len(prompts)] + " " * (i // len(prompts)) for i in range(n)]
            for d in order:
                wait_until_quiet()
                rates[d, n].append(decode_rate(engines[d], batch, args.new_tokens // 2))
    for (d, n), values in rates.items():
        rows[d][f"tok_s_{n}"] = round(statistics.median(values), 1)
    for engine in engines.values():
        engine.shutdown()
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
