"""A tolerant front door, against a live server over loopback: fields the server does not know
are ignored (a warning once per name) on /generate and the OpenAI routes, and the defaults real
clients send (`tools: []`, `logit_bias: {}`, `stop_regex: []`, ...) are accepted; `logit_bias`
moves the chosen token (greedy and sampled); `stop_regex` ends generation at a match,
streaming or not; a wrong value of a known field is still a 400 in OpenAI's error shape."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from conftest import SHARED_KEY, Server, emptied
from radixflow.runtime.server import http_request
from radixflow.runtime.server.http_request import GENERATE_FIELDS, GENERATE_NOOP, check_fields

API_KEY = SHARED_KEY
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "max_new_tokens": 1}
UNKNOWN = {f"made_up_field_{i}": value for i, value in enumerate([1, "x", [1], {"a": 1}, True] * 2)}
STORY = "Once upon a time, in a small village by the sea, there lived"


@pytest.fixture(scope="module")
def runtime(keyed_server: Server) -> Server:
    return emptied(keyed_server)


@pytest.fixture(scope="module")
def http(runtime: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=runtime.url, headers=AUTH, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def client(runtime: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=runtime.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def purple(runtime: Server) -> int:
    """A token no prompt here makes likely: the one logit_bias favours."""
    return runtime.get_tokenizer().encode(" purple", add_special_tokens=False)[0]


@pytest.fixture(scope="module")
def vocab_size(http: httpx.Client) -> int:
    return http.get("/get_model_info").json()["vocab_size"]


def generate(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    response = http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def first_token(http: httpx.Client, params: dict[str, Any]) -> int:
    out = generate(http, {"text": PROMPT, "sampling_params": {**GREEDY, **params}})
    return out["output_ids"][0]


def assert_openai_error(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"], error
    assert error["type"] == "invalid_request_error"
    return error


# ---- unknown fields and clients' defaults ----------------------------------------------


def test_unknown_fields_are_ignored_with_one_warning_per_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    http_request.warn_ignored.cache_clear()
    body = {"text": "a", "future_field": 1, "other_field": {}}
    with caplog.at_level(logging.WARNING, logger="radixflow.server"):
        for _ in range(3):
            check_fields(body, GENERATE_FIELDS, GENERATE_NOOP, (), "")
    warned = [r.getMessage() for r in caplog.records if "ignoring unknown" in r.getMessage()]
    assert len(warned) == 2, warned
    assert any("future_field" in w for w in warned) and any("other_field" in w for w in warned)


def test_ten_unknown_fields_get_200_on_generate_and_chat(http: httpx.Client) -> None:
    params = {**GREEDY, "max_new_tokens": 3, **UNKNOWN}
    out = generate(http, {"text": PROMPT, "sampling_params": params, **UNKNOWN})
    assert out["meta_info"]["completion_tokens"] == 3
    body = {"messages": MESSAGES, "max_tokens": 3, "temperature": 0, **UNKNOWN}
    response = http.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


def test_clients_default_values_are_accepted(http: httpx.Client, client: openai.OpenAI) -> None:
    defaults = {"stop_regex": [], "logit_bias": {}, "n": 1, "no_stop_trim": False}
    plain = generate(http, {"text": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 4}})
    params = {**GREEDY, "max_new_tokens": 4, **defaults}
    out = generate(http, {"text": PROMPT, "sampling_params": params, "stream_options": None})
    assert out["text"] == plain["text"]
    chat_defaults = {
        "tools": [],
        "tool_choice": "none",
        "parallel_tool_calls": True,
        "logit_bias": {},
        "stream_options": None,
        "stop_regex": [],
        "logprobs": False,
        "n": 1,
    }
    response = http.post(CHAT, json={"messages": MESSAGES, "max_tokens": 3, **chat_defaults})
    assert response.status_code == 200, response.text
    for tool_choice in (None, "auto"):
        body = {"messages": MESSAGES, "max_tokens": 3, "tools": [], "tool_choice": tool_choice}
        assert http.post(CHAT, json=body).status_code == 200
    completion = client.completions.create(
        model="smollm2",
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        logit_bias={},
        extra_body={"stop_regex": [], "logprobs": False, "tools": []},
    )
    assert completion.usage.completion_tokens == 3


# ---- logit_bias --------------------------------------------------------------------------


def test_logit_bias_bans_and_favours_tokens_in_greedy_decoding(
    http: httpx.Client, purple: int
) -> None:
    greedy = first_token(http, {})
    assert greedy != purple
    banned = first_token(http, {"logit_bias": {str(greedy): -100}})
    assert banned != greedy
    assert first_token(http, {"logit_bias": {str(purple): 100}}) == purple
    assert first_token(http, {"logit_bias": {str(purple): 5}}) == greedy  # a nudge, no more


def test_logit_bias_applies_to_sampled_decoding(http: httpx.Client, purple: int) -> None:
    params = {"temperature": 1.0, "max_new_tokens": 4, "seed": 7}
    out = generate(http, {"text": PROMPT, "sampling_params": params})
    assert out["output_ids"] != [purple] * 4
    params["logit_bias"] = {str(purple): 100}
    out = generate(http, {"text": PROMPT, "sampling_params": params})
    assert out["output_ids"] == [purple] * 4


def test_logit_bias_through_the_openai_client(
    http: httpx.Client, client: openai.OpenAI, runtime: Server, purple: int
) -> None:
    greedy = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=1, temperature=0)
    token = first_token(http, {})
    banned = client.completions.create(
        model="smollm2",
        prompt=PROMPT,
        max_tokens=1,
        temperature=0,
        logit_bias={str(token): -100},
    )
    assert banned.choices[0].text != greedy.choices[0].text
    chat = client.chat.completions.create(
        model="smollm2",
        messages=MESSAGES,
        max_tokens=3,
        temperature=0,
        extra_body={"logit_bias": {str(purple): 100}},
    )
    assert chat.choices[0].message.content == runtime.get_tokenizer().decode([purple] * 3)


# ---- stop_regex ------------------------------------------------------------------------


def stop_pattern(text: str) -> str:
    """A regex (not a plain string) that first matches at a word in the middle of `text`."""
    words = re.findall(r"[A-Za-z]{4,}", text[len(text) // 3 :])
    assert words, text
    word = words[0]
    return rf"(?:zzqx|{re.escape(word[:-1])}[{word[-1]}])"


def sse_texts(response: httpx.Response) -> list[dict[str, Any]]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: ") :]))
    return events


def test_stop_regex_stops_generation_streaming_or_not(http: httpx.Client) -> None:
    params = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
    full = generate(http, {"text": STORY, "sampling_params": params})["text"]
    pattern = stop_pattern(full)
    body = {"text": STORY, "sampling_params": {**params, "stop_regex": pattern}}
    out = generate(http, body)
    text, meta = out["text"], out["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": pattern}
    assert meta["completion_tokens"] < 32 and full.startswith(text)
    assert re.search(pattern, text) and len(text) < len(full)
    with http.stream("POST", "/generate", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        events = sse_texts(response)
    assert events[-1]["text"] == text
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}


def test_stop_regex_on_the_openai_routes(http: httpx.Client, client: openai.OpenAI) -> None:
    kwargs = {"model": "smollm2", "prompt": STORY, "max_tokens": 32, "temperature": 0}
    full = client.completions.create(**kwargs).choices[0].text
    pattern = stop_pattern(full)
    out = client.completions.create(**kwargs, extra_body={"stop_regex": [pattern]})
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and full.startswith(choice.text)
    assert re.search(pattern, choice.text) and len(choice.text) < len(full)
    streamed = client.completions.create(**kwargs, stream=True, extra_body={"stop_regex": pattern})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == "stop"


# ---- wrong values stay 400s ------------------------------------------------------------

# (fields, the name the error message gives)
BAD_CHAT = [
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": -1}, "max_new_tokens"),  # SamplingParams' name for it
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "high"}}, "logit_bias"),
    ({"logit_bias": [5]}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"stop_regex": "("}, "stop_regex"),
    ({"stop_regex": ["ok", "[z-a]"]}, "stop_regex"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
]


@pytest.mark.parametrize(("fields", "name"), BAD_CHAT, ids=[json.dumps(b) for b, _ in BAD_CHAT])
def test_wrong_values_are_openai_shaped_400s_on_chat(
    http: httpx.Client, fields: dict[str, Any], name: str
) -> None:
    response = http.post(CHAT, json={"messages": MESSAGES, "max_tokens": 2, **fields})
    error = assert_openai_error(response)
    assert name in error["message"], error


BAD_SAMPLING = [
    {"temperature": "hot"},
    {"max_new_tokens": -1},
    {"logit_bias": {"-3": 1}},
    {"logit_bias": {"5": -100.5}},
    {"stop_regex": "a{99999999999}"},
    {"stop_regex": [7]},
]


@pytest.mark.parametrize("params", BAD_SAMPLING, ids=[json.dumps(b) for b in BAD_SAMPLING])
def test_wrong_values_are_400s_on_generate(http: httpx.Client, params: dict[str, Any]) -> None:
    response = http.post("/generate", json={"text": PROMPT, "sampling_params": params})
    error = assert_openai_error(response)
    assert next(iter(params)) in error["message"] + str(error["param"])


def test_logit_bias_outside_the_vocabulary_is_a_400(
    http: httpx.Client, client: openai.OpenAI, vocab_size: int
) -> None:
    params = {**GREEDY, "logit_bias": {str(vocab_size): 1}}
    response = http.post("/generate", json={"text": PROMPT, "sampling_params": params})
    assert "logit_bias" in assert_openai_error(response)["message"]
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.chat.completions.create(
            model="smollm2",
            messages=MESSAGES,
            max_tokens=1,
            logit_bias={str(vocab_size - 1): 1, str(vocab_size + 5): 1},
        )
    with pytest.raises(openai.BadRequestError, match="stop_regex"):
        client.chat.completions.create(
            model="smollm2", messages=MESSAGES, max_tokens=1, extra_body={"stop_regex": "(?<=a+)"}
        )
    assert http.get("/health").status_code == 200
