"""Grammar backends side by side: compile time and per-token mask time of outlines-core and
llguidance on the grammars radixflow serves (the json_decode workload's schema, any JSON object,
tool-call grammars built from tool schemas, a regex, an EBNF grammar), on the default model's
tokenizer. Each grammar walks a valid document token by token: one mask and one accept a token.

    python -m radixflow.bench.grammar_backends [--model smollm2] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np

from radixflow.bench.workloads import PERSON_SCHEMA
from radixflow.runtime.constrained.grammar import GrammarBackend
from radixflow.runtime.constrained.llg_backend import LlgBackend
from radixflow.runtime.models.loader import resolve_model_dir
from radixflow.runtime.server.tool_calls import Tool, get_format
from radixflow.runtime.tokenizer import load_tokenizer

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string"},
        "filters": {
            "type": "object",
            "properties": {"site": {"type": "string"}, "year": {"type": "integer"}},
        },
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["query"],
}
TOOLS = [Tool("get_weather", "", WEATHER), Tool("search", "", SEARCH)]
PERSON = {"name": "Ada", "age": 41, "city": "Oslo"}
NESTED = {"a": [1, {"b": None}], "c": "d"}
ARITHMETIC = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+ | "(" expr ")"'


def cases() -> list[tuple[str, tuple[str, str], str]]:
    """(name, grammar key, a valid document)."""
    call = {"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "unit": "celsius"}}
    generic = get_format("generic").grammar(TOOLS, parallel=False)["regex"]
    hermes = get_format("hermes").grammar(TOOLS, parallel=False)["regex"]
    return [
        ("json_decode schema", ("json", PERSON_SCHEMA), json.dumps(PERSON)),
        ("json_object (any)", ("json", '{"type": "object"}'), json.dumps(NESTED)),
        ("tool call, generic", ("regex", generic), json.dumps({"tool_calls": [call]})),
        ("tool call, hermes", ("regex", hermes), f"<tool_call>\n{json.dumps(call)}\n</tool_call>"),
        ("regex (date)", ("regex", r"\d{4}-\d{2}-\d{2}"), "2026-12-03"),
        ("ebnf (arithmetic)", ("ebnf", ARITHMETIC), "12+(3-4)+5"),
    ]


def walk(backend: Any, key: tuple[str, str], ids: list[int]) -> tuple[float, list[float]]:
    """(seconds to a ready grammar, seconds of each mask + accept)."""
    start = time.perf_counter()
    grammar = backend.get(key, timeout=600)
    compiled = time.perf_counter() - start
    row = np.zeros(grammar.words, dtype=np.int32)
    steps = []
    for token in ids:
        t = time.perf_counter()
        grammar.fill_mask(row)
        grammar.accept(token)
        steps.append(time.perf_counter() - t)
    return compiled, steps


def measure(model: str, repeats: int) -> list[dict[str, Any]]:
    tokenizer = load_tokenizer(resolve_model_dir(model, None))
    vocab, eos = len(tokenizer), (tokenizer.eos_token_id,)
    rows = []
    for name, key, text in cases():
        ids = tokenizer.encode(text, add_special_tokens=False)
        for label in ("outlines", "llguidance"):
            if label == "outlines" and key[0] == "ebnf":
                rows.append({"grammar": name, "backend": label, "supported": False})
                continue
            compiles, masks = [], []
            for _ in range(repeats):  # a new backend each time: nothing cached
                backend = (GrammarBackend if label == "outlines" else LlgBackend)(
                    tokenizer, vocab, eos
                )
                compiled, steps = walk(backend, key, ids)
                backend.shutdown()
                compiles.append(compiled)
                masks.append(statistics.median(steps))
            rows.append({
                "grammar": name, "backend": label, "supported": True, "tokens": len(ids),
                "compile_ms": 1e3 * statistics.median(compiles),
                "mask_us": 1e6 * statistics.median(masks),
            })  # fmt: skip
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| grammar | backend | compile ms | mask + accept us/token |")
    print("| --- | --- | ---: | ---: |")
    for r in rows:
        if not r["supported"]:
            print(f"| {r['grammar']} | {r['backend']} | not supported | |")
            continue
        print(f"| {r['grammar']} | {r['backend']} | {r['compile_ms']:.1f} | {r['mask_us']:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    rows = measure(args.model, args.repeats)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
