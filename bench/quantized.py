"""Quantized weights side by side: radixflow from the GGUF's blocks, radixflow from the same
file dequantised to fp32 (`--dequantize-weights`, the old path), and llama.cpp on the same
file; decode speed at 1 and N streams, resident memory and load time.

    python -m radixflow.bench.quantized speed [--model smollm2] [--streams 1,16] [--repeats 3]
    python -m radixflow.bench.quantized prefill [--model smollm2] [--length 512]
    python -m radixflow.bench.quantized load [--model smollm2]
    python -m radixflow.bench.quantized memory [--model smollm2]
    python -m radixflow.bench.quantized write-big DIR   # the 7B-class synthetic GGUFs

- speed: `--conditions quiet,hog` runs each round twice, the second time beside one busy
  process, to show how each system degrades when a core is taken (issue 35).
- speed: each system decodes `--new-tokens` greedy tokens (EOS ignored) for 1 chat prompt,
  then N distinct ones at once; systems interleaved round by round, `--repeats` rounds, the
  median reported with the ratio to llama.cpp. llama.cpp runs in its own venv
  (`BENCH_LLAMA_CPP_PYTHON`, bench/peers.py) with the same thread count.
- prefill: one prompt of `--length` token ids (drawn at random, new ones each round, so no
  prefix cache helps) and one generated token; tokens/s of prompt, median of the rounds.
- load: a fresh process per system and round loads the file and generates one token; the
  seconds from spawning it to its first token (its shutdown and exit not timed), median
  (page cache warm for both: the file was read before).
- memory: each variant loads in a fresh process, which reports its resident set (VmRSS)
  with the KV pool allocated, and its load time.
- write-big: Llama-shaped GGUFs (hidden 4096, 32 layers, 32 heads, 11008 FFN, SmolLM2's
  vocabulary and tokenizer) with random blocks, one in Q4_0 and one mixing Q4_K and Q6_K as
  llama.cpp's Q4_K_M does (v and down projections and the output in Q6_K). Random
  weights: speed and memory only; the text they generate means nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from radixflow.bench.harness import Hog, wait_until_quiet
from radixflow.bench.rounds import System

PROMPTS = (
    "Write a story about a robot who learns to paint.",
    "Explain how a bicycle works.",
    "List ten animals and one fact about each.",
    "Describe the water cycle for a child.",
    "What makes a good breakfast? Give reasons.",
    "Summarise the history of the printing press.",
    "Give advice to a new programmer.",
    "Describe a walk through a forest in autumn.",
)


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


SYSTEMS = (
    "radixflow", "radixflow-int8", "radixflow-exact", "radixflow-fp32", "radixflow-fixed",
    "llama.cpp",
)  # fmt: skip


def _systems(model: str, threads: int, names: list[str], pool_tokens: int) -> dict[str, Any]:
    """name -> a System: radixflow (the GGUF's blocks, the defaults), radixflow-int8 and
    radixflow-exact (--quantized-activations int8 / fp32), radixflow-fp32
    (--dequantize-weights), radixflow-fixed (blocks, a fixed thread count: the behaviour
    before --num-threads auto), radixflow-steps1 (a scheduling step per token: no decode
    runs), llama.cpp (its worker, same thread count)."""
    from radixflow.bench import baselines  # noqa: PLC0415 (torch: only when the bench runs)
    from radixflow.bench.engine import RadixflowSystem  # noqa: PLC0415 (torch: only when the bench runs)
    from radixflow.runtime import Engine  # noqa: PLC0415 (torch: only when the bench runs)
    from radixflow.runtime.models.loader import BUILTIN_MODELS, builtin_gguf  # noqa: PLC0415 (torch: only when the bench runs)

    gguf = builtin_gguf(model) if model in BUILTIN_MODELS else model
    pool = {"max_total_tokens": pool_tokens, "max_running_requests": 64}
    options = {
        "radixflow": {},
        "radixflow-int8": {"quantized_activations": "int8"},
        "radixflow-exact": {"quantized_activations": "fp32"},
        "radixflow-fp32": {"dequantize_weights": True},
        "radixflow-fixed": {"num_threads": threads},
        "radixflow-steps1": {"num_continuous_decode_steps": 1},
    }
    systems: dict[str, System] = {}
    for name in names:
        if name in options:
            engine = Engine(model_path=model, **pool, **options[name])
            systems[name] = RadixflowSystem(name, engine, owned=True)
        elif name == "llama.cpp" and os.environ.get("BENCH_LLAMA_CPP_PYTHON"):
            args = {"model_path": str(gguf), "n_ctx": pool_tokens, "threads": threads}
            python = os.environ["BENCH_LLAMA_CPP_PYTHON"]
            systems[name] = baselines.WorkerSystem("llama.cpp", python, args)
        else:
            print(f"skipped {name}: unknown, or BENCH_LLAMA_CPP_PYTHON unset", flush=True)
    return systems


def speed(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch  # noqa: PLC0415 (torch: only when the bench runs)

    from radixflow.bench.workloads import Call  # noqa: PLC0415 (torch: only when the bench runs)
    from radixflow.runtime.models.loader import resolve_model_dir  # noqa: PLC0415 (torch: only when the bench runs)
    from radixflow.runtime.tokenizer import load_tokenizer  # noqa: PLC0415 (torch: only when the bench runs)

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    tokenizer = load_tokenizer(resolve_model_dir(args.model))
    ids = [tuple(tokenizer.encode(chat(p), add_special_tokens=False)) for p in PROMPTS]
    systems = _systems(args.model, threads, args.systems.split(","), args.pool)
    rss = next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmRSS"))
    print(
        json.dumps(
            {
                "bench_process_rss_mib": round(rss / 1024),
                "cpu": _cpu(),
                "load_average": os.getloadavg(),
            }
        ),
        flush=True,
    )
    conditions = args.conditions.split(",")
    hog = Hog()
    rows = []
    try:
        for streams in [int(s) for s in args.streams.split(",")]:
            calls = [Call(ids[i % len(ids)], args.new_tokens) for i in range(streams)]
            times: dict[tuple[str, str], list[float]] = {
                (c, name): [] for c in conditions for name in systems
            }
            outputs: dict[str, Any] = {}
            for round_ in range(args.repeats + 1):  # round 0 warms every system up
                for condition in conditions:
                    hog.set(condition == "hog" and round_ > 0)
                    for name, system in systems.items():
                        if round_ and condition == "quiet":  # the last system's workers idle
                            wait_until_quiet(settle_s=0.5)
                        system.start_workload()
                        start = time.perf_counter()
                        result = system.run_round(calls)
                        elapsed = time.perf_counter() - start
                        if round_:
                            times[condition, name].append(elapsed)
                        outputs[name] = result.outputs
                hog.set(False)
            first = next(iter(systems))
            for (condition, name), t in times.items():
                median = statistics.median(t)
                row = {
                    "streams": streams,
                    "condition": condition,
                    "system": name,
                    "tokens_per_s": round(streams * args.new_tokens / median, 1),
                    "runs_s": [round(x, 3) for x in t],
                    f"same_output_as_{first}": outputs[name] == outputs[first],
                }
                base = times.get((condition, "llama.cpp"))
                if base:
                    row["vs_llama.cpp"] = round(statistics.median(base) / median, 2)
                quiet = times.get(("quiet", name))
                if condition != "quiet" and quiet:
                    row["share_of_quiet"] = round(statistics.median(quiet) / median, 2)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        hog.set(False)
        for system in systems.values():
            system.close()
    return rows


def prefill(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch  # noqa: PLC0415 (torch: only when the bench runs)

    from radixflow.bench.workloads import Call  # noqa: PLC0415 (torch: only when the bench runs)

    if args.threads:
        torch.set_num_threads(args.threads)
    systems = _systems(args.model, torch.get_num_threads(), args.systems.split(","), args.pool)
    print(json.dumps({"cpu": _cpu(), "load_average": os.getloadavg()}), flush=True)
    times: dict[str, list[float]] = {name: [] for name in systems}
    try:
        for round_ in range(args.repeats + 1):  # round 0 warms every system up
            rng = np.random.default_rng(round_)
            prompt = tuple(int(t) for t in rng.integers(1000, 30000, args.length))
            for name, system in systems.items():
                wait_until_quiet(settle_s=0.5)
                system.start_workload()
                start = time.perf_counter()
                system.run_round([Call(prompt, 1)])
                if round_:
                    times[name].append(time.perf_counter() - start)
    finally:
        for system in systems.values():
            system.close()
    rows = []
    for name, t in times.items():
        row = {"prompt_tokens": args.length, "system": name,
               "prompt_tokens_per_s": round(args.length / statistics.median(t), 1),
               "runs_s": [round(x, 2) for x in t]}  # fmt: skip
        if times.get("llama.cpp"):
            base = statistics.median(times["llama.cpp"])
            row["vs_llama.cpp"] = round(base / statistics.median(t), 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


LLAMA_LOAD_CHILD = """
import sys, time
start = time.perf_counter()
import llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=int(sys.argv[3]),
                      verbose=False)
