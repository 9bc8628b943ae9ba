"""Few-shot question answering: one long shared prompt of examples, many questions.

    python programs/few_shot_qa.py [--address tcp://...] [--num-questions 64] [--compare-cache]

Runs the questions with run_batch. --compare-cache also starts a second local Runtime with
the radix cache disabled and times the same batch on both (the given or started server is
the cache-on side), reporting wall time, prefill tokens computed and cache hit rates.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import radixflow as sgl

EXAMPLES = [
    ("What is the capital of France?", "Paris"),
    ("What is 3 plus 4?", "7"),
    ("What color is the sky on a clear day?", "Blue"),
    ("What is the capital of Japan?", "Tokyo"),
    ("How many legs does a spider have?", "8"),
    ("What is 10 minus 2?", "8"),
    ("Which planet is known as the red planet?", "Mars"),
    ("What is the capital of Canada?", "Ottawa"),
    ("What do bees make?", "Honey"),
    ("What is 6 times 2?", "12"),
    ("What is the largest ocean on Earth?", "The Pacific Ocean"),
    ("What is the boiling point of water in Celsius?", "100"),
]
COUNTRIES = [
    "Germany", "Italy", "Spain", "Portugal", "Egypt", "Kenya", "Brazil", "Peru",
    "Chile", "India", "China", "Russia", "Norway", "Sweden", "Finland", "Poland",
    "Greece", "Turkey", "Mexico", "Cuba", "Ireland", "Austria", "Hungary", "Iran",
    "Iraq", "Vietnam", "Thailand", "Nigeria", "Ghana", "Morocco", "Argentina", "Australia",
]  # fmt: skip


def questions(num: int) -> list[str]:
    """`num` short questions: capitals, then sums."""
    capitals = [f"What is the capital of {c}?" for c in COUNTRIES]
    sums = [f"What is {a} plus {a % 7 + 2}?" for a in range(1, 1 + max(0, num - len(capitals)))]
    return (capitals + sums)[:num]


@sgl.function
def few_shot_qa(s: Any, question: str) -> None:
    s += "Answer each question with a word or a number.\n\n"
    for q, a in EXAMPLES:
        s += f"Question: {q}\nAnswer: {a}\n\n"
    s += f"Question: {question}\nAnswer:" + sgl.gen("answer", max_tokens=6, stop="\n")


def answer_all(backend: Any, qs: list[str], progress_bar: bool = False) -> dict[str, Any]:
    """Run the batch greedily; answers (in order), wall time and the server's counters."""
    before = sgl.get_server_info(backend)
    start = time.perf_counter()
    states = few_shot_qa.run_batch(
        [{"question": q} for q in qs], backend=backend, temperature=0, progress_bar=progress_bar
    )
    wall = time.perf_counter() - start
    after = sgl.get_server_info(backend)
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_tokens"] - before["cached_tokens"]
    return {
        "answers": [state["answer"].strip() for state in states],
        "wall_s": round(wall, 2),
        "prompt_tokens": prompt,
        "prefill_tokens_computed": after["prefill_tokens_computed"]
        - before["prefill_tokens_computed"],
        "cache_hit_rate": round(cached / prompt, 3) if prompt else 0.0,
    }


def compare_cache(backend: Any, qs: list[str]) -> dict[str, Any]:
    """The same batch on `backend` (cache on) and a fresh Runtime with the cache off."""
    from common import connect

    off, close = connect(None, disable_radix_cache=True)
    try:
        results = {}
        for name, target in (("radix_cache_on", backend), ("radix_cache_off", off)):
            few_shot_qa.run(question="warm up", backend=target, temperature=0).sync()
            sgl.flush_cache(target)
            results[name] = answer_all(target, qs)
    finally:
        close()
    on, off_result = results["radix_cache_on"], results["radix_cache_off"]
    results["speedup"] = round(off_result["wall_s"] / on["wall_s"], 2)
    results["same_answers"] = on["answers"] == off_result["answers"]
    return results


def main(
    backend: Any, num_questions: int = 64, compare: bool = False, progress_bar: bool = True
) -> dict[str, Any]:
    qs = questions(num_questions)
    if compare:
        return compare_cache(backend, qs)
    result = answer_all(backend, qs, progress_bar)
    result["questions"] = qs
    return result


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-questions", type=int, default=64)
    parser.add_argument("--compare-cache", dest="compare", action="store_true")


if __name__ == "__main__":
    from common import cli

    cli(main, __doc__, add_options)
