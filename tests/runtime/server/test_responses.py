"""OpenAI's Responses API (`/v1/responses`) through the official `openai` client's
`client.responses`, on SmolLM2: replies, the typed stream event by event, forced function calls
over random tool schemas, the tool loop continued by `previous_response_id` (and the earlier
turns found in the radix cache), structured output, the store (GET, DELETE, TTL, bounds),
cancel of a running stream, and bad requests answered in OpenAI's error shape. Every response
and stream event is also checked against the SDK's own pydantic types, strictly."""

from __future__ import annotations

import json
import queue
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent
from test_tool_calls import random_schema

from conftest import start_server
from radixflow.runtime.server.chat_runner import ChatEvent, ChatReply
from radixflow.runtime.server.response_events import ResponseState
from radixflow.runtime.server.response_store import ResponseStore
from radixflow.runtime.server.tool_calls import ToolCall

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
          "parameters": WEATHER, "strict": True}]  # fmt: skip
ASK = "What is the weather in Paris?"
SHORT = "What is 2+2? Answer with a number only."  # SmolLM2 finishes it in 8 tokens
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)
ITEMS = pydantic.TypeAdapter(ResponseItem)


@pytest.fixture(scope="module")
def server(shared_server: Any) -> Any:
    return shared_server


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=120, max_retries=0)


def strict(data: dict[str, Any]) -> Response:
    """The response JSON validated (not merely constructed) by the SDK's type."""
    return Response.model_validate(data)