llm("Hello", max_tokens=1, temperature=0)
print("first token", flush=True)
"""

LOAD_CHILD = """
import sys
from radixflow.runtime import Engine
engine = Engine(model_path=sys.argv[1], max_total_tokens=int(sys.argv[2]))
engine.generate("Hello", sampling_params={"max_new_tokens": 1, "temperature": 0})
print("first token", flush=True)
engine.shutdown()
"""


def _first_token_s(command: list[str]) -> float:
    """Seconds from spawning `command` to its line saying it has its first token (what
    happens after, shutdown and exit, is not timed)."""
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert child.stdout is not None
    for line in child.stdout:
        if line.startswith("first token"):
            elapsed = time.perf_counter() - start
            break
    else:
        raise RuntimeError(f"{command[0]} exited with {child.wait()} before its first token")
    child.stdout.close()
    child.wait()
    return elapsed


def load(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Seconds from a fresh process's start to its first generated token, per system."""
    from radixflow.runtime.models.loader import BUILTIN_MODELS, builtin_gguf  # noqa: PLC0415 (torch: only when the bench runs)

    gguf = str(builtin_gguf(args.model) if args.model in BUILTIN_MODELS else args.model)
    threads = args.threads or os.cpu_count() or 1
    commands = {"radixflow": [sys.executable, "-c", LOAD_CHILD, args.model, str(args.pool)]}
    if os.environ.get("BENCH_LLAMA_CPP_PYTHON"):
        commands["llama.cpp"] = [
            os.environ["BENCH_LLAMA_CPP_PYTHON"], "-c", LLAMA_LOAD_CHILD, gguf, str(args.pool),
            str(threads),
        ]  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.repeats):
        for name, command in commands.items():
            wait_until_quiet(settle_s=0.5)
            times[name].append(_first_token_s(command))
    rows = []
    for name, t in times.items():
        row = {"system": name, "load_to_first_token_s": round(statistics.median(t), 2),
               "runs_s": [round(x, 2) for x in t]}  # fmt: skip
        if times.get("llama.cpp"):
            base = statistics.median(times["llama.cpp"])
            row["vs_llama.cpp"] = round(statistics.median(t) / base, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


MEMORY_CHILD = """
import json, os, sys, time
start = time.perf_counter()
from radixflow.runtime import Engine
options = json.loads(sys.argv[3])
engine = Engine(model_path=sys.argv[1], max_total_tokens=int(sys.argv[2]), **options)
loaded = time.perf_counter() - start
engine.generate("Hello", sampling_params={"max_new_tokens": 4, "temperature": 0})
rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS"))
print(json.dumps({"rss_mib": round(rss / 1024, 1), "load_s": round(loaded, 1)}))
engine.shutdown()
"""


def memory(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    variants = {"quantized": {}, "fp32": {"dequantize_weights": True}}
    for name in args.variants.split(","):
        extra = variants[name]
        out = subprocess.run(
            [sys.executable, "-c", MEMORY_CHILD, args.model, str(args.pool), json.dumps(extra)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        row = {"variant": name, "pool_tokens": args.pool, **json.loads(out.stdout.splitlines()[-1])}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# ---- the synthetic 7B-class files -------------------------------------------------------

BIG = dict(hidden=4096, layers=32, heads=32, kv_heads=32, ffn=11008)


def _blocks(qtype: Any, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of `qtype` for a (rows, cols) matrix, scales set so each weight has a
    standard deviation near 1/sqrt(cols) (activations stay in range through 32 layers)."""
    import gguf  # noqa: PLC0415 (only when writing the files)

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    target = 1.0 / np.sqrt(cols)
    T = gguf.GGMLQuantizationType

    def put(offset: int, value: float) -> None:
        data[:, :, offset : offset + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)

    if qtype == T.Q4_0:
        put(0, target / 4.6)
    elif qtype == T.Q4_K:  # d, dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles
        put(0, target / (4.6 * 32))
        put(2, target / (4.6 * 32) / 4)
    elif qtype == T.Q6_K:  # 128 low bits, 64 high bits, 16 int8 scales, d
        data[:, :, 192:208] = rng.integers(1, 40, size=(rows, cols // block, 16), dtype=np.uint8)
        put(208, target / (18.5 * 23))
    else:
        raise ValueError(f"no random blocks for {qtype}")
    return data.reshape(rows, -1)


def write_big(path: Path, mix: str, seed: int = 0) -> Path:
    """A Llama-shaped GGUF with random blocks: mix 'q4_0' (every matrix Q4_0, the norms F32)
    or 'q4_k_m' (Q4_K, with v, down and the output in Q6_K)."""
    import gguf  # noqa: PLC0415 (only when writing the files)

    from radixflow.runtime.models.loader import builtin_gguf  # noqa: PLC0415 (torch: only when the bench runs)

    T = gguf.GGMLQuantizationType
    source = gguf.GGUFReader(str(builtin_gguf("smollm2")))
    c, rng = BIG, np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(c["layers"])
    writer.add_context_length(4096)
    writer.add_embedding_length(c["hidden"])
    writer.add_feed_forward_length(c["ffn"])
    writer.add_head_count(c["heads"])
    writer.add_head_count_kv(c["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(c["hidden"] // c["heads"])
    for key, field in source.fields.items():  # SmolLM2's tokenizer, as it ships
        if key.startswith("tokenizer."):
            value = field.contents()
            kind = field.types[0]
            if kind == gguf.GGUFValueType.ARRAY:
                writer.add_array(key, value)
            else:
                writer.add_key_value(key, value, kind)
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    base = T.Q4_0 if mix == "q4_0" else T.Q4_K
    heavy = T.Q4_0 if mix == "q4_0" else T.Q6_K
    h, f = c["hidden"], c["ffn"]
    plan: list[tuple[str, Any, int, int]] = [("token_embd.weight", base, vocab, h)]
    for i in range(c["layers"]):
        plan += [
            (f"blk.{i}.attn_norm.weight", T.F32, 1, h),
            (f"blk.{i}.attn_q.weight", base, h, h),
            (f"blk.{i}.attn_k.weight", base, h, h),
            (f"blk.{i}.attn_v.weight", heavy, h, h),
            (f"blk.{i}.attn_output.weight", base, h, h),
            (f"blk.{i}.ffn_norm.weight", T.F32, 1, h),
            (f"blk.{i}.ffn_gate.weight", base, f, h),
            (f"blk.{i}.ffn_up.weight", base, f, h),
            (f"blk.{i}.ffn_down.weight", heavy, h, f),
        ]
    plan += [("output_norm.weight", T.F32, 1, h), ("output.weight", heavy, vocab, h)]
    for name, qtype, rows, cols in plan:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        if qtype == T.F32:
            writer.add_tensor_info(name, (cols,), np.dtype(np.float32), cols * 4)
        else:
            nbytes = rows * cols // block * size
            writer.add_tensor_info(
                name, (rows, cols // block * size), np.dtype(np.uint8), nbytes, raw_dtype=qtype
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, qtype, rows, cols in plan:
        if qtype == T.F32:
            writer.write_tensor_data(np.ones(cols, dtype=np.float32))
        else:
            writer.write_tensor_data(_blocks(qtype, rows, cols, rng))
    writer.close()
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m radixflow.bench.quantized")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--model", default="smollm2")
    s.add_argument("--streams", default="1,16")
    s.add_argument("--new-tokens", type=int, default=128)
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--threads", type=int, default=0)
    s.add_argument("--systems", default="radixflow,radixflow-fp32,llama.cpp")
    s.add_argument("--pool", type=int, default=8192, help="KV tokens (llama.cpp: n_ctx)")
    s.add_argument("--conditions", default="quiet", help="quiet and/or hog (one busy process)")
    p = sub.add_parser("prefill")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--systems", default="radixflow,llama.cpp")
    p.add_argument("--pool", type=int, default=2048, help="KV tokens (llama.cpp: n_ctx)")
    ld = sub.add_parser("load")
    ld.add_argument("--model", default="smollm2")
    ld.add_argument("--repeats", type=int, default=3)
    ld.add_argument("--threads", type=int, default=0)
    ld.add_argument("--pool", type=int, default=2048)
    m = sub.add_parser("memory")
    m.add_argument("--model", default="smollm2")
    m.add_argument("--pool", type=int, default=2048)
    m.add_argument("--variants", default="quantized,fp32")
    w = sub.add_parser("write-big")
    w.add_argument("dir", type=Path)
    w.add_argument("--mix", default="q4_0,q4_k_m")
    args = parser.parse_args(argv)
    if args.command == "speed":
        speed(args)
    elif args.command == "prefill":
        prefill(args)
    elif args.command == "load":
        load(args)
    elif args.command == "memory":
        memory(args)
    else:
        args.dir.mkdir(parents=True, exist_ok=True)
        for mix in args.mix.split(","):
            start = time.perf_counter()
            path = write_big(args.dir / f"llama-7b-random-{mix}.gguf", mix)
            size = path.stat().st_size / 2**30
            print(f"{path}: {size:.2f} GiB in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
