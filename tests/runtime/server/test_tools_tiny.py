"""Tool calling and reasoning through the official `openai` client on tiny random Qwen2,
Qwen3 and Llama models served with their formats' chat templates (tests/chat_templates.py:
Qwen 2.5's and Qwen 3's `<tool_call>` blocks, Llama 3.1's JSON calls), streamed and not: a
whole tool loop with the call's id back through the template, tool_choice auto, required and
named, parallel calls, and on Qwen3 reasoning split from content with constraints that start
after </think>.

Random weights write junk, so each test steers what it needs: tool_choice required or named
(the tools' grammar), or for auto a logit bias on the format's start tag (`<tool_call>`, one
token here as in Qwen's vocabulary; `{` for Llama) that makes the model open a call, after
which the triggered grammar alone keeps the call valid (the bias cannot write JSON). The
tools' arguments have no free strings, so a biased tag cannot be written inside one."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from chat_templates import chat_model

from conftest import start_server

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days"],
}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Weather in Paris, and the time?"}]
TAG = {"qwen2": "<tool_call>", "qwen3": "<tool_call>", "llama": "{"}
SEPARATOR = {"qwen2": "<tool_call>", "qwen3": "<tool_call>", "llama": ";"}  # opens a 2nd call
ANSWER = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
          "maximum": 99}, "ok": {"type": "boolean"}}, "required": ["n", "ok"]}  # fmt: skip


@dataclass
class Served:
    family: str
    client: openai.OpenAI
    url: str
    tokenizer: Any

    def bias(self, text: str, value: float = 100) -> dict[str, float]:
        return {str(t): value for t in self.tokenizer.encode(text, add_special_tokens=False)}

    def ask(self, **kwargs: Any) -> Any:
        """A chat completion with the tools; Qwen3 with thinking off unless told (its tool
        calls then come at once, not after a think block)."""
        extra = dict(kwargs.pop("extra_body", {}))
        if self.family == "qwen3":
            extra.setdefault("chat_template_kwargs", {"enable_thinking": False})
        args = {"model": "default", "messages": ASK, "tools": TOOLS, "temperature": 0,
                "max_tokens": 200, "extra_body": extra, **kwargs}  # fmt: skip
        return self.client.chat.completions.create(**args)


# qwen2 writes the same <tool_call> format as qwen3 (which the default run covers, with
# reasoning): it runs with -m slow, to keep the default suite inside its budget
@pytest.fixture(
    scope="module", params=[pytest.param("qwen2", marks=pytest.mark.slow), "qwen3", "llama"]
)
def served(request: pytest.FixtureRequest, tmp_path_factory: Any) -> Iterator[Served]:
    family = request.param
    path, template = chat_model(family, tmp_path_factory.mktemp(family))
    # the default grammar backend (llguidance), which must take Qwen's plain added tags
    extra = {"reasoning_parser": "qwen3"} if family == "qwen3" else {}
    with start_server(model_path=str(path), chat_template=str(template), **extra) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=120)
        yield Served(family, client, server.url, server.get_tokenizer())


def valid_calls(message: Any) -> list[tuple[str, dict]]:
    """The message's calls, each checked: a known tool, arguments valid for it, an id."""
    calls = []
    for call in message.tool_calls or []:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PARAMS[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"
        calls.append((call.function.name, arguments))
    return calls


def streamed(reply: Any) -> tuple[dict[int, dict], str | None, str, str]:
    """(calls by index, finish reason, content, reasoning) of a stream."""
    calls: dict[int, dict] = {}
    finish, content, reasoning = None, "", ""
    for chunk in reply:
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning_content") or ""
            for part in choice.delta.tool_calls or []:
                entry = calls.setdefault(part.index, {"name": "", "arguments": "", "id": ""})
                entry["name"] += part.function.name or ""
                entry["arguments"] += part.function.arguments or ""
                entry["id"] += part.id or ""
            finish = choice.finish_reason or finish
    return calls, finish, content, reasoning


def test_auto_opens_a_call_the_grammar_keeps_valid(served: Served) -> None:
    bias = served.bias(TAG[served.family])
    reply = served.ask(logit_bias=bias, parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert len(valid_calls(choice.message)) == 1  # parallel_tool_calls false: one, then the end
    calls, finish, _, _ = streamed(served.ask(logit_bias=bias, stream=True))
    assert finish == "tool_calls" and calls
    for entry in calls.values():
        jsonschema.validate(json.loads(entry["arguments"]), PARAMS[entry["name"]])
    free = served.ask(tool_choice="auto", logit_bias=served.bias(TAG[served.family], -100))
    assert free.choices[0].message.tool_calls is None  # no tag, no call: free text


def test_two_parallel_calls_in_one_reply(served: Served) -> None:
    # the tag outweighs the separator: llama3's ";" must not open the reply (then it is text)
    bias = {**served.bias(SEPARATOR[served.family], 50), **served.bias(TAG[served.family])}
    reply = served.ask(logit_bias=bias, parallel_tool_calls=True, max_tokens=240)
    message = reply.choices[0].message
    assert len(valid_calls(message)) >= 2, message
    assert len({c.id for c in message.tool_calls}) == len(message.tool_calls)


def test_required_and_named(served: Served) -> None:
    for stream in (False, True):
        reply = served.ask(tool_choice="required", stream=stream)
        if stream:
            calls, finish, _, _ = streamed(reply)
            assert finish == "tool_calls" and calls
            for entry in calls.values():
                jsonschema.validate(json.loads(entry["arguments"]), PARAMS[entry["name"]])
        else:
            assert reply.choices[0].finish_reason == "tool_calls"
            assert valid_calls(reply.choices[0].message)
    named = {"type": "function", "function": {"name": "get_time"}}
    calls = valid_calls(served.ask(tool_choice=named).choices[0].message)
    assert calls and {name for name, _ in calls} == {"get_time"}


def test_tool_loop_with_the_id_through_the_template(served: Served) -> None:
    first = served.ask(tool_choice="auto", logit_bias=served.bias(TAG[served.family]),
                       parallel_tool_calls=False)  # fmt: skip
    call = first.choices[0].message.tool_calls[0]

    def history(call_id: str) -> list[dict[str, Any]]:
        assistant = {"role": "assistant", "content": None,
                     "tool_calls": [{**call.model_dump(), "id": call_id}]}  # fmt: skip
        result = {"role": "tool", "tool_call_id": call_id, "name": call.function.name,
                  "content": json.dumps({"sky": "clear"})}  # fmt: skip
        return [*ASK, assistant, result]

    no_tag = served.bias(TAG[served.family], -100)
    for stream in (False, True):
        final = served.ask(messages=history(call.id), logit_bias=no_tag, max_tokens=24,
                           stream=stream)  # fmt: skip
        if stream:
            calls, finish, content, _ = streamed(final)
            assert not calls and finish in ("stop", "length") and content
        else:
            answer = final.choices[0]
            assert answer.message.tool_calls is None and answer.finish_reason in ("stop", "length")
            assert answer.message.content
    # byte tokens: a longer id makes the prompt longer by exactly its extra bytes
    short = served.ask(messages=history(call.id), max_tokens=1).usage.prompt_tokens
    longer = served.ask(messages=history(call.id + "xyz"), max_tokens=1).usage.prompt_tokens
    assert longer - short == 3
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        served.ask(messages=[*history(call.id)[:2], {"role": "tool", "content": "x"}])


def test_aborted_triggered_stream_frees_its_kv(served: Served) -> None:
    body = {"model": "default", "messages": ASK, "tools": TOOLS, "stream": True,
            "max_tokens": 400, "temperature": 0, "logit_bias": served.bias(TAG[served.family]),
            "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    with httpx.Client(base_url=served.url, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            for _ in response.iter_lines():
                break  # the role chunk came: leaving the block closes the connection
        deadline = time.monotonic() + 30
        while True:
            s = http.get("/server_info").json()["internal_states"][0]
            if s["running_requests"] == 0 and s["server"]["requests_in_flight"] == 0:
                break
            assert time.monotonic() < deadline, s
            time.sleep(0.1)
        assert s["free_slots"] + s["tokens_in_tree"] == s["total_slots"], s


# ---- reasoning (Qwen3) ----------------------------------------------------------------------


def thinking(served: Served, **kwargs: Any) -> list[dict[str, Any]]:
    """Four sampled replies that think: a bias on </think> ends each think block after some
    junk (or at once: by chance a reply opens with </think>, hence four; sampling here is not
    reproducible across batches). Each as {"reasoning_content", "content"}, streamed or not."""
    if served.family != "qwen3":
        pytest.skip("reasoning is served on the Qwen3 model")
    extra = {"chat_template_kwargs": {"enable_thinking": True}, **kwargs.pop("extra_body", {})}
    args = {"messages": ASK, "tools": None, "logit_bias": served.bias("</think>", 4.0),
            "temperature": 1.0, "n": 4}  # fmt: skip
    reply = served.ask(**{**args, **kwargs}, extra_body=extra)
    if not kwargs.get("stream"):
        return [c.message.model_dump() for c in reply.choices]
    out = [{"reasoning_content": "", "content": ""} for _ in range(4)]
    for chunk in reply:
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            for name in ("reasoning_content", "content"):
                out[choice.index][name] += delta.get(name) or ""
    return out


def test_reasoning_split_from_content_streamed_too(served: Served) -> None:
    for stream in (False, True):
        replies = thinking(served, max_tokens=48, stream=stream)
        for message in replies:
            assert "</think>" not in (message["reasoning_content"] or ""), message
        assert any(m["reasoning_content"] and m["content"] for m in replies), replies


def test_json_schema_applies_after_the_reasoning(served: Served) -> None:
    form = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    replies = thinking(served, response_format=form, max_tokens=120)
    assert any(m["reasoning_content"] for m in replies), replies  # free text: the grammar waited
    for message in replies:
        jsonschema.validate(json.loads(message["content"]), ANSWER)
    off = thinking(served, response_format=form, max_tokens=120,
                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    for message in off:
        assert message["reasoning_content"] is None  # thinking off: all content, from the start
        jsonschema.validate(json.loads(message["content"]), ANSWER)
