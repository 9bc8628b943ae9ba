"""Tree-of-thought search with nested forks: approaches, then steps under each approach, each
step judged by the model with a select; the best-judged path is answered.

    python programs/tree_of_thought.py [--address tcp://...] [--width 2]

`join()` of nested forks gives nested lists: s["step"][i][j] is step j under approach i.
Every fork caches its shared text once, so the branches share the prefix in the runtime.
"""

from __future__ import annotations

import argparse
from typing import Any

import radixflow as sgl

QUESTION = "Tom has 3 apples and buys 5 more. He gives 2 away. How many apples does he have?"


@sgl.function
def tree_of_thought(s: Any, question: str, width: int = 2, max_tokens: int = 12) -> None:
    s += sgl.system("You solve problems carefully, one idea at a time.")
    s += sgl.user(question)
    approaches = s.fork(width)
    approaches += lambda i: sgl.assistant(
        f"Approach {i + 1}:" + sgl.gen("approach", max_tokens=max_tokens, stop="\n")
    )
    for approach in approaches:
        approach += sgl.user("Take the next step.")
        steps = approach.fork(width)
        steps += lambda j: sgl.assistant(
            f"Step {j + 1}:" + sgl.gen("step", max_tokens=max_tokens, stop="\n")
        )
        steps += sgl.user("Is this step correct? Answer yes or no.")
        steps += sgl.assistant(sgl.select("verdict", ["yes", "no"]))
        steps.join()
    approaches.join()


def best_path(verdicts: list[list[str]]) -> tuple[int, int]:
    """(approach, step) of the first step judged correct, else (0, 0)."""
    for i, row in enumerate(verdicts):
        for j, verdict in enumerate(row):
            if verdict == "yes":
                return i, j
    return 0, 0


def main(
    backend: Any, question: str = QUESTION, width: int = 2, max_tokens: int = 12
) -> dict[str, Any]:
    """The tree's texts and verdicts, the best path, and for every branch its prompt and
    cached token counts (approaches: a list; steps: a list per approach)."""
    from common import counter_deltas

    before = sgl.get_server_info(backend)
    state = tree_of_thought.run(question, width, max_tokens, backend=backend, temperature=0)
    i, j = best_path(state["verdict"])
    keys = ("prompt_tokens", "cached_tokens", "completion_tokens")
    return {
        "approaches": state["approach"],
        "steps": state["step"],
        "verdicts": state["verdict"],
        "best": {"approach": state["approach"][i], "step": state["step"][i][j]},
        "root_prompt": state.text(),
        "approach_tokens": [{k: m[k] for k in keys} for m in state.get_meta_info("approach")],
        "step_tokens": [
            [{k: m[k] for k in keys} for m in row] for row in state.get_meta_info("step")
        ],
        "server": counter_deltas(before, sgl.get_server_info(backend)),
    }


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--width", type=int, default=2, help="branches per level")


if __name__ == "__main__":
    from common import cli

    cli(main, __doc__, add_options)