def sse_events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed response's events, raw: each `event:` line must name its data's type."""
    events = []
    with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=120) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"].startswith(
            "text/event-stream"
        )
        name = None
        for line in answer.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                event = json.loads(line[len("data: ") :])
                assert event["type"] == name, (name, event)
                EVENTS.validate_python(event)
                events.append(event)
    return events


def test_plain_reply(client: openai.OpenAI) -> None:
    raw = client.responses.with_raw_response.create(
        model="smollm2", input=SHORT, instructions="Answer briefly.", max_output_tokens=24,
        temperature=0, metadata={"case": "plain"},
    )  # fmt: skip
    data = json.loads(raw.text)
    reply = raw.parse()
    assert strict(data).output_text == reply.output_text
    assert "4" in reply.output_text and reply.status == "completed"
    assert reply.id.startswith("resp_") and reply.object == "response"
    (message,) = reply.output
    assert message.type == "message" and message.id.startswith("msg_")
    assert message.role == "assistant" and message.status == "completed"
    assert message.content[0].annotations == []
    usage = reply.usage
    assert usage.output_tokens <= 24 and usage.input_tokens > 10
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert reply.instructions == "Answer briefly." and reply.metadata == {"case": "plain"}
    assert reply.temperature == 0 and reply.store is True and reply.max_output_tokens == 24


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI) -> None:
    reply = client.responses.create(
        model="smollm2", input="Say hello.", max_output_tokens=3, temperature=0
    )
    assert reply.status == "incomplete" and reply.usage.output_tokens == 3
    assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.output[0].status == "incomplete" and reply.output_text


def test_stream_events_in_documented_order(server: Any, client: openai.OpenAI) -> None:
    body = {"model": "smollm2", "input": SHORT, "max_output_tokens": 24, "temperature": 0,
            "stream": True}  # fmt: skip
    events = sse_events(server.url, body)
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 2, kinds
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = strict(events[-1]["response"])
    item = events[2]["item"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == events[-4]["text"] == final.output_text and "4" in text
    assert {e.get("item_id", item["id"]) for e in events[2:-1]} == {item["id"]}
    assert events[0]["response"]["id"] == final.id and final.status == "completed"
    # the SDK's own stream helper reads the same events and assembles the reply
    with client.responses.stream(model="smollm2", input=SHORT, max_output_tokens=24,
                                 temperature=0) as stream:  # fmt: skip
        helper = list(stream)
        assembled = stream.get_final_response()
    assert [e.type for e in helper if not e.type.endswith(".delta")] == [
        k for k in kinds if not k.endswith(".delta")
    ]
    helper_text = "".join(e.delta for e in helper if e.type == "response.output_text.delta")
    assert assembled.status == "completed" and assembled.output_text == helper_text


def forced_call(client: openai.OpenAI, tools: list[dict], name: str) -> Response:
    return client.responses.create(
        model="smollm2", input=ASK, tools=tools, tool_choice={"type": "function", "name": name},
        parallel_tool_calls=False, max_output_tokens=512, temperature=0,
    )  # fmt: skip


def test_forced_calls_validate_against_random_schemas(client: openai.OpenAI) -> None:
    jobs = []
    for seed in (3, 5, 8):
        rng = random.Random(seed)
        tools = [{"type": "function", "name": f"tool_{seed}_{j}", "parameters": random_schema(rng)}
                 for j in range(rng.randint(1, 3))]  # fmt: skip
        jobs.append((tools, tools[-1]["name"]))
    with ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(pool.map(lambda job: forced_call(client, *job), jobs))
    for (tools, name), reply in zip(jobs, replies):
        assert reply.status == "completed", reply
        (call,) = reply.output
        assert call.type == "function_call" and call.name == name and call.status == "completed"
        assert call.id.startswith("fc_") and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), tools[-1]["parameters"])


def test_tool_loop_continued_by_previous_response_id(client: openai.OpenAI) -> None:
    stream = client.responses.create(
        model="smollm2", input=ASK, tools=TOOLS, parallel_tool_calls=False,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=64,
        temperature=0, stream=True,
    )  # fmt: skip
    events = list(stream)
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    first = events[-1].response
    (call,) = first.output
    assert events[2].item.type == "function_call" and events[2].item.arguments == ""
    assert events[3].delta == events[4].arguments == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, clear"}
    answer = client.responses.create(
        model="smollm2", previous_response_id=first.id, input=[output], tools=TOOLS,
        tool_choice="none", max_output_tokens=24, temperature=0,
    )  # fmt: skip
    assert answer.previous_response_id == first.id
    assert [item.type for item in answer.output] == ["message"] and answer.output_text.strip()
    items = client.responses.input_items.list(answer.id, order="asc").data
    assert [(i.type, i.id) for i in items] == [
        ("message", items[0].id), ("function_call", call.id),
        ("function_call_output", items[2].id),
    ]  # fmt: skip
    assert items[0].role == "user" and items[0].content[0].text == ASK


def test_structured_output_with_a_json_schema(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
    reply = client.responses.create(
        model="smollm2", input="Give a person as JSON.", text={"format": fmt},
        max_output_tokens=32, temperature=0,
    )  # fmt: skip
    assert reply.status == "completed" and reply.text.format.type == "json_schema"
    jsonschema.validate(json.loads(reply.output_text), schema)


NOTES = "Here are my notes about the trip: " + ", ".join(
    f"day {i} we saw a new town by the sea" for i in range(1, 9)
)


def test_previous_turns_are_cached_tokens(client: openai.OpenAI) -> None:
    """The continued turn's prompt opens with the previous one's (prompt and reply, as the
    tree holds them): all of that previous prompt is cached (page size 1). A turn that did not
    get the previous turns prepended would share only the system turn."""
    system = "You are a terse assistant."
    first = client.responses.create(
        model="smollm2", instructions=system, input=NOTES + ". Summarize them.",
        max_output_tokens=8, temperature=0,
    )  # fmt: skip
    second = client.responses.create(
        model="smollm2", instructions=system, previous_response_id=first.id,
        input="Which day was best?", max_output_tokens=8, temperature=0,
    )  # fmt: skip
    assert first.usage.input_tokens > 100
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens, (cached, first.usage)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_get_delete_and_store_false(client: openai.OpenAI) -> None:
    reply = client.responses.create(model="smollm2", input=SHORT, max_output_tokens=4)
    again = client.responses.retrieve(reply.id)
    assert again.model_dump() == reply.model_dump()
    assert client.responses.delete(reply.id) is None  # the SDK returns nothing; 200 it was
    for call in (
        lambda: client.responses.retrieve(reply.id),
        lambda: client.responses.delete(reply.id),
        lambda: client.responses.create(
            model="smollm2", input="Go on.", previous_response_id=reply.id, max_output_tokens=4
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    unstored = client.responses.create(model="smollm2", input=SHORT, max_output_tokens=4,
                                       store=False)  # fmt: skip
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def in_flight(url: str) -> tuple[int, int]:
    state = httpx.get(f"{url}/get_server_info", timeout=30).json()["internal_states"][0]
    return state["server"]["requests_in_flight"], state["running_requests"]


def test_cancel_a_running_stream(server: Any, client: openai.OpenAI) -> None:
    ids: queue.Queue[str] = queue.Queue()
    events: list[Any] = []

    def read() -> None:
        stream = client.responses.create(
            model="smollm2", input="Write a very long story about a dragon.",
            max_output_tokens=2000, temperature=0, stream=True,
        )  # fmt: skip
        for event in stream:
            events.append(event)
            if event.type == "response.output_text.delta":
                ids.put(events[0].response.id)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    response_id = ids.get(timeout=60)
    cancelled = client.responses.cancel(response_id)
    reader.join(60)
    assert not reader.is_alive()
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.status == "cancelled"
    assert cancelled.status == "cancelled" and cancelled.usage.output_tokens < 2000
    assert cancelled.output[0].status == "incomplete"
    assert client.responses.cancel(response_id).status == "cancelled"  # idempotent
    assert client.responses.retrieve(response_id).status == "cancelled"
    deadline = time.monotonic() + 10
    while in_flight(server.url) != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert in_flight(server.url) == (0, 0)


BAD = [
    (openai.BadRequestError, "max_output_tokens", {"max_output_tokens": "many"}),
    (openai.BadRequestError, "temperature", {"temperature": "hot"}),
    (openai.BadRequestError, "input", {"input": 5}),
    (openai.BadRequestError, "input", {"input": [{"role": "robot", "content": "Hi"}]}),
    (openai.BadRequestError, "input",
     {"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}),
    (openai.BadRequestError, None,
     {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}),
    (openai.BadRequestError, "text.format", {"text": {"format": {"type": "yaml"}}}),
    (openai.BadRequestError, "tools", {"tools": [{"type": "web_search"}]}),
    (openai.BadRequestError, "tool_choice", {"tool_choice": {"type": "file_search"}}),
    (openai.BadRequestError, "max_output_tokens", {"max_output_tokens": 10**12}),
    (openai.BadRequestError, "background", {"background": True}),
    (openai.NotFoundError, "model", {"model": "gpt-9"}),
    (openai.NotFoundError, "previous_response_id", {"previous_response_id": "resp_none"}),
]  # fmt: skip


def test_bad_requests_are_openai_errors(client: openai.OpenAI) -> None:
    for error, param, fields in BAD:
        body = {"model": "smollm2", "input": "Hi", "max_output_tokens": 4, **fields}
        with pytest.raises(error) as caught:
            client.responses.create(**body)
        detail = caught.value.body
        assert set(detail) == {"message", "type", "param", "code"}, detail
        assert detail["param"] == param and detail["message"], (fields, detail)
    assert client.responses.create(model="smollm2", input=SHORT, max_output_tokens=4).output_text


# ---- without a server ----------------------------------------------------------------------


def test_reasoning_then_text_then_a_call_as_typed_events() -> None:
    """What a reasoning model's reply becomes (SmolLM2 has no think block): a reasoning item
    with reasoning_text content, the message, the call; every event the SDK's type."""
    head = {"id": "resp_x", "object": "response", "created_at": 1, "model": "m", "tools": [],
            "tool_choice": "auto", "parallel_tool_calls": True}  # fmt: skip
    state = ResponseState(head)
    call = ToolCall("get_weather", '{"city": "Paris"}', "call_1")
    reply = ChatReply("Think. More.", "Hi", [call], {"finish_reason": {"type": "stop"}})
    steps = [ChatEvent(0, reasoning="Think."), ChatEvent(0, reasoning=" More."),
             ChatEvent(0, content="Hi", calls=[call], final=reply)]  # fmt: skip
    events = state.start() + [e for step in steps for e in state.add(step)]
    events += state.finish("completed", None)
    for event in events:
        EVENTS.validate_python(event)
    assert [e["type"].removeprefix("response.") for e in events] == [
        "created", "in_progress",
        "output_item.added", "content_part.added", "reasoning_text.delta", "reasoning_text.delta",
        "reasoning_text.done", "content_part.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.done",
        "content_part.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.done",
        "output_item.done", "completed",
    ]  # fmt: skip
    final = strict(events[-1]["response"])
    reasoning, message, function_call = final.output
    assert reasoning.content[0].type == "reasoning_text" and reasoning.summary == []
    assert reasoning.content[0].text == "Think. More." and final.output_text == "Hi"
    assert function_call.call_id == "call_1" and function_call.arguments == call.arguments


