"""A tool-using agent: the model picks an action with select, Python branches on it, a
calculator tool runs the model's (regex-constrained) expression, the observation goes back.

    python programs/agent.py [--address tcp://...]

Reading s["action_k"] inside the program is a sync point: the loop waits for the model's
choice, then decides in Python whether to call the tool or to finish.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import radixflow as sgl

ACTIONS = ["calculator", "finish"]
EXPRESSION = r"[0-9]{1,4} [-+*] [0-9]{1,4}"
PROMPT = """You solve tasks. Each step, choose an action: calculator or finish.

Task: What is 12 times 4?
Action: calculator
Input: 12 * 4
Observation: 48
Action: finish
Answer: 48

Task: Sam had 30 coins and spent 12. How many are left?
Action: calculator
Input: 30 - 12
Observation: 18
Action: finish
Answer: 18

"""
TASKS = [
    "What is 25 plus 17?",
    "A box holds 6 rows of 7 eggs. How many eggs are there?",
    "Ann had 50 stickers and gave away 21. How many does she have now?",
]


def calculator(expression: str) -> int:
    """The tool: evaluate `a op b`. Raises ValueError for anything else."""
    match = re.fullmatch(r"\s*(\d+)\s*([-+*])\s*(\d+)\s*", expression)
    if match is None:
        raise ValueError(f"not an expression: {expression!r}")
    a, op, b = int(match[1]), match[2], int(match[3])
    return a + b if op == "+" else a - b if op == "-" else a * b


@sgl.function
def agent(
    s: Any, task: str, max_steps: int = 3, tool: Callable[[str], int] = calculator
) -> list[dict[str, Any]]:
    trace = []
    s += PROMPT + f"Task: {task}\n"
    for k in range(max_steps):
        s += "Action: " + sgl.select(f"action_{k}", ACTIONS) + "\n"
        if s[f"action_{k}"] == "finish":
            trace.append({"action": "finish"})
            break
        s += "Input: " + sgl.gen(f"input_{k}", max_tokens=16, regex=EXPRESSION) + "\n"
        expression = s[f"input_{k}"]
        result = tool(expression)
        trace.append({"action": "calculator", "input": expression, "observation": result})
        s += f"Observation: {result}\n"
    s += "Answer:" + sgl.gen("answer", max_tokens=8, stop="\n")
    return trace


def main(
    backend: Any, tasks: list[str] | None = None, tool: Callable[[str], int] = calculator
) -> list[dict[str, Any]]:
    """Run the agent on each task (in parallel); the trace of actions and the answer."""
    tasks = tasks or TASKS
    args = [{"task": t, "tool": tool} for t in tasks]
    states = agent.run_batch(args, backend=backend, temperature=0)
    return [
        {"task": t, "trace": state.ret_value, "answer": state["answer"].strip()}
        for t, state in zip(tasks, states)
    ]


if __name__ == "__main__":
    from common import cli

    cli(main, __doc__)
