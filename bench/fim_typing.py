"""Code completion while typing, through llama.cpp's `/infill`: the radix cache on and off.

    python -m radixflow.bench.fim_typing [--model-path PATH] [--requests 50]
        [--context-tokens 2000] [--chars 3] [--max-tokens 8] [--modes cache,nocache]

An editor sends one infill per keystroke burst: the same repository context (other files,
about `--context-tokens` tokens) and the file being edited, whose prefix grows by `--chars`
characters each request while the suffix (the rest of the file) stays. Per mode (a server
with the radix cache, one with `--disable-radix-cache`) the requests go one after another,
streamed; reported: prefill tokens computed (prompt tokens minus those the cache held, summed
over the requests, from the server's `tokens_evaluated` and `tokens_cached`) and the median
and p90 time to the first streamed token, as the client sees it.

The model needs fill-in-the-middle tokens. `--model-path` takes any FIM model radixflow
serves (a coder GGUF, a Hugging Face directory); without it the run uses SmolLM2 (the only
model available offline) with StarCoder's four FIM token strings given to four of its unused
special tokens (`<issue_start>`, `<issue_comment>`, `<issue_closed>`, `<jupyter_start>`):
its completions are junk, but the prompts, the prefill work and the cache behaviour are those
of a 135M StarCoder-style model on the real quantized path.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from radixflow import Runtime
from radixflow.runtime.models.loader import resolve_model_dir

# SmolLM2's unused special tokens -> StarCoder's FIM tokens (same ids, new strings)
RENAMED = {
    "<issue_start>": "<fim_prefix>",
    "<issue_comment>": "<fim_middle>",
    "<issue_closed>": "<fim_suffix>",
    "<jupyter_start>": "<fim_pad>",
}
CHARS_PER_TOKEN = 3.5  # Python source through SmolLM2's tokenizer, roughly
NAMES = "parse load store index merge split render fetch count sort".split()


def smollm2_with_fim_tokens(root: Path) -> Path:
    """A copy of SmolLM2's converted directory (weights stay in the GGUF it points to) whose
    tokenizer calls four unused special tokens by StarCoder's FIM names."""
    source = resolve_model_dir("smollm2")
    target = root / "smollm2-fim"
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors"))
    path = target / "tokenizer.json"
    data = json.loads(path.read_text())
    for token in data["added_tokens"]:
        token["content"] = RENAMED.get(token["content"], token["content"])
    vocab = data["model"]["vocab"]
    for old, new in RENAMED.items():
        vocab[new] = vocab.pop(old)
    path.write_text(json.dumps(data))
    return target


def function(rng: random.Random, i: int) -> str:
    name, other = rng.choice(NAMES), rng.choice(NAMES)
    return (
        f"def {name}_{i}(items, limit={rng.randint(1, 99)}):\n"
        f'    """{name.title()} the items, at most limit of them."""\n'
        f"    out = []\n    for item in items[:limit]:\n"
        f"        out.append({other}_{max(i - 1, 0)}(item))\n    return out\n\n\n"
    )


def repository(context_tokens: int, seed: int = 0) -> list[dict[str, str]]:
    """Other files' chunks (llama.cpp's input_extra) of about `context_tokens` tokens."""
    rng = random.Random(seed)
    chunks, size, i = [], 0, 0
    while size < context_tokens * CHARS_PER_TOKEN:
        text = "".join(function(rng, i + j) for j in range(8))
        chunks.append({"filename": f"pkg/module_{len(chunks)}.py", "text": text})
        size, i = size + len(text), i + 8
    return chunks


def typing_requests(requests: int, chars: int, context_tokens: int) -> list[dict[str, Any]]:
    """The infill bodies: the prefix grows by `chars` characters each time."""
    extra = repository(context_tokens)
    rng = random.Random(1)
    typed = "".join(function(rng, 1000 + j) for j in range(1 + requests * chars // 200))
    head = "import os\nimport sys\n\n\n"
    tail = "\n\ndef main():\n    return 0\n"
    return [
        {
            "input_extra": extra,
            "input_prefix": head + typed[: chars * (k + 1)],
            "input_suffix": tail,
            "stream": True,
            "temperature": 0,
        }  # fmt: skip
        for k in range(requests)
    ]


def infill(http: httpx.Client, body: dict[str, Any], max_tokens: int) -> tuple[float, dict]:
    """(seconds to the first streamed event, the final object)."""
    start, first, final = time.perf_counter(), None, {}
    with http.stream("POST", "/infill", json={**body, "n_predict": max_tokens}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            first = first if first is not None else time.perf_counter() - start
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"infill failed: {event['error']}")
            if event.get("stop"):
                final = event
    assert first is not None and final, "the stream ended without its final object"
    return first, final


def run_mode(model_path: str, mode: str, bodies: list[dict], max_tokens: int) -> dict[str, Any]:
    config = {"disable_radix_cache": mode == "nocache"}
    with (
        Runtime(model_path=model_path, log_level="warning", **config) as runtime,
        httpx.Client(base_url=runtime.url, timeout=600) as http,
    ):
        infill(http, {**bodies[0], "input_extra": []}, 1)  # warm up, sharing nothing
        ttfts, computed, prompt = [], 0, 0
        for body in bodies:
            ttft, final = infill(http, body, max_tokens)
            ttfts.append(ttft)
            computed += final["tokens_evaluated"] - final["tokens_cached"]
            prompt += final["tokens_evaluated"]
    ordered = sorted(ttfts)
    return {
        "mode": mode,
        "requests": len(bodies),
        "prompt_tokens": prompt,
        "prefill_tokens_computed": computed,
        "ttft_median_ms": 1e3 * statistics.median(ttfts),
        "ttft_p90_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default="", help="a FIM model (default: see above)")
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--context-tokens", type=int, default=2000)
    parser.add_argument("--chars", type=int, default=3, help="characters typed per request")
    parser.add_argument("--max-tokens", type=int, default=8, help="n_predict of each infill")
    parser.add_argument("--modes", default="cache,nocache")
    parser.add_argument("--json", default="", help="also write the rows to this file")
    args = parser.parse_args(argv)
    bodies = typing_requests(args.requests, args.chars, args.context_tokens)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model_path or str(smollm2_with_fim_tokens(Path(tmp)))
        for mode in args.modes.split(","):
            rows.append(run_mode(model, mode, bodies, args.max_tokens))
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
