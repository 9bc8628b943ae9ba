"""Skeleton-of-thought: the model writes a short outline, then every point is expanded in
its own forked branch; the branches decode in parallel in the same batches.

    python programs/skeleton_of_thought.py [--address tcp://...] [--num-points 3]
"""

from __future__ import annotations

import argparse
from typing import Any

import radixflow as sgl

QUESTION = "How can I sleep better at night?"


@sgl.function
def skeleton_of_thought(s: Any, question: str, num_points: int = 3, max_tokens: int = 16) -> None:
    s += sgl.system("You answer with a short numbered outline, then expand each point.")
    s += sgl.user(f"{question} Give exactly {num_points} short points.")
    with s.assistant():
        for i in range(num_points):
            s += f"{i + 1}." + sgl.gen(f"point_{i}", max_tokens=8, stop="\n") + "\n"
    branches = s.fork(num_points)
    branches += lambda i: (
        sgl.user(f"Expand point {i + 1} in one sentence.")
        + sgl.assistant(sgl.gen("expansion", max_tokens=max_tokens, stop="\n"))
    )
    branches.join()


def main(
    backend: Any, question: str = QUESTION, num_points: int = 3, max_tokens: int = 16
) -> dict[str, Any]:
    """The outline and its expansions, with what the server did for them: the text shared
    by the branches, each branch's token counts, and the server's counters for the run."""
    from common import counter_deltas

    before = sgl.get_server_info(backend)
    state = skeleton_of_thought.run(
        question, num_points, max_tokens, backend=backend, temperature=0
    )
    points = [state[f"point_{i}"].strip() for i in range(num_points)]
    expansions = [e.strip() for e in state["expansion"]]
    answer = "\n".join(f"{i + 1}. {p} {e}" for i, (p, e) in enumerate(zip(points, expansions)))
    keys = ("prompt_tokens", "cached_tokens", "completion_tokens")
    return {
        "points": points,
        "expansions": expansions,
        "answer": answer,
        "shared_prompt": state.text(),  # gather_variable leaves the text at the fork
        "outline_tokens": [
            state.get_meta_info(f"point_{i}")["completion_tokens"] for i in range(num_points)
        ],
        "branches": [{k: m[k] for k in keys} for m in state.get_meta_info("expansion")],
        "server": counter_deltas(before, sgl.get_server_info(backend)),
    }


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-points", type=int, default=3)


if __name__ == "__main__":
    from common import cli

    cli(main, __doc__, add_options)