def test_store_is_bounded_and_expires() -> None:
    now = [0.0]
    store = ResponseStore(max_entries=3, max_bytes=10_000, ttl_s=60, clock=lambda: now[0])

    def response(n: int, pad: int = 0) -> dict[str, Any]:
        return {"id": f"resp_{n}", "output": [{"text": "x" * pad}]}

    for n in range(3):
        assert store.put(response(n), [])
    assert store.get("resp_0") is not None  # now the most recently used
    store.put(response(3), [])  # a 4th entry: the least recently used goes
    assert list(store.entries) == ["resp_2", "resp_0", "resp_3"]
    assert not store.put(response(4, pad=20_000), [])  # alone over the byte cap: not kept
    store.put(response(5, pad=6_000), [])
    assert list(store.entries) == ["resp_0", "resp_3", "resp_5"]
    now[0] = 30.0
    store.put(response(6, pad=6_000), [])  # over the byte cap: the oldest go until it fits
    assert list(store.entries) == ["resp_6"] and store.bytes == store.entries["resp_6"].size
    assert store.get("resp_6") is not None and store.delete("resp_6") and store.bytes == 0
    store.put(response(7), [])
    now[0] = 89.0
    assert store.get("resp_7") is not None
    now[0] = 90.0  # its hour (here a minute) is up
    assert store.get("resp_7") is None and not store.entries


