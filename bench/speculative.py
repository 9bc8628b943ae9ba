"""Speculative decoding off vs on, side by side in one run (issue 18).

    python -m radixflow.bench.speculative                # single stream and batch 16
    python -m radixflow.bench.speculative --programs 2   # fewer programs per workload

Workloads: json_decode, agent and multi_turn from radixflow.bench.workloads (their first
N programs, greedy, EOS ignored, the same token counts for both) and a plain chat. Single
stream runs every call alone, one after another; batch 16 runs each round's calls 16 at a
time. Driven through the Engine's public API (radixflow.bench.engine.RadixflowSystem).

Each single-stream row runs `--repeats` times, each batch row (a few seconds, so noisier)
`--batch-repeats` times. Every repeat builds a fresh pair of engines
(sharing the loaded weights), so "on" starts with empty n-gram tables, as a new server
would, and both compile their grammars once. Off and on take turns call by call (single) or
round by round (batch), so the machine's swings in speed fall on both alike. A row
gives the medians of the repeats' tok/s and of their on/off ratios. With
BENCH_LLAMA_CPP_PYTHON set (a venv's python with llama-cpp-python), llama.cpp's
single-stream decode speed on the same GGUF is measured too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from typing import Any

from radixflow.bench import workloads
from radixflow.bench.engine import RadixflowSystem
from radixflow.bench.workloads import Call, Codec
from radixflow.runtime import Engine
from radixflow.runtime.models.loader import builtin_gguf

CHATS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "Describe your favourite city and why.",
    "List the planets of the solar system with one fact each.",
    "Write a poem about autumn leaves.",
    "Explain what a compiler does.",
    "Describe a day at the beach.",
    "Give advice to a new programmer.",
]


def chat_rounds(codec: Codec, num: int, new: int) -> Any:
    yield [
        Call(tuple(codec.encode(f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n")), new)
        for t in (CHATS * 4)[:num]
    ]


def rounds_of(name: str, codec: Codec, num: int) -> Any:
    if name == "chat":
        return chat_rounds(codec, num, 96)
    # the first `num` programs as a workload of their own: the full workload's rounds want
    # every program's outputs back
    whole = workloads.WORKLOADS[name](codec, False)
    return workloads.program_workload(name, whole.programs[:num], codec).rounds


def run_pair(
    systems: dict[str, RadixflowSystem], name: str, codec: Codec, num: int, width: int, flip: bool
) -> dict[str, dict]:
    """Drive the workload's first `num` programs through each system, `width` calls at a
    time, the systems taking turns chunk by chunk (which goes first alternates), so a change
    in the machine's speed falls on both alike. -> per system: tokens, wall (its chunks)."""
    labels = list(systems)[::-1] if flip else list(systems)
    gens = {label: rounds_of(name, codec, num) for label in labels}
    calls = {label: next(gen)[:num] for label, gen in gens.items()}
    got = {label: {"tokens": 0, "wall": 0.0} for label in labels}
    for system in systems.values():
        system.start_workload()
    turn = 0
    while calls:
        outputs: dict[str, list[Any]] = {label: [] for label in calls}
        for i in range(0, max(len(c) for c in calls.values()), width):
            turn += 1
            for label in labels[:: 1 if turn % 2 else -1]:
                if label in calls and i < len(calls[label]):
                    start = time.perf_counter()
                    outputs[label] += systems[label].run_round(calls[label][i : i + width]).outputs
                    got[label]["wall"] += time.perf_counter() - start
        for label in list(calls):
            done = zip(calls[label], outputs[label])
            got[label]["tokens"] += sum(len(o) for c, o in done if not c.options)
            try:
                calls[label] = gens[label].send(outputs[label])[:num]
            except StopIteration:
                del calls[label]
    return got


def llama_cpp_single_stream(model_path: str) -> float | None:
    """llama.cpp's greedy decode tokens/s for one stream (128 new tokens, 2 threads)."""
    python = os.environ.get("BENCH_LLAMA_CPP_PYTHON")
    if not python:
        return None
    code = (
        "import sys, time, llama_cpp\n"
        "m = llama_cpp.Llama(sys.argv[1], n_ctx=2048, n_threads=2, verbose=False)\n"
        "p = m.tokenize(b'<|im_start|>user\\nWrite a short story about a lighthouse keeper.'"
        " b'<|im_end|>\\n<|im_start|>assistant\\n')\n"
        "m.eval(p); t = time.perf_counter(); n = 0\n"
        "for tok in m.generate(p, temp=0.0, reset=True):\n"
        "    n += 1\n"
        "    if n == 1: t = time.perf_counter()\n"
        "    if n == 129: break\n"
        "print((n - 1) / (time.perf_counter() - t))\n"
    )
    out = subprocess.run([python, "-c", code, model_path], capture_output=True, text=True)
    return float(out.stdout.strip()) if out.returncode == 0 else None


