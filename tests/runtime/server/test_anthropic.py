"""Anthropic's Messages API through the official `anthropic` SDK against a live server: a plain
reply (the same greedy text as the OpenAI door), Anthropic's event sequence streamed and
assembled by the SDK, forced tool calls over random schemas, the whole tool loop, stop
sequences, max_tokens, count_tokens against a real call's usage, and bad requests as the SDK's
exception types in Anthropic's error shape. In process, with a scripted chat core: thinking
blocks whole and streamed, a mid-stream error event, the API key and a draining server."""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from test_tool_calls import random_schema

from radixflow.runtime.config import ServerConfig
from radixflow.runtime.protocol.messages import ERROR_SHUTDOWN, Generate
from radixflow.runtime.server.anthropic_api import AnthropicRoutes
from radixflow.runtime.server.chat_runner import ChatEvent, ChatJob, ChatReply
from radixflow.runtime.server.http_api import HttpDoor
from radixflow.runtime.server.http_request import HttpError
from radixflow.runtime.server.metrics import Metrics
from radixflow.runtime.server.tool_calls import ToolCall
from radixflow.runtime.server.validation import RequestError

ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # Anthropic's field; the SDK's create() no longer lists it
WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    },
}
BLOCKS = re.compile(r"(content_block_start (content_block_delta )*content_block_stop )+")


@pytest.fixture(scope="module")
def server(shared_server: Any) -> Any:
    return shared_server


@pytest.fixture(scope="module")
def client(server: Any) -> anthropic.Anthropic:
    # an explicit timeout: the SDK refuses a large max_tokens without one
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)


def create(client: anthropic.Anthropic, **kwargs: Any) -> anthropic.types.Message:
    request = {"model": "smollm2", "max_tokens": 16, "messages": ASK, **kwargs}
    return client.messages.create(**request, extra_body=GREEDY)


