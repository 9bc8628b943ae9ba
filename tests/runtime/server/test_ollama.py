"""Ollama's API through the official `ollama` client against a live server: chat unstreamed and
streamed (NDJSON, the default), generate raw and templated with `context` continuation, a tool
call and the tool loop, `format` as a schema and as "json", the model listings, and bad
requests as the client's ResponseError in Ollama's `{"error": ...}` shape; LangChain's
ChatOllama once."""

from __future__ import annotations

import asyncio
import json
import re
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import Any

import httpx
import jsonschema
import ollama
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from langchain_ollama import ChatOllama

from conftest import SHARED_KEY, Server, emptied
from radixflow.runtime.config import ServerConfig
from radixflow.runtime.models.loader import builtin_gguf
from radixflow.runtime.protocol.messages import Generate
from radixflow.runtime.server.chat import ChatPlan
from radixflow.runtime.server.chat_runner import ChatEvent, ChatJob, ChatReply
from radixflow.runtime.server.ollama_api import OllamaRoutes
from radixflow.runtime.server.reasoning import ReasoningParser

API_KEY = SHARED_KEY
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
HELLO = [{"role": "user", "content": "Say hello."}]
GREEDY = {"temperature": 0, "num_predict": 8}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "the city"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": WEATHER,
}
TOOLS = [{"type": "function", "function": WEATHER_TOOL}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
DURATIONS = ("total_duration", "prompt_eval_duration", "eval_duration")
PNG = (  # a 1x1 image, base64
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)


@pytest.fixture(scope="module")
def runtime(keyed_server: Server) -> Server:
    return emptied(keyed_server)


@pytest.fixture(scope="module")
def client(runtime: Server) -> ollama.Client:
    return ollama.Client(host=runtime.url, headers=HEADERS, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(runtime: Server) -> Any:
    return runtime.get_tokenizer()


def chat_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def ndjson(runtime: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The lines of a streamed answer, read raw (the body names no `stream`: Ollama's default)."""
    with httpx.stream("POST", runtime.url + path, json=body, headers=HEADERS, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
        return [json.loads(line) for line in r.iter_lines() if line]


def test_chat_streamed_lines_add_up_to_the_unstreamed_reply(
    runtime: Server, client: ollama.Client, tokenizer: Any
) -> None:
    whole = client.chat(model="smollm2", messages=HELLO, options=GREEDY)
    assert whole.done and whole.done_reason == "length" and whole.message.role == "assistant"
    lines = ndjson(runtime, "/api/chat", {"model": "smollm2", "messages": HELLO, "options": GREEDY})
    *deltas, last = lines
    assert deltas and all(line["done"] is False for line in deltas) and last["done"] is True
    assert "".join(line["message"]["content"] for line in lines) == whole.message.content
    assert last["done_reason"] == "length" and last["eval_count"] == GREEDY["num_predict"]
    assert last["prompt_eval_count"] == len(chat_ids(tokenizer, HELLO))
    assert (
        all(type(last[k]) is int and last[k] > 0 for k in DURATIONS) and last["load_duration"] == 0
    )
    assert last["total_duration"] >= last["eval_duration"]
    created = datetime.fromisoformat(last["created_at"])
    assert created.tzinfo is not None and abs(datetime.now(timezone.utc) - created).seconds < 300
    # the client's own stream reads the same
    parts = list(client.chat(model="smollm2", messages=HELLO, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count == GREEDY["num_predict"]


def test_options_map_to_sampling(client: ollama.Client) -> None:
    full = client.chat(model="smollm2", messages=HELLO, options=GREEDY).message.content
    word = full.split()[1]
    options = {**GREEDY, "stop": [word], "num_ctx": 10**6, "num_thread": 4, "mirostat": 0}
    reply = client.chat(model="smollm2:latest", messages=HELLO, options=options, keep_alive=-1)
    assert reply.message.content == full[: full.index(word)] and reply.done_reason == "stop"
    with pytest.raises(ollama.ResponseError) as bad:  # the penalty reaches the sampler's check
        client.chat(model="smollm2", messages=HELLO, options={"repeat_penalty": 50.0})
    assert bad.value.status_code == 400 and "repetition_penalty" in bad.value.error


def test_generate_raw_templated_and_context(client: ollama.Client, tokenizer: Any) -> None:
    prompt = "The capital of France is"
    raw = client.generate(model="smollm2", prompt=prompt, raw=True, options=GREEDY)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert raw.response and raw.prompt_eval_count == len(ids) and raw.context[: len(ids)] == ids
    assert tokenizer.decode(raw.context) == prompt + raw.response
    more = client.generate(
        model="smollm2", prompt=" Rome", raw=True, context=raw.context, options=GREEDY
    )
    assert more.prompt_eval_count == len(raw.context) + len(tokenizer.encode(" Rome"))
    question = "What is 2+2?"
    templated = client.generate(model="smollm2", prompt=question, options=GREEDY)
    turn = [{"role": "user", "content": question}]
    chat = client.chat(model="smollm2", messages=turn, options=GREEDY)
    assert templated.response == chat.message.content  # the prompt is one user turn
    assert templated.prompt_eval_count == len(chat_ids(tokenizer, turn))
    again = client.generate(
        model="smollm2", prompt="And 3+3?", context=templated.context, options=GREEDY
    )
    after = chat_ids(tokenizer, [{"role": "user", "content": "And 3+3?"}])
    assert again.prompt_eval_count == len(templated.context) + len(after)
    assert again.context[: len(templated.context)] == templated.context


def test_load_calls_answer_done_load(client: ollama.Client) -> None:
    assert client.generate(model="smollm2").done_reason == "load"
    loaded = client.chat(model="smollm2", messages=[])
    assert loaded.done and loaded.done_reason == "load" and loaded.message.content == ""


def valid_call(call: Any) -> dict[str, Any]:
    assert call.function.name == "get_weather"
    jsonschema.validate(dict(call.function.arguments), WEATHER)
    return dict(call.function.arguments)


def test_tool_call_then_the_tool_loop(
    runtime: Server, client: ollama.Client, tokenizer: Any
) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    options = {"temperature": 0, "num_predict": 48}
    first = client.chat(model="smollm2", messages=ask, tools=TOOLS, options=options)
    assert first.done_reason == "stop" and first.message.tool_calls, first.message
    arguments = [valid_call(c) for c in first.message.tool_calls]
    assert arguments[0]["city"] == "Paris"
    *_, last = ndjson(runtime, "/api/chat", {"model": "smollm2", "messages": ask,
                                             "tools": TOOLS, "options": options})  # fmt: skip
    streamed = [c["function"]["arguments"] for c in last["message"]["tool_calls"]]
    assert streamed == arguments
    result = json.dumps({"temperature": 18, "sky": "clear"})
    history = [*ask, first.message, {"role": "tool", "tool_name": "get_weather", "content": result}]
    answer = client.chat(model="smollm2", messages=history, options={**options, "num_predict": 16})
    assert answer.message.content and not answer.message.tool_calls
    assert "tool_calls" not in answer.message.content
    # the call and its result are in the prompt
    assert answer.prompt_eval_count > len(chat_ids(tokenizer, ask)) + len(tokenizer.encode(result))


def test_format_schema_and_json(client: ollama.Client) -> None:
    ask = [{"role": "user", "content": "Give a person as JSON."}]
    options = {"temperature": 0, "num_predict": 32}
    person = client.chat(model="smollm2", messages=ask, format=PERSON, options=options)
    assert person.done_reason == "stop"
    jsonschema.validate(json.loads(person.message.content), PERSON)
    ask = [{"role": "user", "content": "What is 2+2? Answer in JSON."}]
    reply = client.chat(model="smollm2", messages=ask, format="json",
                        options={"temperature": 0, "num_predict": 48})  # fmt: skip
    assert reply.done_reason == "stop" and isinstance(json.loads(reply.message.content), dict)


def test_listings(runtime: Server, client: ollama.Client) -> None:
    (listed,) = client.list().models
    assert (
        listed.model == "smollm2:latest" and listed.size == builtin_gguf("smollm2").stat().st_size
    )
    assert re.fullmatch(r"[0-9a-f]{64}", listed.digest) and listed.modified_at.year >= 2024
    details = listed.details
    assert (details.format, details.family, details.quantization_level) == ("gguf", "llama", "Q4_1")
    assert details.parameter_size == "134.52M"
    shown = client.show("smollm2")
    assert shown.capabilities == ["completion", "tools"] and shown.details == details
    assert shown.template == runtime.get_tokenizer().chat_template
    assert shown.modelinfo["llama.context_length"] == 8192 and "<|im_end|>" in shown.parameters
    (loaded,) = client.ps().models
    assert loaded.model == listed.model and loaded.size == listed.size
    assert loaded.expires_at.year > 2300 and loaded.context_length == 8192
    version = httpx.get(runtime.url + "/api/version", headers=HEADERS).json()["version"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", version) and tuple(map(int, version.split("."))) >= (0, 9)
    root = httpx.get(runtime.url + "/", headers=HEADERS)
    assert root.text == "Ollama is running" and root.headers["content-type"].startswith("text/")
    assert httpx.head(runtime.url + "/", headers=HEADERS).status_code == 200


BAD_CALLS = {
    "unknown role": (dict(messages=[{"role": "wizard", "content": "x"}]), 400, "role"),
    "images": (dict(messages=[{"role": "user", "content": "x", "images": [PNG]}]), 400, "vision"),
    "malformed schema": (
        dict(format={"type": "object", "properties": {"a": {"type": "nope"}}}),
        400,
        "nope",
    ),  # fmt: skip
    "unknown model": (dict(model="llama9"), 404, "model 'llama9' not found"),
    "absurd num_predict": (dict(options={"num_predict": 10**9}), 400, "num_predict"),
    "mirostat": (dict(options={"mirostat": 2}), 400, "mirostat"),
    "tfs_z": (dict(options={"tfs_z": 0.5}), 400, "tfs_z"),
    "wrong option type": (dict(options={"temperature": "hot"}), 400, "options.temperature"),
    "prompt past num_ctx": (dict(options={"num_ctx": 8}), 400, "num_ctx"),
    "think without a reasoning model": (dict(think=True), 400, "thinking"),
}


@pytest.mark.parametrize("stream", [False, True])
def test_bad_requests_are_ollama_errors(client: ollama.Client, stream: bool) -> None:
    for name, (change, status, phrase) in BAD_CALLS.items():
        call = {"model": "smollm2", "messages": HELLO, "stream": stream, **change}
        with pytest.raises(ollama.ResponseError) as bad:
            out = client.chat(**call)
            list(out) if stream else out
        assert bad.value.status_code == status and phrase in bad.value.error, name
    generate = [dict(images=[PNG]), dict(suffix="!"), dict(template="{{ .Prompt }}"),
                dict(raw=True, system="Be brief.")]  # fmt: skip
    for change in generate:
        with pytest.raises(ollama.ResponseError) as bad:
            client.generate(model="smollm2", prompt="Hi", **change)
        assert bad.value.status_code == 400, change
    assert client.chat(model="smollm2", messages=HELLO, options=GREEDY).done  # still serving


def ollama_error(answer: httpx.Response) -> bool:
    """Ollama's error shape: one field, the message."""
    body = answer.json()
    return list(body) == ["error"] and isinstance(body["error"], str) and bool(body["error"])


def test_wrong_types_get_ollama_shaped_400s(runtime: Server) -> None:
    bodies = [
        {"model": "smollm2", "messages": "hi"},
        {"model": "smollm2", "messages": HELLO, "stream": "yes"},
        {"model": "smollm2", "messages": [{"role": "user", "content": 5}]},
        {"model": "smollm2", "messages": HELLO, "options": [1]},
        {"model": 5, "messages": HELLO},
        {"messages": HELLO},
        [1],
    ]
    for body in bodies:
        answer = httpx.post(runtime.url + "/api/chat", json=body, headers=HEADERS)
        assert answer.status_code == 400 and ollama_error(answer), body
    keyless = httpx.post(runtime.url + "/api/chat", json={"model": "smollm2", "messages": HELLO})
    assert keyless.status_code == 401 and ollama_error(keyless)
    missing = httpx.get(runtime.url + "/api/pull", headers=HEADERS)
    assert missing.status_code == 404 and ollama_error(missing)


def test_langchain_chat_ollama(runtime: Server, client: ollama.Client) -> None:
    llm = ChatOllama(model="smollm2", base_url=runtime.url, temperature=0, num_predict=8,
                     client_kwargs={"headers": HEADERS})  # fmt: skip
    message = llm.invoke("Say hello.")
    assert (
        message.content
        == client.chat(model="smollm2", messages=HELLO, options=GREEDY).message.content
    )
    assert message.response_metadata["done_reason"] == "length"


# ---- thinking, in process: SmolLM2 has no think block, so a stand-in chat core has one -----

META = {"prompt_tokens": 9, "completion_tokens": 6, "finish_reason": {"type": "stop"}}
THOUGHT = ChatReply("Let me think.", "4", [], {**META, "ttft": 0.5, "e2e_latency": 2.0})


class ThinkingCore:
    """OpenAiRoutes' and ChatRunner's part of a door, for a model that thinks: records each
    chat body it gets, answers THOUGHT whole or in deltas."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def model_name(self) -> str:
        return "thinker"

    def chat_job(self, body: dict[str, Any]) -> ChatJob:
        self.bodies.append(body)
        plan = ChatPlan("prompt", {}, None, ReasoningParser("qwen3"), True)
        return ChatJob(plan, [Generate("rid", input_ids=list(range(9)))], body)

    async def complete(self, job: ChatJob) -> list[ChatReply]:
        return [THOUGHT]

    async def stream(self, job: ChatJob) -> Any:
        yield ChatEvent(0, reasoning="Let me ")
        yield ChatEvent(0, reasoning="think.")
        yield ChatEvent(0, content="4", final=THOUGHT)


async def thinking_answers() -> tuple[list[Any], list[dict[str, Any]]]:
    async def body(request: web.Request) -> Any:
        return await request.json()

    server = SimpleNamespace(
        config=ServerConfig(reasoning_parser="qwen3"), model_info={}, tokenizer=None
    )
    door = SimpleNamespace(server=server, error_shapes=[], body=body)
    core = ThinkingCore()
    routes = OllamaRoutes(door, core)
    routes.runner = core
    app = web.Application()
    app.add_routes(routes.routes())
    answers: list[Any] = []
    async with TestClient(TestServer(app)) as http:
        for think, stream in ((True, False), ("high", True), (False, False)):
            call = {"model": "thinker", "messages": HELLO, "think": think, "stream": stream}
            async with http.post("/api/chat", json=call) as response:
                text = await response.text()
                answers.append([json.loads(line) for line in text.splitlines()])
        async with http.post("/api/show", json={"model": "thinker"}) as response:
            answers.append(await response.json())
    return answers, core.bodies


def test_think_maps_to_enable_thinking_and_thinking_comes_back() -> None:
    (whole, streamed, off, shown), bodies = asyncio.run(thinking_answers())
    kwargs = [b["chat_template_kwargs"] for b in bodies]
    assert kwargs == [
        {"enable_thinking": True},
        {"enable_thinking": True},
        {"enable_thinking": False},
    ]
    assert whole[0]["message"] == {"role": "assistant", "content": "4", "thinking": "Let me think."}
    assert whole[0]["eval_duration"] == 1_500_000_000 and whole[0]["prompt_eval_count"] == 9
    deltas = [line["message"] for line in streamed if not line["done"]]
    assert "".join(d.get("thinking", "") for d in deltas) == "Let me think."
    assert "".join(d["content"] for d in deltas) == "4"
    assert streamed[-1]["done"] and streamed[-1]["done_reason"] == "stop"
    assert "thinking" in shown["capabilities"]
