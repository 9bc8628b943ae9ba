"""Multi-turn chat: each turn is a user message and a generated assistant reply.

    python programs/multi_turn_chat.py [--address tcp://127.0.0.1:30000]

Every turn resends the whole conversation, so from the second turn on the runtime's radix
cache serves the earlier turns (see each answer's cached_tokens).
"""

from __future__ import annotations

from typing import Any

import radixflow as sgl

TURNS = [
    "Hi! What is the capital of France?",
    "And what is the capital of Italy?",
    "Which of the two cities is larger?",
]


@sgl.function
def multi_turn_chat(s: Any, turns: list[str], max_tokens: int = 16) -> None:
    for i, question in enumerate(turns):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen(f"answer_{i}", max_tokens=max_tokens))


def main(backend: Any, turns: list[str] | None = None, max_tokens: int = 16) -> dict[str, Any]:
    """Run one conversation greedily; its messages, answers and cached tokens per turn."""
    turns = turns or TURNS
    state = multi_turn_chat.run(turns, max_tokens, backend=backend, temperature=0)
    return {
        "messages": state.messages(),
        "answers": [state[f"answer_{i}"] for i in range(len(turns))],
        "cached_tokens": [
            state.get_meta_info(f"answer_{i}").get("cached_tokens", 0) for i in range(len(turns))
        ],
    }


if __name__ == "__main__":
    from common import cli

    cli(main, __doc__)