def measure(engine: Engine, codec: Codec, name: str, num: int, width: int, repeats: int) -> dict:
    """Off and on, `repeats` times with fresh engines, taking turns (`run_pair`)."""
    off_tok_s, on_tok_s, ratios, proposed, accepted = [], [], [], 0, 0
    # Warm-up: a plain call, and one token under each JSON schema the workload uses, so that
    # compiling the grammar (once per schema and server, the same for both) is not timed.
    # One token of output gives the n-gram tables nothing to draft from.
    hello = tuple(codec.encode("Hello there"))
    schemas = {c.json_schema for c in next(rounds_of(name, codec, num)) if c.json_schema}
    warm_up = [Call(hello, 8)] + [Call(hello, 1, schema) for schema in sorted(schemas)]
    for rep in range(repeats):
        systems = {
            "off": RadixflowSystem("off", engine.with_config(), owned=True),
            "on": RadixflowSystem(
                "on", engine.with_config(speculative_algorithm="ngram"), owned=True
            ),
        }
        for system in systems.values():
            system.run_round(warm_up)
        got = run_pair(systems, name, codec, num, width, flip=rep % 2 == 1)
        speed = {label: g["tokens"] / g["wall"] for label, g in got.items()}
        stats = systems["on"].engine.stats()
        proposed += stats["spec_proposed"]
        accepted += stats["spec_accepted"]
        off_tok_s.append(speed["off"])
        on_tok_s.append(speed["on"])
        ratios.append(speed["on"] / speed["off"])
        for system in systems.values():
            system.close()
    return {
        "off_tok_s": statistics.median(off_tok_s),
        "on_tok_s": statistics.median(on_tok_s),
        "speedup": statistics.median(ratios),
        "speedups": ratios,
        "acceptance": accepted / proposed if proposed else 0.0,
        "proposed": proposed,
        "accepted": accepted,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--programs", type=int, default=4, help="programs per workload, single")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--workloads", default="json_decode,agent,multi_turn,chat")
    parser.add_argument("--repeats", type=int, default=3, help="fresh engine pairs per row")
    parser.add_argument(
        "--batch-repeats", type=int, default=5, help="the same for batch rows (shorter, noisier)"
    )
    parser.add_argument("--json", default="", help="write the rows here too")
    args = parser.parse_args(argv)
    engine = Engine(model="smollm2", max_total_tokens=32768)
    codec = workloads.server_codec(engine.tokenizer)
    rows = []
    for name in args.workloads.split(","):
        for mode, num, width in (("single", args.programs, 1), ("batch", args.batch, args.batch)):
            repeats = args.repeats if mode == "single" else args.batch_repeats
            row = measure(engine, codec, name, num, width, repeats)
            row.update(workload=name, mode=f"{mode} x{width}")
            rows.append(row)
            print(json.dumps(row), flush=True)
    llama = llama_cpp_single_stream(str(builtin_gguf("smollm2")))
    print(f"\nload average {os.getloadavg()[0]:.1f}; llama.cpp single stream: {llama or 'n/a'}")
    print("| workload | mode | off tok/s | on tok/s | on/off (each repeat) | acceptance |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        each = ", ".join(f"{x:.2f}" for x in r["speedups"])
        print(
            f"| {r['workload']} | {r['mode']} | {r['off_tok_s']:.1f} | {r['on_tok_s']:.1f} | "
            f"{r['speedup']:.2f}x ({each}) | {r['acceptance']:.2f} "
            f"({r['accepted']}/{r['proposed']}) |"
        )
    if llama:
        print(f"| llama.cpp (this GGUF) | single x1 | - | {llama:.1f} | - | - |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "llama_cpp_single_tok_s": llama}, f, indent=1)
    engine.shutdown()


if __name__ == "__main__":
    main()