def test_stored_input_items_parse_as_the_sdk_types(client: openai.OpenAI) -> None:
    reply = client.responses.create(
        model="smollm2", max_output_tokens=4,
        input=[{"role": "developer", "content": "Be brief."},
               {"role": "user", "content": [{"type": "input_text", "text": SHORT}]},
               {"type": "reasoning", "id": "rs_1", "summary": []}],
    )  # fmt: skip
    page = httpx.get(f"{client.base_url}responses/{reply.id}/input_items?limit=2").json()
    assert page["has_more"] is True and [i["type"] for i in page["data"]] == [
        "reasoning",
        "message",
    ]
    for item in page["data"]:
        ITEMS.validate_python(item)


@pytest.mark.slow
def test_reasoning_effort_on_a_reasoning_parser() -> None:
    """With --reasoning-parser deepseek-r1 the reply is reasoning until `</think>` (which
    SmolLM2 never writes): effort low gives a reasoning item, streamed as reasoning_text
    events; effort none turns thinking off, and the same reply is the message."""
    with start_server(max_total_tokens=4096, reasoning_parser="deepseek-r1") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        body = {"model": "smollm2", "input": SHORT, "max_output_tokens": 12, "temperature": 0}
        events = sse_events(server.url, {**body, "stream": True, "reasoning": {"effort": "low"}})
        kinds = [e["type"] for e in events]
        assert (
            "response.reasoning_text.delta" in kinds and "response.output_text.delta" not in kinds
        )
        thought = strict(events[-1]["response"])
        assert [item.type for item in thought.output] == ["reasoning"]
        assert thought.output[0].content[0].text and thought.output_text == ""
        assert thought.usage.output_tokens_details.reasoning_tokens > 0
        said = client.responses.create(**body, reasoning={"effort": "none"})
        assert [item.type for item in said.output] == ["message"] and said.output_text
        assert said.usage.output_tokens_details.reasoning_tokens == 0
