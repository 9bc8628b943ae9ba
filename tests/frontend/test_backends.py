"""The hosted-API backends without a model: Anthropic against a stub of its Messages API on
loopback (an exchange written in the API's documented shapes, played back by aiohttp), LiteLLM
through a stand-in module, the errors for a missing SDK and for Vertex AI, select's fallback
match, and the matching rules of API speculative execution."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web

import radixflow as sgl
from radixflow.backends.api import ApiBackend, Completion, Prompt, chat_messages, closest_choice
from radixflow.speculative import ChatSpeculation, CompletionSpeculation

# ---- Anthropic, against a stub of /v1/messages -----------------------------------------------

# The exchange of `capitals` below: what the program must send, what the API answers.
SYSTEM = "Answer in a few words."
ASK_1 = {
    "model": "claude-test",
    "system": SYSTEM,
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 16,
    "temperature": 0.0,
    "stop_sequences": ["\n"],
}
ANSWER_1 = {
    "id": "msg_01",
    "type": "message",
    "role": "assistant",
    "model": "claude-test",
    "content": [{"type": "text", "text": "Paris."}],
    "stop_reason": "end_turn",
    "stop_sequence": None,
    "usage": {"input_tokens": 21, "output_tokens": 3},
}
ASK_2 = {  # the assistant's started turn goes as a trailing message, which the API continues
    **ASK_1,
    "messages": [
        *ASK_1["messages"],
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "The capital of Italy is"},
    ],
}
ANSWER_2 = {**ANSWER_1, "id": "msg_02", "content": [{"type": "text", "text": " Rome."}]}
STREAMED = [" Ro", "me", "."]


def sse(answer: dict[str, Any], pieces: list[str]) -> bytes:
    """The Messages API's event stream for `answer` written as `pieces`."""
    start = {**answer, "content": [], "stop_reason": None}
    events = [
        ("message_start", {"type": "message_start", "message": start}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        *[
            ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                     "delta": {"type": "text_delta", "text": piece}})
            for piece in pieces
        ],
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "usage": {"output_tokens": 3},
                           "delta": {"stop_reason": "end_turn", "stop_sequence": None}}),
        ("message_stop", {"type": "message_stop"}),
    ]  # fmt: skip
    return b"".join(f"event: {e}\ndata: {json.dumps(d)}\n\n".encode() for e, d in events)


