"""Tool calling through the official `openai` client, on SmolLM2 (its template knows no tools:
the generic format, every reply under a grammar): a whole tool loop, tool_choice auto,
required and named, streamed and not, and required/named calls over random tool schemas that
all parse and validate against their tool's parameters (6 here, 200 with -m slow)."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
from test_tool_calls import random_schema
from transformers import AutoTokenizer

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
SEARCH = {
    "type": "object",
    "properties": {"query": {"type": "string", "maxLength": 60}},
    "required": ["query"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search", "description": "Search the web",
                                      "parameters": SEARCH}},
]  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PARAMS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@pytest.fixture(scope="module")
def client(shared_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{shared_server.url}/v1", api_key="none", timeout=600)


def valid_calls(message, params: dict) -> list[tuple[str, dict]]:
    """The message's calls, each checked: a known tool, arguments valid for it."""
    calls = []
    for call in message.tool_calls or []:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, params[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"
        calls.append((call.function.name, arguments))
    return calls


def test_tool_loop_required_then_answer(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=96,
        temperature=0,
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = valid_calls(choice.message, PARAMS)
    assert calls, choice.message
    call = choice.message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "name": call.function.name,
         "content": json.dumps({"temperature": 18, "sky": "clear"})},
    ]  # fmt: skip
    final = client.chat.completions.create(
        model="smollm2", messages=history, tools=TOOLS, tool_choice="none", max_tokens=32,
        temperature=0,
    )  # fmt: skip
    answer = final.choices[0]
    assert answer.message.tool_calls is None and answer.finish_reason in ("stop", "length")
    assert answer.message.content and "tool_calls" not in answer.message.content


def test_named_choice_calls_that_tool(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, max_tokens=96, temperature=0,
        tool_choice={"type": "function", "function": {"name": "search"}},
    )  # fmt: skip
    calls = valid_calls(reply.choices[0].message, PARAMS)
    assert calls and all(name == "search" for name, _ in calls)


def test_auto_gives_a_call_or_an_answer_that_parses(client: openai.OpenAI) -> None:
    for messages in (ASK, [{"role": "user", "content": "Say hello."}]):
        reply = client.chat.completions.create(
            model="smollm2", messages=messages, tools=TOOLS, max_tokens=96, temperature=0
        )
        message = reply.choices[0].message
        if message.tool_calls:
            assert valid_calls(message, PARAMS) and reply.choices[0].finish_reason == "tool_calls"
        else:  # an answer: its text, not the JSON object the grammar wrapped it in
            assert isinstance(message.content, str) and not message.content.startswith("{")


def test_streamed_call_arrives_as_tool_call_deltas(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=96,
        temperature=0, stream=True,
    )  # fmt: skip
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and calls
    for entry in calls.values():
        jsonschema.validate(json.loads(entry["arguments"]), PARAMS[entry["name"]])


def test_two_parallel_calls_in_one_reply(client: openai.OpenAI) -> None:
    """parallel_tool_calls: the generic reply's list takes several calls; tokens that would close
    it are biased away, so the 135M model writes a second call (the grammar still decides)."""
    vocab = client_tokenizer(client).get_vocab()
    closing = {str(i): -100 for t, i in vocab.items() if t.startswith("]")}
    reply = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80,
        temperature=0, parallel_tool_calls=True, logit_bias=closing,
    )  # fmt: skip
    message = reply.choices[0].message
    assert len(valid_calls(message, PARAMS)) >= 2, message
    assert len({c.id for c in message.tool_calls}) == len(message.tool_calls)


def client_tokenizer(client: openai.OpenAI) -> Any:
    path = client.models.list().data[0].model_dump()["root"]
    return AutoTokenizer.from_pretrained(path)


def random_calls(client: openai.OpenAI, count: int, seed: int) -> None:
    """`count` requests, each over 1-3 random tools (nested objects, arrays, enums, bounded
    numbers, optional fields), tool_choice required or named, one call each: every reply is a
    call that parses and validates against its tool's parameters. (With parallel calls a
    small model may repeat its call until max_tokens; each call still parses.)"""
    rng = random.Random(seed)
    jobs = []
    for i in range(count):
        tools = []
        for j in range(rng.randint(1, 3)):
            function = {"name": f"tool_{i}_{j}", "parameters": random_schema(rng)}
            tools.append({"type": "function", "function": function})
        name = tools[-1]["function"]["name"]
        choice = "required" if i % 2 else {"type": "function", "function": {"name": name}}
        jobs.append((tools, choice))

    def ask(job: tuple[list, object]):
        tools, choice = job
        return client.chat.completions.create(
            model="smollm2", messages=ASK, tools=tools, tool_choice=choice, max_tokens=1024,
            temperature=0.7, seed=1, parallel_tool_calls=False,
        )  # fmt: skip

    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(ask, jobs))
    for (tools, choice), reply in zip(jobs, replies):
        params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        assert reply.choices[0].finish_reason == "tool_calls", reply.choices[0]
        calls = valid_calls(reply.choices[0].message, params)
        assert calls
        if isinstance(choice, dict):
            assert {name for name, _ in calls} == {choice["function"]["name"]}


def test_random_schemas_calls_all_validate(client: openai.OpenAI) -> None:
    random_calls(client, 6, seed=7)


@pytest.mark.slow
def test_random_schemas_200_calls_all_validate(client: openai.OpenAI) -> None:
    random_calls(client, 200, seed=11)
