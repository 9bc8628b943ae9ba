"""Draft-model speculative decoding: one stream's tokens/s, target alone against target + draft.

    python -m radixflow.bench.draft_speculative                    # SmolLM2 fp32 <- its Q4_1
    python -m radixflow.bench.draft_speculative --prompts 1 --new-tokens 8 --repeats 1  # a check
    python -m radixflow.bench.draft_speculative --never-accepted PATH/TO/llama-7b-random-q4_0.gguf

Default pair: SmolLM2 dequantized to fp32 (`--dequantize-weights`) as target, drafted by
SmolLM2's Q4_1 GGUF (the built-in model file). Every repeat builds a fresh pair of engines
sharing the target's weights; prompt by prompt (one stream, greedy, EOS ignored, the same
token count for both; `--temperature T` samples instead, unseeded: drafts from the draft's q
judged by rejection sampling) the two take turns, which goes first alternating, so the
machine's swings in speed fall on both alike. A row gives the medians over repeats of each
side's tokens/s and of their ratio, and the draft's acceptance (drafts kept / proposed) and
tokens per verify step.

llama.cpp: llama-cpp-python (`--llama-python`, default $BENCH_LLAMA_CPP_PYTHON: a venv's python
with llama-cpp-python, as for radixflow.bench.speculative) exposes `Llama(draft_model=...)`
taking a `LlamaDraftModel`, whose only shipped implementation is `LlamaPromptLookupDecoding`
(n-grams); llama.cpp's own draft-model mode (`llama-speculative`, `llama-server -md`) is not
exposed. The peer row wraps a second `Llama` (the draft GGUF, greedy) in a `LlamaDraftModel`,
so llama.cpp verifies and drafts with its own kernels and Python drives the draft. Its target
is the Q4_1 GGUF itself: llama.cpp reads no dequantized checkpoint.

`--never-accepted TARGET`: a random target (the 7B-shaped GGUFs) drafted by a tiny random model
built with the target's own tokenizer, so drafts are (almost) never accepted: the on/off ratio
is the overhead of drafting when it does not pay (the adaptive draft length should keep it
near 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from radixflow.runtime import Engine
from radixflow.runtime.models.loader import builtin_gguf, resolve_model_dir

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "List the planets of the solar system with one fact each.",
    "Explain what a compiler does.",
    "Give advice to a new programmer.",
    "Describe a day at the beach.",
]


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def one_stream(engine: Engine, prompt: Any, new: int, temperature: float = 0) -> tuple[int, float]:
    params = {"max_new_tokens": new, "temperature": temperature, "ignore_eos": True}
    start = time.perf_counter()
    key = "input_ids" if isinstance(prompt, list) else "prompt"
    out = engine.generate(**{key: prompt}, sampling_params=params)
    return len(out["output_ids"]), time.perf_counter() - start


def measure(target: Engine, draft: str, prompts: list[Any], new: int, args: Any) -> dict:
    off_speed, on_speed, ratios, proposed, accepted, steps = [], [], [], 0, 0, 0
    for rep in range(args.repeats):
        systems = {
            "off": target.with_config(),
            "on": target.with_config(
                speculative_algorithm="draft",
                speculative_draft_model_path=draft,
                speculative_num_draft_tokens=args.draft_tokens,
            ),
        }
        for engine in systems.values():  # warm-up: not timed
            one_stream(engine, prompts[0], 4)
        before = systems["on"].stats()
        got = {label: [0, 0.0] for label in systems}
        for i, prompt in enumerate(prompts):
            order = list(systems) if (rep + i) % 2 == 0 else list(systems)[::-1]
            for label in order:
                tokens, wall = one_stream(systems[label], prompt, new, args.temperature)
                got[label][0] += tokens
                got[label][1] += wall
        stats = systems["on"].stats()
        proposed += stats["spec_proposed"] - before["spec_proposed"]
        accepted += stats["spec_accepted"] - before["spec_accepted"]
        steps += stats["spec_verify_steps"] - before["spec_verify_steps"]
        speed = {label: tokens / wall for label, (tokens, wall) in got.items()}
        off_speed.append(speed["off"])
        on_speed.append(speed["on"])
        ratios.append(speed["on"] / speed["off"])
        for engine in systems.values():
            engine.shutdown()
    return {
        "off_tok_s": statistics.median(off_speed),
        "on_tok_s": statistics.median(on_speed),
        "on_over_off": statistics.median(ratios),
        "ratios": ratios,
        "acceptance": accepted / proposed if proposed else 0.0,
        "tokens_per_verify_step": (accepted + steps) / steps if steps else 0.0,
        "proposed": proposed,
        "accepted": accepted,
    }


PEER = r"""
import json, statistics, sys, time
import numpy as np
import llama_cpp
from llama_cpp.llama_speculative import LlamaDraftModel

target_path, draft_path, k, new, repeats = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
prompts = json.loads(sys.argv[6])

class ModelDraft(LlamaDraftModel):
    # a second Llama drafting k greedy tokens (generate(reset=True) keeps the KV of the
    # longest prefix it shares with the last call and evaluates only the rest)
    def __init__(self, path, k):
        self.llm = llama_cpp.Llama(path, n_ctx=2048, n_threads=2, verbose=False)
        self.k = k
    def __call__(self, input_ids, **kwargs):
        out = []
        for tok in self.llm.generate(input_ids.tolist(), temp=0.0, reset=True):
            out.append(tok)
            if len(out) == self.k:
                break
        return np.array(out, dtype=np.intc)

