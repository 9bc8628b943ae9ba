"""Every program in programs/ end to end on SmolLM2, through one real server per module.

Greedy and a few tokens each: these assert structure, types, regex/schema conformance and
branch counts, not the answers' quality (the model has 135M parameters).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import emptied

PROGRAMS = Path(__file__).resolve().parents[1] / "programs"
sys.path.insert(0, str(PROGRAMS))


def program(name: str) -> Any:
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def runtime(shared_server: Any) -> Any:
    return emptied(
        shared_server
    )  # its endpoint waits 300 s: the test machine's 2 cores may be shared


def test_multi_turn_chat(runtime: Any) -> None:
    result = program("multi_turn_chat").main(runtime, max_tokens=8)
    roles = [m["role"] for m in result["messages"]]
    assert roles == ["system"] + ["user", "assistant"] * 3  # SmolLM2's default system prompt
    assert all(isinstance(a, str) and a.strip() for a in result["answers"])
    assert not any("<|im_end|>" in a or "<|im_start|>" in a for a in result["answers"])
    replies = [m["content"] for m in result["messages"][2::2]]
    assert replies == [a.lstrip() for a in result["answers"]]
    cached = result["cached_tokens"]
    assert 0 < cached[1] < cached[2], "later turns reuse the conversation from the cache"


def test_few_shot_qa(runtime: Any) -> None:
    qa = program("few_shot_qa")
    result = qa.main(runtime, num_questions=8, progress_bar=False)
    assert result["questions"] == qa.questions(8)
    assert len(result["answers"]) == 8 and all(isinstance(a, str) for a in result["answers"])
    assert not any("\n" in a for a in result["answers"])  # stop="\n"
    assert result["cache_hit_rate"] > 0.6, result  # the examples are shared by all questions
    assert result["prefill_tokens_computed"] < result["prompt_tokens"] / 2


# A branch's own text is a role header and a few words; its prefix must come from the cache.
OWN_TOKENS = 16


def test_tree_of_thought_nested_forks(runtime: Any) -> None:
    result = program("tree_of_thought").main(runtime, width=2, max_tokens=8)
    assert len(result["approaches"]) == 2 and all(isinstance(a, str) for a in result["approaches"])
    steps, verdicts = result["steps"], result["verdicts"]
    assert [len(row) for row in steps] == [2, 2] and [len(row) for row in verdicts] == [2, 2]
    assert all(isinstance(step, str) for row in steps for step in row)
    assert all(v in ("yes", "no") for row in verdicts for v in row)
    # Both levels of forks reuse their shared prefix: each branch computes only its own text.
    root = len(runtime.get_tokenizer().encode(result["root_prompt"], add_special_tokens=False))
    for branch in result["approach_tokens"]:
        assert branch["cached_tokens"] >= root - 1, (root, branch)
    for row, approach in zip(result["step_tokens"], result["approach_tokens"]):
        for branch in row:  # under an approach: the root, the approach and its follow-up
            assert branch["cached_tokens"] >= approach["prompt_tokens"], (approach, branch)
            assert branch["prompt_tokens"] - branch["cached_tokens"] <= OWN_TOKENS, branch


def test_best_path_is_the_first_step_judged_correct() -> None:
    best_path = program("tree_of_thought").best_path
    assert best_path([["no", "no"], ["no", "yes"]]) == (1, 1)
    assert best_path([["no", "yes"], ["yes", "no"]]) == (0, 1)
    assert best_path([["no", "no"], ["no", "no"]]) == (0, 0)


def test_agent_calls_tool_and_branches_on_select(runtime: Any) -> None:
    agent = program("agent")
    calls: list[str] = []

    def tool(expression: str) -> int:  # a tool whose answers the model cannot guess
        calls.append(expression)
        return 7000 + len(calls)

    results = agent.main(runtime, tool=tool)
    assert len(results) == len(agent.TASKS)
    inputs = []
    for result in results:
        trace = result["trace"]
        assert 1 <= len(trace) <= 3 and isinstance(result["answer"], str)
        assert all(step["action"] in agent.ACTIONS for step in trace)
        assert trace[-1]["action"] == "finish" or len(trace) == 3
        for step in trace:
            if step["action"] == "calculator":
                assert re.fullmatch(agent.EXPRESSION, step["input"]), step
                inputs.append(step["input"])
                assert 7000 < step["observation"] <= 7000 + len(calls)
    assert sorted(inputs) == sorted(calls), "every tool call is in a trace, once"
    actions = [step["action"] for result in results for step in result["trace"]]
    assert "calculator" in actions and "finish" in actions, results
    # The program fed the tool's answer back: the model answers with the observed number.
    used = [r for r in results if any(str(s.get("observation")) in r["answer"] for s in r["trace"])]
    assert used, results


def test_json_extraction_conforms_to_schema(runtime: Any) -> None:
    extraction = program("json_extraction")
    records = extraction.main(runtime)
    assert len(records) == len(extraction.TEXTS)
    for record in records:
        assert extraction.conforms(record, extraction.SCHEMA), record
        assert set(record) == {"name", "age", "city"}


def test_skeleton_of_thought_parallel_branches(runtime: Any) -> None:
    result = program("skeleton_of_thought").main(runtime, num_points=3, max_tokens=16)
    assert len(result["points"]) == 3 and len(result["expansions"]) == 3
    assert all(isinstance(x, str) and x for x in result["points"] + result["expansions"])
    branches, server = result["branches"], result["server"]
    # The text before the fork is prefilled once: every branch finds all of it cached.
    shared = len(runtime.get_tokenizer().encode(result["shared_prompt"], add_special_tokens=False))
    assert all(b["cached_tokens"] >= shared - 1 for b in branches), (shared, branches)
    assert server["prefill_tokens_computed"] <= server["prompt_tokens"] - 3 * (shared - 1)
    # The branches decode in the same steps: the run takes the outline's steps, one for the
    # fork's prefix, and about the longest branch's; run one after another they would take
    # the sum of the branches' tokens.
    expansion = [b["completion_tokens"] for b in branches]
    slack = 4  # branches that arrive a step or two apart
    assert sum(expansion) - max(expansion) > slack, expansion  # else the check below is moot
    bound = sum(result["outline_tokens"]) + 1 + max(expansion) + slack
    assert server["forward_steps"] <= bound, (server, result["outline_tokens"], expansion)


def test_program_command_line(runtime: Any) -> None:
    address = runtime.endpoint.address
    out = subprocess.run(
        [sys.executable, str(PROGRAMS / "multi_turn_chat.py"), "--address", address],
        env={k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"},  # a script's folder
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    printed = json.loads(out.stdout[: out.stdout.rindex("}") + 1])
    assert len(printed["answers"]) == 3