class MessagesStub:
    """/v1/messages on a loopback port, answering the recorded requests in order; `requests`
    holds each body it got."""

    def __init__(self, answers: list[dict[str, Any]]) -> None:
        self.answers, self.requests = list(answers), []
        self.loop = asyncio.new_event_loop()
        self.started = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()
        assert self.started.wait(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/v1/messages", self.messages)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self.started.set()
        self.loop.run_forever()

    async def messages(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        keys = (request.headers.get("x-api-key"), request.headers.get("Authorization"))
        if "test-key" not in keys and "Bearer test-key" not in keys:  # SDK versions differ
            return web.json_response({"type": "error"}, status=401)
        answer = self.answers.pop(0)
        if not body.get("stream"):
            return web.json_response(answer)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(sse(answer, STREAMED))
        await response.write_eof()
        return response

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def stub() -> Iterator[MessagesStub]:
    server = MessagesStub([ANSWER_1, ANSWER_2])
    yield server
    server.close()


@sgl.function
def capitals(s: Any) -> None:
    s += sgl.system(SYSTEM)
    s += sgl.user("What is the capital of France?")
    s += sgl.assistant(sgl.gen("france", max_tokens=16, stop="\n"))
    s += sgl.user("And of Italy?")
    s += sgl.assistant("The capital of Italy is" + sgl.gen("italy", max_tokens=16, stop="\n"))


def test_anthropic_sends_the_conversation_and_continues_the_assistant(stub: MessagesStub) -> None:
    backend = sgl.Anthropic("claude-test", base_url=stub.url, api_key="test-key", max_retries=0)
    state = capitals.run(backend=backend, temperature=0)
    assert state.error() is None, state.error()
    assert stub.requests == [ASK_1, ASK_2]
    assert (state["france"], state["italy"]) == ("Paris.", " Rome.")
    assert state.messages()[-1] == {"role": "assistant", "content": "The capital of Italy is Rome."}
    assert backend.usage.num_calls == 2 and backend.usage.prompt_tokens == 42


def test_anthropic_streams_and_refuses_what_its_api_lacks(stub: MessagesStub) -> None:
    backend = sgl.Anthropic("claude-test", base_url=stub.url, api_key="test-key", max_retries=0)
    stub.answers = [ANSWER_2]

    @sgl.function
    def one(s: Any) -> None:
        s += sgl.user("And of Italy?")
        s += sgl.assistant(sgl.gen("italy", max_tokens=16))

    state = one.run(backend=backend, stream=True)
    assert list(state.text_iter("italy")) == STREAMED and state["italy"] == " Rome."
    assert stub.requests[-1]["stream"] is True
    for bad in ({"regex": "[0-9]+"}, {"n": 2}, {"frequency_penalty": 0.5}):
        refused = one.run(backend=backend, **bad)
        assert isinstance(refused.error(), ValueError), bad
        assert next(iter(bad)) in str(refused.error()) or "n > 1" in str(refused.error())
    assert len(stub.requests) == 1  # nothing was sent for them


# ---- LiteLLM through a stand-in module ------------------------------------------------------


def test_litellm_calls_completion_with_the_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []

    def completion(**kwargs: Any) -> Any:
        calls.append(kwargs)
        message = SimpleNamespace(content="Paris.")
        choice = SimpleNamespace(index=0, message=message, finish_reason="stop")
        usage = SimpleNamespace(prompt_tokens=9, completion_tokens=2)
        return SimpleNamespace(choices=[choice], usage=usage)

    monkeypatch.setitem(
        sys.modules, "litellm", SimpleNamespace(num_retries=1, completion=completion)
    )
    backend = sgl.LiteLLM("openai/smollm2", base_url="http://x/v1", api_key="k")

    @sgl.function
    def one(s: Any) -> None:
        s += sgl.system(SYSTEM)
        s += sgl.user("What is the capital of France?")
        s += sgl.assistant(sgl.gen("france", max_tokens=16, stop="\n"))

    assert one.run(backend=backend, temperature=0)["france"] == "Paris."
    (call,) = calls
    assert call["model"] == "openai/smollm2" and call["messages"] == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    assert (call["max_tokens"], call["stop"], call["temperature"]) == (16, ["\n"], 0.0)
    assert (call["base_url"], call["api_key"], call["max_retries"]) == ("http://x/v1", "k", 1)


# ---- the SDK, Vertex AI ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "backend, module, args",
    [("OpenAI", "openai", ("gpt-4o",)), ("Anthropic", "anthropic", ("claude",)),
     ("LiteLLM", "litellm", ("gpt-4o",))],
)  # fmt: skip
def test_a_missing_sdk_names_its_pip_package(
    backend: str, module: str, args: tuple[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError
    with pytest.raises(ImportError, match=f"pip install {module}"):
        getattr(sgl, backend)(*args)


def test_vertexai_says_it_is_not_supported() -> None:
    with pytest.raises(NotImplementedError, match="does not support the Vertex AI backend"):
        sgl.VertexAI("gemini-pro")


# ---- select's fallback, speculation's matching -------------------------------------------------


def test_the_closest_choice() -> None:
    choices = ["True", "False", "Maybe"]
    assert closest_choice(" False, because", choices) == 1  # starts with it
    assert closest_choice("I would say maybe... no: True", choices) == 0  # mentions it first
    assert closest_choice("Fals", choices) == 1  # most similar
    assert closest_choice("organism", ["organ", "organism"]) == 1  # the longest it starts with


def test_completion_speculation_keeps_what_the_program_confirms() -> None:
    spec = CompletionSpeculation(64)
    spec.refill(" Rome\nLanguage: Italian\n\nCountry: Spain", ended=False)
    assert spec.take(["\n"]) == " Rome"
    spec.on_text("\nLanguage:")
    assert spec.take(["\n"]) == " Italian"
    spec.on_text("\n\nCountry:")
    assert spec.take(["\n"]) is None  # no stop in sight and the call was cut: ask again
    spec.refill(" Spain", ended=True)
    assert spec.take(["\n"]) == " Spain" and spec.text == ""  # the model ended there
    spec.refill(" Rome\nAge: 3", ended=False)
    spec.take(["\n"])
    spec.on_text("\nLanguage:")  # the program went another way: the speculation is dropped
    assert spec.text == "" and spec.take(["\n"]) is None


def test_chat_speculation_matches_a_turn_from_one_answer() -> None:
    spec = ChatSpeculation(32)
    spec.add_text("Name: ")
    spec.add_gen("name", {"stop": ["\n"], "temperature": 0.0, "max_new_tokens": 8})
    spec.add_text("\nField: ")
    spec.add_gen("field", {"stop": ["\n"], "temperature": 0.0, "max_new_tokens": 8})
    filled = spec.match("Name: Marie Curie\nField: chemistry")
    assert [(t.text, t.name) for t in filled] == [
        ("Name: ", None), ("Marie Curie", "name"), ("\nField: ", None), ("chemistry", "field")
    ]  # fmt: skip
    assert spec.match("Marie Curie, chemistry") is None  # not the turn's text
    assert spec.call_params() == {"temperature": 0.0, "max_new_tokens": 32, "stop": []}
    with pytest.raises(ValueError, match="share"):
        spec.add_gen("x", {"stop": [], "temperature": 0.7})


class CannedChat(ApiBackend):
    """A chat API that answers every call with the next canned text."""

    name = "canned"

    def __init__(self, answers: list[str], num_api_spec_tokens: int | None = None) -> None:
        super().__init__("canned", num_api_spec_tokens=num_api_spec_tokens)
        self.answers, self.prompts = list(answers), []

    def complete(self, prompt: Prompt, params: dict[str, Any]) -> Completion:
        self.prompts.append((chat_messages(prompt, False), params))
        self.count(0, 0)
        return Completion([self.answers.pop(0)], ["stop"])


def test_a_speculated_turn_is_read_after_it_ends() -> None:
    @sgl.function(num_api_spec_tokens=16)
    def card(s: Any, read_inside: bool) -> None:
        s += sgl.user("Who discovered radium?")
        with s.assistant():
            s += "Name: " + sgl.gen("name", stop="\n") + "\nField: " + sgl.gen("field")
            if read_inside:
                s["name"]  # noqa: B018 (the read under test)

    backend = CannedChat(["Name: Marie Curie\nField: chemistry"] * 2)
    state = card.run(read_inside=False, backend=backend, temperature=0)
    assert (state["name"], state["field"]) == ("Marie Curie", "chemistry")
    ((messages, params),) = backend.prompts
    assert messages == [{"role": "user", "content": "Who discovered radium?"}]
    assert params == {"temperature": 0, "max_new_tokens": 16, "stop": []}
    inside = card.run(read_inside=True, backend=backend, temperature=0)
    assert "read it after the turn" in str(inside.error())