def sse_events(url: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of a raw /v1/messages stream."""
    events, name = [], None
    with httpx.stream("POST", f"{url}/v1/messages", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
    return events


# ---- a live server -------------------------------------------------------------------------


def test_plain_reply_is_the_chat_cores_greedy_reply(client: anthropic.Anthropic, server) -> None:
    system = "You answer in one short sentence."
    message = create(client, system=[{"type": "text", "text": system}])
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == "smollm2"
    assert [b.type for b in message.content] == ["text"] and "Paris" in message.content[0].text
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert 0 < message.usage.output_tokens <= 16 and message.usage.cache_creation_input_tokens == 0
    # the same conversation through the OpenAI door: the same prompt, the same greedy text
    chat = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": [{"role": "system", "content": system}, *ASK], "max_tokens": 16,
              "temperature": 0},
        timeout=120,
    ).json()  # fmt: skip
    assert chat["choices"][0]["message"]["content"] == message.content[0].text
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]


def test_stream_follows_anthropics_event_order(client: anthropic.Anthropic, server) -> None:
    body = {"model": "smollm2", "max_tokens": 12, "messages": ASK, "stream": True, **GREEDY}
    events = sse_events(server.url, body)
    names = [name for name, _ in events]
    assert all(data["type"] == name for name, data in events)
    assert names[:2] == ["message_start", "ping"] and names[-2:] == [
        "message_delta",
        "message_stop",
    ]
    assert BLOCKS.fullmatch("".join(f"{n} " for n in names[2:-2])), names
    starts = [data for name, data in events if name == "content_block_start"]
    assert [s["index"] for s in starts] == list(range(len(starts)))
    start = events[0][1]["message"]
    assert (
        start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"]
    )
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    delta = events[-2][1]
    whole = create(client, max_tokens=12)
    assert text == whole.content[0].text and delta["delta"]["stop_reason"] == whole.stop_reason
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens
    # the SDK's stream helper assembles the same message
    with client.messages.stream(
        model="smollm2", max_tokens=12, messages=ASK, extra_body=GREEDY
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens > 0


def test_forced_tool_calls_validate_against_random_schemas(client: anthropic.Anthropic) -> None:
    rng = random.Random(1)  # 4 requests over 1-3 tools each: every kind of field
    jobs = []
    for i in range(4):
        tools = [{"name": f"tool_{i}_{j}", "input_schema": random_schema(rng)}
                 for j in range(rng.randint(1, 3))]  # fmt: skip
        forced = {"type": "tool", "name": tools[-1]["name"]} if i % 2 else {"type": "any"}
        jobs.append((tools, {**forced, "disable_parallel_tool_use": True}))

    def ask(job: tuple[list, dict]) -> anthropic.types.Message:
        return create(client, tools=job[0], tool_choice=job[1], max_tokens=512)

    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(ask, jobs))
    for (tools, choice), message in zip(jobs, replies):
        schemas = {t["name"]: t["input_schema"] for t in tools}
        assert message.stop_reason == "tool_use", message
        (call,) = message.content  # disable_parallel_tool_use: exactly one call
        assert call.type == "tool_use" and call.id.startswith("toolu_")
        jsonschema.validate(call.input, schemas[call.name])
        assert choice["type"] == "any" or call.name == choice["name"]


def test_tool_loop_streamed_call_then_answer(client: anthropic.Anthropic) -> None:
    forced = {"type": "tool", "name": "get_weather"}
    with client.messages.stream(
        model="smollm2", max_tokens=64, messages=ASK, tools=[WEATHER], tool_choice=forced,
        extra_body=GREEDY,
    ) as stream:  # fmt: skip
        call_message = stream.get_final_message()  # the input assembled from input_json_delta
    (call,) = [b for b in call_message.content if b.type == "tool_use"]
    jsonschema.validate(call.input, WEATHER["input_schema"])
    assert call_message.stop_reason == "tool_use"
    result = {"type": "tool_result", "tool_use_id": call.id,
              "content": [{"type": "text", "text": "18 degrees, clear sky"}]}  # fmt: skip
    history = [*ASK, call_message.to_param(), {"role": "user", "content": [result]}]
    answer = create(client, messages=history, tools=[WEATHER], tool_choice={"type": "none"})
    assert [b.type for b in answer.content] == ["text"]
    assert answer.content[0].text and not answer.content[0].text.startswith("{")
    assert answer.stop_reason in ("end_turn", "max_tokens")


def test_stop_sequence_and_max_tokens(client: anthropic.Anthropic) -> None:
    stopped = create(client, stop_sequences=["Paris", "Madrid"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "Paris"
    assert "Paris" not in stopped.content[0].text and stopped.content[0].text
    cut = create(client, max_tokens=3)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


def test_count_tokens_is_a_real_calls_input(client: anthropic.Anthropic, server) -> None:
    request = {"model": "smollm2", "system": "Be brief.", "messages": ASK, "tools": [WEATHER]}
    counted = client.messages.count_tokens(**request).input_tokens
    without_tools = client.messages.count_tokens(model="smollm2", system="Be brief.", messages=ASK)
    assert counted > without_tools.input_tokens + 20  # the tools are in the prompt
    thinking = {"type": "enabled", "budget_tokens": 1024}  # SmolLM2's template ignores it
    assert client.messages.count_tokens(**request, thinking=thinking).input_tokens == counted
    assert httpx.post(f"{server.url}/flush_cache", timeout=60).status_code == 200
    # 4 tokens: with tools the reply opens with a forced `{"`, which alone would end a
    # one-token reply by a jump, before the prompt is ever computed (so nothing is cached)
    cold = create(client, max_tokens=4, **{k: v for k, v in request.items() if k != "model"})
    assert (cold.usage.input_tokens, cold.usage.cache_read_input_tokens) == (counted, 0)
    warm = create(client, max_tokens=4, **{k: v for k, v in request.items() if k != "model"})
    assert warm.usage.cache_read_input_tokens > 0  # the radix cache held the prompt
    assert warm.usage.input_tokens + warm.usage.cache_read_input_tokens == counted
    # a failed tool's result reaches the model marked as an error
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    turns = [*ASK, {"role": "assistant", "content": [use]}]
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "timeout"}
    counts = [
        client.messages.count_tokens(model="smollm2", tools=[WEATHER], messages=[
            *turns, {"role": "user", "content": [{**result, "is_error": failed}]}]).input_tokens
        for failed in (False, True)
    ]  # fmt: skip
    assert counts[1] > counts[0]


def test_a_prefilled_assistant_turn_is_continued(client: anthropic.Anthropic, server) -> None:
    """Anthropic's prefill: the reply continues the last assistant text, the same greedy
    text as the OpenAI door's continuation of the same conversation, from a prompt that
    ends in the prefill (shorter than one closing the turn and opening a new one)."""
    turns = [*ASK, {"role": "assistant", "content": "The capital of France is"}]
    reply = create(client, messages=turns, max_tokens=8)
    chat = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x").chat.completions
    ask = {"model": "smollm2", "messages": turns, "max_tokens": 8, "temperature": 0}
    same = chat.create(**ask)
    new_turn = chat.create(**ask, extra_body={"continue_final_message": False})
    assert reply.content[0].text == same.choices[0].message.content
    prompt = reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    assert prompt == same.usage.prompt_tokens < new_turn.usage.prompt_tokens


BAD = [
    ({"max_tokens": "8"}, "max_tokens"),
    ({"max_tokens": 10**7}, "max_tokens"),
    ({"messages": [{"role": "system", "content": "Hi"}]}, "role"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"messages": []}, "messages"),
    ({"system": {"text": "x"}}, "system"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "18 C"}]}]}, "tool_use_id"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, "vision"),
    ({"tools": [{"name": "t", "input_schema": {"type": "object", "properties": 3}}]},
     "input_schema"),
    ({"tools": [{"name": "t", "input_schema": {"type": "string"}}]}, "input_schema"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
    ({"temperature": "hot"}, "temperature"),
    ({"thinking": {"type": "enabled", "budget_tokens": 99}}, "budget_tokens"),
]  # fmt: skip


def test_bad_requests_are_4xx_in_anthropics_shape(client: anthropic.Anthropic, server) -> None:
    for fields, word in BAD:
        with pytest.raises(anthropic.BadRequestError) as caught:  # the fields as sent, raw
            client.messages.create(model="smollm2", max_tokens=8, messages=ASK, extra_body=fields)
        body = caught.value.body
        assert set(body) == {"type", "error"} and body["type"] == "error", fields
        assert body["error"]["type"] == "invalid_request_error", body
        assert word in body["error"]["message"], (word, body)
    with pytest.raises(anthropic.NotFoundError) as caught:
        create(client, model="claude-opus-9")
    assert caught.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model="smollm2", messages=[{"role": "tool", "content": "x"}])
    missing = httpx.post(f"{server.url}/v1/messages", json={"max_tokens": 8, "messages": ASK})
    assert missing.status_code == 400 and missing.json()["error"]["type"] == "invalid_request_error"
    assert "model" in missing.json()["error"]["message"]
    assert "Paris" in create(client).content[0].text  # and it keeps serving


# ---- in process: the door's shapes over a scripted chat core -------------------------------

REASONING, ANSWER = "The user asks about France.", "Paris."
CALL = ToolCall("lookup", '{"city": "Paris"}', "call_1")
META = {"finish_reason": {"type": "stop"}, "prompt_tokens": 7, "completion_tokens": 9,
        "cached_tokens": 4}  # fmt: skip
SCRIPT = [
    ChatEvent(0, reasoning="The user asks "),
    ChatEvent(0, reasoning="about France.", content="Paris"),
    ChatEvent(0, content=".", calls=[CALL], final=ChatReply(REASONING, ANSWER, [CALL], META)),
]
KEY = "anthropic-secret"


class Scripted:
    """The chat core's runner, replaying `events` (no model): only the door's shapes remain."""

    def __init__(self, events: list[ChatEvent]) -> None:
        self.events = events

    async def complete(self, job: ChatJob) -> list[ChatReply]:
        return [e.final for e in self.events if e.final is not None]

    async def stream(self, job: ChatJob) -> Any:
        for event in self.events:
            yield event


def scripted_door(events: list[ChatEvent] | None, draining: bool = False) -> web.Application:
    """An app with the Anthropic routes over a stub server: a scripted runner, or (None) the
    real one submitting to a server that is draining."""

    def refuse(requests: list) -> None:
        raise RequestError(ERROR_SHUTDOWN, "the server is shutting down (draining)")

    server = SimpleNamespace(
        config=ServerConfig(api_key=KEY), counters=Counter(), metrics=Metrics(dict),
        model_info={"model": "smollm2", "context_length": 8192}, submit_generates=refuse,
    )  # fmt: skip
    door = HttpDoor(server)
    routes = AnthropicRoutes(door)

    def chat_job(body: dict[str, Any]) -> ChatJob:
        msg = Generate("rid", input_ids=[1] * 7, stream=body.get("stream", False))
        return ChatJob(None, [msg], body)  # type: ignore[arg-type]

    routes.chat.chat_job = chat_job  # type: ignore[method-assign]
    if events is not None:
        routes.runner = Scripted(events)  # type: ignore[assignment]
    app = web.Application(middlewares=[door.guard])
    app.add_routes(routes.routes())
    return app


def shape(message: anthropic.types.Message) -> tuple:
    """A message less its id (and the stream helper's parsed_output)."""
    blocks = [b.model_dump(exclude={"parsed_output"}) for b in message.content]
    return message.stop_reason, message.stop_sequence, message.usage.model_dump(), blocks


async def with_client(app: web.Application, run: Any) -> Any:
    async with TestServer(app) as test_server:
        url = str(test_server.make_url(""))
        sdk = anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0)
        async with sdk:
            return await run(sdk, url)


def test_thinking_blocks_whole_and_streamed() -> None:
    thinking = {"type": "enabled", "budget_tokens": 1024}
    request = {"model": "smollm2", "max_tokens": 2048, "messages": ASK}

    async def run(sdk: anthropic.AsyncAnthropic, url: str) -> tuple:
        whole = await sdk.messages.create(**request, thinking=thinking)
        plain = await sdk.messages.create(**request)
        async with sdk.messages.stream(**request, thinking=thinking) as stream:
            streamed = await stream.get_final_message()
        async with httpx.AsyncClient() as http:
            body = {**request, "thinking": thinking, "stream": True}
            raw = await http.post(f"{url}/v1/messages", headers={"x-api-key": KEY}, json=body)
        return whole, plain, streamed, raw.text

    whole, plain, streamed, raw = asyncio.run(with_client(scripted_door(SCRIPT), run))
    assert [b.type for b in whole.content] == ["thinking", "text", "tool_use"]
    assert whole.content[0].thinking == REASONING and whole.content[0].signature == ""
    assert whole.content[1].text == ANSWER
    assert (whole.content[2].id, whole.content[2].input) == ("toolu_1", {"city": "Paris"})
    assert whole.stop_reason == "tool_use"
    assert (whole.usage.input_tokens, whole.usage.cache_read_input_tokens) == (3, 4)
    assert [b.type for b in plain.content] == ["text", "tool_use"]  # thinking not asked for
    assert shape(streamed) == shape(whole)
    names = re.findall(r"^event: (\w+)$", raw, re.M)
    assert names == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_delta", "content_block_stop",  # thinking, then its signature_delta
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",  # tool_use
        "message_delta", "message_stop",
    ]  # fmt: skip
    assert '"signature_delta"' in raw and '"input_json_delta"' in raw


