"""lm-evaluation-harness against `radixflow serve`: its `local-completions` model scores a
small multiple-choice task (loglikelihood requests: /v1/completions with echo and logprobs)
and its `hf` model scores the same task on the same checkpoint through transformers; the
accuracies should agree within noise, and so should the per-choice loglikelihoods.

    python -m radixflow.bench.lm_eval_check --lm-eval-python /path/to/venv/bin/python

lm-eval runs in its own environment (it pins packages of its own); the task's questions are
written here to a local JSON-lines file (no hub), from fixed tables: capitals, small sums,
opposites. Prints one JSON line per model and a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from radixflow.runtime.models.loader import builtin_gguf, resolve_model_dir

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
    "Japan": "Tokyo", "China": "Beijing", "Russia": "Moscow", "Egypt": "Cairo",
    "Canada": "Ottawa", "Greece": "Athens", "Portugal": "Lisbon", "Ireland": "Dublin",
    "Austria": "Vienna", "Norway": "Oslo", "Sweden": "Stockholm", "Poland": "Warsaw",
    "Kenya": "Nairobi", "Peru": "Lima", "Cuba": "Havana", "Thailand": "Bangkok",
}  # fmt: skip
OPPOSITES = {
    "hot": "cold", "up": "down", "big": "small", "fast": "slow", "early": "late",
    "happy": "sad", "light": "dark", "open": "closed", "full": "empty", "old": "new",
    "wet": "dry", "hard": "soft", "high": "low", "rich": "poor", "strong": "weak",
}  # fmt: skip
TASK = "radixflow_local_mc"


def items(seed: int = 0) -> list[dict[str, Any]]:
    """Four-way questions: the answer and three distractors of the same kind."""
    rng = random.Random(seed)
    out = []
    for country, city in CAPITALS.items():
        others = rng.sample([c for c in CAPITALS.values() if c != city], 3)
        out.append(mc(f"The capital of {country} is", city, others, rng))
    for word, opposite in OPPOSITES.items():
        others = rng.sample([o for o in OPPOSITES.values() if o != opposite], 3)
        out.append(mc(f"The opposite of {word} is", opposite, others, rng))
    for _ in range(25):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        wrong = rng.sample([n for n in range(2, 19) if n != a + b], 3)
        out.append(mc(f"{a} + {b} =", str(a + b), [str(n) for n in wrong], rng))
    return out


def mc(question: str, answer: str, others: list[str], rng: random.Random) -> dict[str, Any]:
    choices = [answer, *others]
    rng.shuffle(choices)
    return {"question": question, "choices": choices, "answer": choices.index(answer)}


def write_task(folder: Path) -> None:
    data = folder / "items.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in items()))
    (folder / f"{TASK}.yaml").write_text(
        textwrap.dedent(f"""\
        task: {TASK}
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {data}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "{{{{question}}}}"
        doc_to_choice: choices
        doc_to_target: answer
        metric_list:
          - metric: acc
        """)
    )


def run_lm_eval(python: str, folder: Path, model: str, model_args: str) -> dict[str, Any]:
    out = folder / f"out-{model}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    command = [python, "-m", "lm_eval", "--model", model, "--model_args", model_args,
               "--tasks", TASK, "--include_path", str(folder), "--output_path", str(out),
               "--log_samples", "--batch_size", "8"]  # fmt: skip
    subprocess.run(command, check=True, env=env, cwd=folder)
    results = next(out.rglob("results_*.json"))
    samples = next(out.rglob(f"samples_{TASK}_*.jsonl"))
    acc = json.loads(results.read_text())["results"][TASK]["acc,none"]
    scores = [
        [float(r[0]) for r in json.loads(line)["filtered_resps"]]
        for line in samples.read_text().splitlines()
    ]
    return {"model": model, "acc": acc, "scores": scores}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lm-eval-python", required=True, help="python of lm-eval's venv")
    parser.add_argument("--model", default="smollm2")
    args = parser.parse_args(argv)
    gguf = builtin_gguf(args.model)
    model_dir = resolve_model_dir(args.model)
    folder = Path(tempfile.mkdtemp(prefix="radixflow-lm-eval-"))
    write_task(folder)
    server = subprocess.Popen(
        [sys.executable, "-m", "radixflow.runtime", "serve", "--model", args.model,
         "--port", "0", "--log-level", "warning"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        url = next(line.split()[3] for line in server.stdout if line.startswith("radixflow ready"))
        ours = run_lm_eval(
            args.lm_eval_python, folder, "local-completions",
            f"model={args.model},base_url={url}/v1/completions,tokenizer={model_dir},"
            "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1",
        )  # fmt: skip
    finally:
        server.terminate()
        server.wait(60)
    hf = run_lm_eval(
        args.lm_eval_python, folder, "hf",
        f"pretrained={gguf.parent},gguf_file={gguf.name},dtype=float32,tokenizer={model_dir}",
    )  # fmt: skip
    diffs = [abs(a - b) for x, y in zip(ours["scores"], hf["scores"]) for a, b in zip(x, y)]
    n = len(ours["scores"])
    stderr = (ours["acc"] * (1 - ours["acc"]) / n) ** 0.5
    print(json.dumps({"questions": n, "radixflow_acc": ours["acc"], "hf_acc": hf["acc"],
                      "acc_stderr": round(stderr, 4), "max_loglikelihood_diff": max(diffs),
                      "mean_loglikelihood_diff": sum(diffs) / len(diffs)}))  # fmt: skip


if __name__ == "__main__":
    main()
