"""How far the int8 mode of quantized matmuls (`--quantized-activations int8`, the default) is
from the exact one, beside llama.cpp's own 8-bit activation paths on the same file.

    python -m radixflow.bench.int8_accuracy [--model smollm2] [--new-tokens 256]

The reference: radixflow with `--quantized-activations fp32` (within 1e-4 of the dequantized
weights' F.linear) and an fp32 KV pool, whose greedy continuations of the chat prompts are
the sequences. Each system then reads every sequence teacher-forced and gives, at every
position, its most likely next token and its log-prob of the reference's token:

- radixflow int8, decode path: prefill chunks of one token (`chunked_prefill_size=1`), so
  every matmul has one row, as in decode: the one-row integer dot products (qdot.c).
- radixflow int8, prefill path: the whole sequence as one prompt: 8-bit tile products
  (AMX-INT8) under 64 rows, one bf16 tile pass from 64 (on a CPU with AMX; else the
  integer dot products, then the exact fp32 paths).
- llama.cpp (`BENCH_LLAMA_CPP_PYTHON`): its logits for every position, one token a batch.

Reported over the generated positions: top-1 agreement with the reference (the share of
positions whose most likely token is the reference's) and the mean and max absolute log-prob
error on the reference's tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from typing import Any

from radixflow.bench.quantized import PROMPTS, chat

LLAMA_CHILD = """
import json, sys
import numpy as np
import llama_cpp
sequences = json.loads(sys.stdin.read())
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=4096, n_batch=1, n_ubatch=1,
                      n_threads=int(sys.argv[2]), logits_all=True, verbose=False)
out = []
for ids in sequences:
    llm.reset()
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)], dtype=np.float64)
    top = logits.max(1, keepdims=True)
    logprobs = logits - top - np.log(np.exp(logits - top).sum(1, keepdims=True))
    # position i predicts ids[i + 1]
    out.append([[int(logprobs[i].argmax()), float(logprobs[i, ids[i + 1]])]
                for i in range(len(ids) - 1)])
print(json.dumps(out))
"""


def forced(engine: Any, sequences: list[list[int]]) -> list[list[tuple[int, float]]]:
    """For each sequence, at each position i < len - 1: (most likely token, log-prob of the
    token at i + 1), read teacher-forced as a prompt."""
    out = []
    for ids in sequences:
        engine.flush_cache()
        result = engine.generate(
            input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
            return_logprob=True, logprob_start_len=0, top_logprobs_num=1,
        )  # fmt: skip
        meta = result["meta_info"]
        given = [entry[0] for entry in meta["input_token_logprobs"]][1:]  # entry j: token j
        # input_top_logprobs[j]: the distribution that predicts token j (none for j = 0)
        top = [entries[0][1] for entries in meta["input_top_logprobs"][1:]]
        out.append(list(zip(top, given)))
    return out


def compare(
    reference: list[list[tuple[int, float]]],
    other: list[list[tuple[int, float]]],
    starts: list[int],
) -> dict[str, float]:
    """Over the generated positions only (from `starts`[i], the prompt's length - 1: the
    prompts' own tokens are improbable text whose log-probs say little)."""
    same, total, errors = 0, 0, []
    for want, got, start in zip(reference, other, starts):
        for (top_a, lp_a), (top_b, lp_b) in zip(want[start:], got[start:]):
            same += top_a == top_b
            total += 1
            errors.append(abs(lp_a - lp_b))
    return {
        "positions": total,
        "top1_agreement": round(same / total, 4),
        "logprob_err_mean": round(statistics.fmean(errors), 5),
        "logprob_err_max": round(max(errors), 4),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="python -m radixflow.bench.int8_accuracy")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=4)
    args = parser.parse_args(argv)
    import torch  # noqa: PLC0415 (torch: only when the bench runs)

    from radixflow.runtime import Engine  # noqa: PLC0415 (torch: only when the bench runs)
    from radixflow.runtime.models.loader import BUILTIN_MODELS, builtin_gguf  # noqa: PLC0415 (torch: only when the bench runs)

    common = {"model_path": args.model, "max_total_tokens": 4096, "kv_cache_dtype": "fp32"}
    prompts = [chat(p) for p in PROMPTS[: args.prompts]]
    params = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}
    with Engine(**common, quantized_activations="fp32") as exact:
        runs = exact.generate(prompts, params)
        encoded = [exact.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        sequences = [ids + r["output_ids"] for ids, r in zip(encoded, runs)]
        starts = [len(ids) - 1 for ids in encoded]
        reference = forced(exact, sequences)
    results = {}
    with Engine(**common, quantized_activations="int8", chunked_prefill_size=1) as engine:
        results["radixflow int8, decode path (1 row)"] = forced(engine, sequences)
    with Engine(**common, quantized_activations="int8") as engine:
        results["radixflow int8, prefill path (whole sequence)"] = forced(engine, sequences)
    if os.environ.get("BENCH_LLAMA_CPP_PYTHON"):
        gguf = builtin_gguf(args.model) if args.model in BUILTIN_MODELS else args.model
        out = subprocess.run(
            [os.environ["BENCH_LLAMA_CPP_PYTHON"], "-c", LLAMA_CHILD, str(gguf),
             str(torch.get_num_threads())],
            input=json.dumps(sequences), capture_output=True, text=True, check=True,
        )  # fmt: skip
        results["llama.cpp"] = [[tuple(e) for e in seq] for seq in json.loads(out.stdout)]
    rows = []
    for name, got in results.items():
        row = {"system": name, **compare(reference, got, starts)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
