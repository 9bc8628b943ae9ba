"""The think block's budget: a request whose reply has not written its `thinking_end` within
`max_thinking_tokens` output tokens gets the end written for it (forced tokens, extended the
next step like jumped ones), and the reply goes on after it; the doors set the budget from
reasoning_effort (low, medium), Anthropic's budget_tokens and Ollama's think levels.
SmolLM2 never writes </think> itself, so every end found here was the budget's."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from chat_templates import TEMPLATES, chat_tokenizer

from conftest import chat
from radixflow.runtime.protocol.sampling import SamplingParams
from radixflow.runtime.server.anthropic_request import chat_body
from radixflow.runtime.server.chat import EFFORT_BUDGETS, plan_chat
from radixflow.runtime.server.tool_calls import ToolError

PROMPT = chat("Think step by step: what is 17 times 3?")
GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


def test_the_budget_writes_the_end_and_the_reply_goes_on(engine: Any) -> None:
    budget = {"max_thinking_tokens": 8, "thinking_end": "</think>"}
    free = engine.generate(PROMPT, GREEDY)
    bounded = engine.generate(PROMPT, {**GREEDY, **budget})
    close = engine.tokenizer.encode("\n</think>\n\n", add_special_tokens=False)
    assert "</think>" not in free["text"]  # the model does not end a block on its own
    assert bounded["output_ids"][:8] == free["output_ids"][:8]  # the thinking, unchanged
    assert bounded["output_ids"][8 : 8 + len(close)] == close
    assert len(bounded["output_ids"]) == GREEDY["max_new_tokens"]  # and then the answer
    assert bounded["text"].index("</think>") > 0
    tail = engine.generate(PROMPT, {**GREEDY, "max_thinking_tokens": 30, "thinking_end": "x"})
    assert tail["output_ids"] == free["output_ids"]  # a budget not reached changes nothing


@pytest.mark.parametrize(
    "params, name",
    [
        ({"max_thinking_tokens": 5}, "max_thinking_tokens"),  # a budget needs its end
        ({"max_thinking_tokens": "5", "thinking_end": "x"}, "max_thinking_tokens"),
        ({"max_thinking_tokens": True, "thinking_end": "x"}, "max_thinking_tokens"),
        ({"max_thinking_tokens": -1, "thinking_end": "x"}, "max_thinking_tokens"),
        ({"thinking_end": [-1]}, "thinking_end"),  # the fuzzer's: it once crashed a step
    ],
)
def test_budget_fields_are_checked_at_the_edge(params: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams.from_dict(params)


def plan(body: dict[str, Any]) -> Any:
    tokenizer = chat_tokenizer("qwen3")
    tokenizer.chat_template = TEMPLATES["qwen3"]
    config = SimpleNamespace(tool_call_parser="", reasoning_parser="qwen3")
    messages = [{"role": "user", "content": "Hi"}]
    return plan_chat({"messages": messages, **body}, tokenizer, config)


@pytest.mark.parametrize(
    "body, budget",
    [
        ({"reasoning_effort": "low"}, EFFORT_BUDGETS["low"]),
        ({"reasoning_effort": "medium"}, EFFORT_BUDGETS["medium"]),
        ({"reasoning_effort": "high"}, None),
        ({}, None),
        ({"thinking_budget": 77}, 77),
        ({"thinking_budget": 77, "reasoning_effort": "low"}, 77),
    ],
)
def test_the_doors_budget_reaches_the_sampling(body: dict, budget: int | None) -> None:
    params = plan(body).sampling({"max_new_tokens": 2000})
    assert params.get("max_thinking_tokens") == budget
    if budget is not None:
        assert params["thinking_end"] == "</think>"


def test_no_budget_without_thinking() -> None:
    off = plan({"reasoning_effort": "none"}).sampling({})
    assert "max_thinking_tokens" not in off
    off = plan({"thinking_budget": 50, "chat_template_kwargs": {"enable_thinking": False}})
    assert "max_thinking_tokens" not in off.sampling({})
    with pytest.raises(ToolError, match="thinking_budget"):
        plan({"thinking_budget": 0})


def test_anthropics_budget_tokens_is_the_budget() -> None:
    body = {"model": "m", "max_tokens": 500, "messages": [{"role": "user", "content": "Hi"}],
            "thinking": {"type": "enabled", "budget_tokens": 300}}  # fmt: skip
    chat = chat_body(body, 4096)
    assert plan(chat).sampling({})["max_thinking_tokens"] == 300