def test_mid_stream_error_is_an_error_event() -> None:
    failed = [ChatEvent(0, content="Par"), ChatEvent(0, error=HttpError(503, "gone"))]

    async def run(sdk: anthropic.AsyncAnthropic, url: str) -> dict:
        request = {"model": "smollm2", "max_tokens": 8, "messages": ASK}
        async with sdk.messages.stream(**request) as stream:
            with pytest.raises(anthropic.APIStatusError) as caught:
                await stream.get_final_message()
        return caught.value.body

    body = asyncio.run(with_client(scripted_door(failed), run))
    assert body == {"type": "error", "error": {"type": "overloaded_error", "message": "gone"}}


def test_key_and_draining_in_anthropics_shape() -> None:
    async def run(sdk: anthropic.AsyncAnthropic, url: str) -> tuple:
        request = {"model": "smollm2", "max_tokens": 8, "messages": ASK}
        async with httpx.AsyncClient() as http:
            keyless = await http.post(f"{url}/v1/messages", json=request)
        with pytest.raises(anthropic.APIStatusError) as caught:  # x-api-key, as the SDK sends
            await sdk.messages.create(**request, extra_headers={"anthropic-version": "2023-06-01"})
        return keyless, caught.value

    keyless, draining = asyncio.run(with_client(scripted_door(None), run))
    assert keyless.status_code == 401 and set(keyless.json()) == {"type", "error"}
    assert keyless.json()["error"]["type"] == "authentication_error"
    assert draining.status_code == 503 and draining.response.headers["Retry-After"]
    assert draining.body["error"]["type"] == "overloaded_error"
    assert "draining" in draining.body["error"]["message"]