def run(llm, prompt):
    ids = llm.tokenize(prompt.encode(), special=True)
    start, n = time.perf_counter(), 0
    for _ in llm.generate(ids, temp=0.0, reset=True):
        n += 1
        if n == new:
            break
    return n, time.perf_counter() - start

systems = {
    "off": llama_cpp.Llama(target_path, n_ctx=2048, n_threads=2, verbose=False),
    "on": llama_cpp.Llama(target_path, n_ctx=2048, n_threads=2, verbose=False,
                          draft_model=ModelDraft(draft_path, k)),
}
ratios, speeds = [], {"off": [], "on": []}
for rep in range(repeats):
    got = {label: [0, 0.0] for label in systems}
    for i, prompt in enumerate(prompts):
        for label in (list(systems) if (rep + i) % 2 == 0 else list(systems)[::-1]):
            n, wall = run(systems[label], prompt)
            got[label][0] += n
            got[label][1] += wall
    speed = {label: n / wall for label, (n, wall) in got.items()}
    for label in speed:
        speeds[label].append(speed[label])
    ratios.append(speed["on"] / speed["off"])
print(json.dumps({"off_tok_s": statistics.median(speeds["off"]),
                  "on_tok_s": statistics.median(speeds["on"]),
                  "on_over_off": statistics.median(ratios), "ratios": ratios}))
"""


def llama_cpp_row(python: str, draft_gguf: str, prompts: list[str], new: int, args: Any) -> dict:
    """llama-cpp-python, the draft GGUF drafting for the same GGUF (see the module's doc)."""
    cmd = [python, "-c", PEER, draft_gguf, draft_gguf, str(args.draft_tokens), str(new),
           str(args.repeats), json.dumps(prompts)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1:] or ["failed"]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def random_draft_for(target_dir: Path, into: Path) -> Path:
    """A tiny random Llama with the target's tokenizer and vocabulary size."""
    import torch  # noqa: PLC0415 (heavy: only this mode)
    import transformers  # noqa: PLC0415 (heavy: only this mode)

    config = json.loads((target_dir / "config.json").read_text())
    tiny = transformers.LlamaConfig(
        vocab_size=config["vocab_size"], hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        bos_token_id=config.get("bos_token_id"), eos_token_id=config.get("eos_token_id"),
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny).save_pretrained(into, safe_serialization=True)
    transformers.AutoTokenizer.from_pretrained(target_dir).save_pretrained(into)
    return into


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=6, help="prompts per repeat")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="fresh engine pairs")
    parser.add_argument(
        "--draft-tokens", type=int, default=8, help="--speculative-num-draft-tokens"
    )
    parser.add_argument("--llama-python", default=os.environ.get("BENCH_LLAMA_CPP_PYTHON", ""))
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy; else unseeded sampling"
    )
    parser.add_argument("--never-accepted", default="", help="a target GGUF: random-draft mode")
    parser.add_argument("--max-total-tokens", type=int, default=8192)
    parser.add_argument("--json", default="", help="write the rows here too")
    args = parser.parse_args(argv)
    texts = [chat(p) for p in (PROMPTS * 4)[: args.prompts]]
    rows: dict[str, Any] = {}
    if args.never_accepted:
        target = Engine(model=args.never_accepted, max_total_tokens=args.max_total_tokens)
        with tempfile.TemporaryDirectory() as tmp:
            draft = random_draft_for(resolve_model_dir(args.never_accepted), Path(tmp))
            prompts = [target.tokenizer.encode(t) for t in texts]
            rows["never_accepted"] = measure(target, str(draft), prompts, args.new_tokens, args)
        target.shutdown()
    else:
        target = Engine(
            model="smollm2", dequantize_weights=True, max_total_tokens=args.max_total_tokens
        )
        rows["smollm2_fp32_by_q4_1"] = measure(target, "smollm2", texts, args.new_tokens, args)
        target.shutdown()
        if args.llama_python:
            gguf = str(builtin_gguf("smollm2"))
            rows["llama_cpp_q4_1_by_q4_1"] = llama_cpp_row(
                args.llama_python, gguf, texts, args.new_tokens, args
            )
    print(f"load average {os.getloadavg()[0]:.1f}")
    print("| pair | off tok/s | on tok/s | on/off (each repeat) | acceptance | tokens/step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in rows.items():
        if "error" in r:
            print(f"| {name} | failed: {r['error']} | | | | |")
            continue
        each = ", ".join(f"{x:.2f}" for x in r["ratios"])
        acceptance = (
            f"{r['acceptance']:.2f} ({r['accepted']}/{r['proposed']})" if "acceptance" in r else "-"
        )
        per_step = f"{r['tokens_per_verify_step']:.2f}" if "acceptance" in r else "-"
        print(f"| {name} | {r['off_tok_s']:.1f} | {r['on_tok_s']:.1f} | {r['on_over_off']:.2f}x "
              f"({each}) | {acceptance} | {per_step} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
