"""Every program in programs/ end to end on SmolLM2, through one real server per module.

Greedy and a few tokens each: these assert structure, types, regex/schema conformance and
branch counts, not the answers' quality (the model has 135M parameters).
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import radixflow as sgl

PROGRAMS = Path(__file__).resolve().parents[1] / "programs"
sys.path.insert(0, str(PROGRAMS))


def program(name: str) -> Any:
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def runtime() -> Any:
    runtime = sgl.Runtime(model_path="smollm2", max_total_tokens=8192)
    runtime.endpoint.timeout = 300.0  # the test machine's 2 cores may be shared
    yield runtime
    runtime.shutdown()


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


def test_tree_of_thought_nested_forks(runtime: Any) -> None:
    result = program("tree_of_thought").main(runtime, width=2, max_tokens=8)
    assert len(result["approaches"]) == 2 and all(isinstance(a, str) for a in result["approaches"])
    steps, verdicts = result["steps"], result["verdicts"]
    assert [len(row) for row in steps] == [2, 2] and [len(row) for row in verdicts] == [2, 2]
    assert all(isinstance(step, str) for row in steps for step in row)
    assert all(v in ("yes", "no") for row in verdicts for v in row)
    assert result["best"]["approach"] in result["approaches"]


def test_agent_calls_tool_and_branches_on_select(runtime: Any) -> None:
    agent = program("agent")
    results = agent.main(runtime)
    assert len(results) == len(agent.TASKS)
    for result in results:
        trace = result["trace"]
        assert 1 <= len(trace) <= 3 and isinstance(result["answer"], str)
        assert all(step["action"] in agent.ACTIONS for step in trace)
        assert trace[-1]["action"] == "finish" or len(trace) == 3
        for step in trace:
            if step["action"] == "calculator":
                assert re.fullmatch(agent.EXPRESSION, step["input"]), step
                assert step["observation"] == agent.calculator(step["input"])
    actions = [step["action"] for result in results for step in result["trace"]]
    assert "calculator" in actions and "finish" in actions, results


def test_json_extraction_conforms_to_schema(runtime: Any) -> None:
    extraction = program("json_extraction")
    records = extraction.main(runtime)
    assert len(records) == len(extraction.TEXTS)
    for record in records:
        assert extraction.conforms(record, extraction.SCHEMA), record
        assert set(record) == {"name", "age", "city"}


def test_skeleton_of_thought_parallel_branches(runtime: Any) -> None:
    result = program("skeleton_of_thought").main(runtime, num_points=3)
    assert len(result["points"]) == 3 and len(result["expansions"]) == 3
    assert all(isinstance(x, str) for x in result["points"] + result["expansions"])
    assert result["answer"].count("\n") == 2


def test_program_command_line(runtime: Any) -> None:
    address = runtime.endpoint.address
    out = subprocess.run(
        [sys.executable, str(PROGRAMS / "multi_turn_chat.py"), "--address", address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    printed = json.loads(out.stdout[: out.stdout.rindex("}") + 1])
    assert len(printed["answers"]) == 3
