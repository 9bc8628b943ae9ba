"""The OpenAI-compatible API through the official `openai` client against a live server: chat
and completions, sync, async and streaming; n > 1 sharing the prompt's KV; json_schema and
regex through the constrained decoder; logprobs; usage against the tokenizer; greedy text
against the offline Engine; errors as the client's exception types."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from conftest import SHARED_KEY, Server, emptied

API_KEY = SHARED_KEY
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def runtime(keyed_server: Server) -> Server:
    return emptied(keyed_server)


@pytest.fixture(scope="module")
def client(runtime: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=runtime.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer(runtime: Server) -> Any:
    return runtime.get_tokenizer()


def server_stats(runtime: Server) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.get(runtime.url + "/server_info", headers=headers).json()["internal_states"][0]


def test_models_lists_the_served_model(client: openai.OpenAI, model: str) -> None:
    assert model == "smollm2"
    assert client.models.retrieve(model).id == model


def test_chat_greedy_equals_offline_engine_and_usage_equals_tokenizer(
    client: openai.OpenAI, model: str, tokenizer: Any, engine: Any
) -> None:
    out = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=12, temperature=0
    )
    ids = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    offline = engine.generate(
        input_ids=list(ids), sampling_params={"max_new_tokens": 12, "temperature": 0}
    )
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == offline["text"]
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == offline["meta_info"]["completion_tokens"]
    assert out.usage.total_tokens == len(ids) + out.usage.completion_tokens
    assert out.usage.prompt_tokens_details.cached_tokens >= 0
    again = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=12, temperature=0
    )
    assert again.usage.prompt_tokens_details.cached_tokens == len(ids) - 1  # all but the last
    assert choice.finish_reason in ("stop", "length")


def test_completions_greedy_equals_offline_engine(
    client: openai.OpenAI, model: str, engine: Any
) -> None:
    prompt = "The three primary colours are"
    out = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0)
    offline = engine.generate(prompt, {"max_new_tokens": 10, "temperature": 0})
    assert out.choices[0].text == offline["text"]
    assert out.usage.prompt_tokens == offline["meta_info"]["prompt_tokens"]
    batch = client.completions.create(
        model=model, prompt=[prompt, "Two plus two is"], max_tokens=4, temperature=0
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == offline["text"][: len(batch.choices[0].text)]


def test_async_client_runs_requests_concurrently(runtime: Server, model: str) -> None:
    async def main() -> list[Any]:
        client = openai.AsyncOpenAI(base_url=runtime.url + "/v1", api_key=API_KEY)
        chats = [
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"Say {w}"}],
                max_tokens=6,
                temperature=0,
            )
            for w in ("yes", "no", "maybe")
        ]
        completion = client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=6, temperature=0
        )
        results = await asyncio.gather(*chats, completion)
        await client.close()
        return results

    *chats, completion = asyncio.run(main())
    assert all(c.choices[0].message.content for c in chats)
    assert completion.choices[0].text and completion.usage.completion_tokens == 6


def test_streaming_chat_matches_the_plain_answer_and_reports_usage(
    client: openai.OpenAI, model: str
) -> None:
    kwargs = {"model": model, "messages": MESSAGES, "max_tokens": 16, "temperature": 0}
    plain = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == plain.choices[0].finish_reason and set(finals[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == (
        plain.usage.completion_tokens
    )
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_streaming_completion(client: openai.OpenAI, model: str) -> None:
    kwargs = {"model": model, "prompt": "Monday, Tuesday,", "max_tokens": 8, "temperature": 0}
    plain = client.completions.create(**kwargs)
    text = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True))
    assert text == plain.choices[0].text


def test_n_choices_share_the_prompt_kv(runtime: Server, client: openai.OpenAI, model: str) -> None:
    messages = [
        {
            "role": "user",
            "content": "Write one sentence about the sea, the wind, "
            "the lighthouse keeper and his old dog who lives by the harbour.",
        }
    ]
    httpx.post(runtime.url + "/flush_cache", headers={"Authorization": f"Bearer {API_KEY}"})
    before = server_stats(runtime)["prefill_tokens_computed"]
    out = client.chat.completions.create(
        model=model,
        messages=messages,
        n=3,
        max_tokens=12,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    computed = server_stats(runtime)["prefill_tokens_computed"] - before
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.message.content for c in out.choices}) > 1  # distinct samples
    prompt = out.usage.prompt_tokens
    assert prompt <= computed < 2 * prompt  # one prefill for three choices
    assert out.usage.completion_tokens == 3 * 12  # the prompt is counted once
    streamed = list(
        client.chat.completions.create(
            model=model, messages=messages, n=3, max_tokens=4, stream=True
        )
    )
    assert {c.choices[0].index for c in streamed if c.choices} == {0, 1, 2}


def test_response_format_json_schema_validates(client: openai.OpenAI, model: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    out = client.chat.completions.create(
        model=model,
        n=2,
        max_tokens=60,
        temperature=0.8,
        seed=3,
        response_format=fmt,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
    )
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    obj = client.chat.completions.create(
        model=model,
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give me a JSON object."}],
    )
    assert obj.choices[0].finish_reason == "length" or isinstance(
        json.loads(obj.choices[0].message.content), dict
    )


def test_response_format_structural_tag_in_xgrammar_form(client: openai.OpenAI, model: str) -> None:
    """SGLang passes xgrammar's newer structural tag (format: triggered_tags) on: the reply
    must open with the tag (at_least_one), its JSON valid, nothing after it (stop_after_first)."""
    tag = {"type": "tag", "begin": "<person>", "end": "</person>",
           "content": {"type": "json_schema", "json_schema": SCHEMA}}  # fmt: skip
    fmt = {"type": "triggered_tags", "triggers": ["<person>"], "tags": [tag],
           "at_least_one": True, "stop_after_first": True}  # fmt: skip
    out = client.chat.completions.create(
        model=model,
        max_tokens=80,
        temperature=0,
        response_format={"type": "structural_tag", "format": fmt},  # type: ignore[arg-type]
        messages=[{"role": "user", "content": "Describe a person."}],
    )
    text = out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop", text
    assert text.startswith("<person>") and text.endswith("</person>"), text
    jsonschema.validate(json.loads(text[len("<person>") : -len("</person>")]), SCHEMA)
    with pytest.raises(openai.BadRequestError, match="format"):
        client.chat.completions.create(
            model=model,
            max_tokens=4,
            response_format={"type": "structural_tag", "format": {"type": "or"}},  # type: ignore[arg-type]
            messages=[{"role": "user", "content": "Hi."}],
        )


def test_sglang_regex_and_stop(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Pick a number."}],
        max_tokens=8,
        temperature=0,
        extra_body={"regex": "[0-9]{3}"},
    )
    assert re.fullmatch("[0-9]{3}", out.choices[0].message.content)
    stopped = client.completions.create(
        model=model, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 6"]
    )
    assert " 6" not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"


def test_logprobs(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 6
    assert "".join(e.token for e in content) == out.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the top token
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-4
    completion = client.completions.create(
        model=model, prompt="Red, green,", max_tokens=4, temperature=0, logprobs=2
    )
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) <= 2 for top in lp.top_logprobs)


def test_penalties_and_seed_are_accepted(client: openai.OpenAI, model: str) -> None:
    kwargs = {
        "model": model,
        "messages": MESSAGES,
        "max_tokens": 8,
        "temperature": 0.9,
        "seed": 11,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "top_p": 0.9,
    }
    first = client.chat.completions.create(**kwargs).choices[0].message.content
    assert client.chat.completions.create(**kwargs).choices[0].message.content == first


def test_errors_are_the_clients_exception_types(
    runtime: Server, client: openai.OpenAI, model: str
) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=MESSAGES, temperature=-3)
    assert "temperature" in str(info.value)
    wrong = openai.OpenAI(base_url=runtime.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
