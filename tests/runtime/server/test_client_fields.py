"""What other runtimes' clients send, through the official `openai` client (`extra_body`)
against a live server: vLLM's guided_* and structured_outputs and llama.cpp's grammar and
json_schema each constrain the reply (a dropped one would leave the text free and fail the
check), each sampler radixflow lacks is a 400 naming it; a trailing assistant message is
continued; echo with logprobs gives the prompt's logprobs (lm-evaluation-harness's
loglikelihood request); reasoning_effort is taken. The table itself (fields.py against
docs/http.md, every entry) is tested without a server in test_fields.py."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from conftest import Server

ASK = [{"role": "user", "content": "Describe a person."}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
GBNF = 'root ::= "id-" [0-9] [0-9] [0-9]'
GREEDY = {"temperature": 0, "max_tokens": 40}


@pytest.fixture(scope="module")
def runtime(shared_server: Server) -> Server:
    return shared_server


@pytest.fixture(scope="module")
def client(runtime: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=runtime.url + "/v1", api_key="none", max_retries=0)


def chat(client: openai.OpenAI, messages: list[dict] = ASK, **extra: Any) -> Any:
    return client.chat.completions.create(
        model="smollm2", messages=messages, extra_body=extra, **GREEDY
    )


def content(client: openai.OpenAI, **extra: Any) -> str:
    return chat(client, **extra).choices[0].message.content


@pytest.mark.parametrize(
    "extra",
    [
        {"guided_json": SCHEMA},
        {"structured_outputs": {"json": SCHEMA}},
        {"json_schema": SCHEMA},  # llama.cpp sends an object
    ],
    ids=["guided_json", "structured_outputs.json", "json_schema-object"],
)
def test_json_spellings_validate(client: openai.OpenAI, extra: dict) -> None:
    jsonschema.validate(json.loads(content(client, **extra)), SCHEMA)


@pytest.mark.parametrize(
    "extra, pattern",
    [
        ({"guided_regex": r"[A-Z][a-z]{2,6} is [0-9]{2}"}, r"[A-Z][a-z]{2,6} is [0-9]{2}"),
        ({"structured_outputs": {"regex": r"Age: [0-9]{2}"}}, r"Age: [0-9]{2}"),
        ({"guided_choice": ["tall person", "short person"]}, r"tall person|short person"),
        ({"structured_outputs": {"choice": ["red", "blue"]}}, r"red|blue"),
        ({"guided_grammar": GBNF}, r"id-[0-9]{3}"),
        ({"grammar": GBNF}, r"id-[0-9]{3}"),
        ({"structured_outputs": {"grammar": GBNF}}, r"id-[0-9]{3}"),
    ],
    ids=lambda value: next(iter(value)) if isinstance(value, dict) else "",
)
def test_constraint_spellings_constrain(client: openai.OpenAI, extra: dict, pattern: str) -> None:
    text = content(client, **extra)
    assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize(
    "field, value",
    [("typical_p", 0.9), ("dry_multiplier", 0.8), ("xtc_probability", 0.5), ("mirostat", 2)],
)
def test_a_sampler_radixflow_lacks_is_refused_by_name(
    client: openai.OpenAI, field: str, value: Any
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, **{field: value})
    assert field in str(caught.value) and "instead" in str(caught.value)


def test_llama_cpp_webui_defaults_are_accepted(client: openai.OpenAI) -> None:
    """llama.cpp's web UI sends every sampler at its off value: nothing to refuse."""
    off = {"typical_p": 1, "dry_multiplier": 0, "dry_base": 1.75, "xtc_probability": 0,
           "xtc_threshold": 0.1, "repeat_last_n": 64, "repeat_penalty": 1.0, "cache_prompt": True,
           "samplers": "edkypmxt"}  # fmt: skip
    reply = chat(client, **off)
    assert reply.choices[0].message.content


def test_a_trailing_assistant_message_is_continued(client: openai.OpenAI, runtime: Server) -> None:
    """The reply continues "The sky is" (no new turn): the same greedy text as a raw
    completion of the prompt that ends in it."""
    messages = [*ASK[:0], {"role": "user", "content": "What color is the sky?"}]
    messages.append({"role": "assistant", "content": "The sky is"})
    continued = chat(client, messages)
    new_turn = chat(client, messages, continue_final_message=False)
    tokenizer = runtime.get_tokenizer()
    prefix = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert prefix.endswith("The sky is")
    raw = client.completions.create(model="smollm2", prompt=prefix, **GREEDY)
    assert continued.choices[0].message.content == raw.choices[0].text
    assert continued.usage.prompt_tokens == raw.usage.prompt_tokens
    assert new_turn.usage.prompt_tokens > continued.usage.prompt_tokens  # a closed turn + header
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        chat(client, ASK, continue_final_message=True)


def test_echo_with_logprobs_scores_the_prompt(client: openai.OpenAI, runtime: Server) -> None:
    """lm-evaluation-harness's loglikelihood request: echo, logprobs=1, max_tokens 0 or 1;
    the prompt's logprobs are /generate's input logprobs."""
    prompt = "The capital of France is Paris"
    scored = client.completions.create(
        model="smollm2", prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0
    ).choices[0]
    assert scored.text.startswith(prompt)
    native = httpx.post(
        runtime.url + "/generate",
        json={"text": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
              "return_logprob": True, "logprob_start_len": 0},
        timeout=60,
    ).json()["meta_info"]  # fmt: skip
    expected = [e[0] for e in native["input_token_logprobs"]]
    got = scored.logprobs.token_logprobs
    assert len(got) == len(expected) + 1 and got[0] is None and expected[0] is None
    assert got[1:-1] == pytest.approx(expected[1:], abs=1e-4)
    assert "".join(scored.logprobs.tokens) == scored.text
    assert scored.logprobs.top_logprobs[0] is None and len(scored.logprobs.top_logprobs[1]) >= 1
    none = client.completions.create(
        model="smollm2", prompt=prompt, echo=True, logprobs=0, max_tokens=0
    ).choices[0]
    assert none.text == prompt and none.logprobs.token_logprobs[1:] == pytest.approx(
        expected[1:], abs=1e-4
    )


def test_reasoning_effort_is_taken(client: openai.OpenAI) -> None:
    """Taken, not a 400 (SmolLM2's template has no thinking switch: the effect of each value
    on a thinking template is tested on the plan in test_fields.py)."""
    reply = client.chat.completions.create(
        model="smollm2", messages=ASK, reasoning_effort="low", max_tokens=4
    )
    assert reply.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        chat(client, reasoning_effort="extreme")


def test_priority_needs_priority_scheduling(client: openai.OpenAI, runtime: Server) -> None:
    """This server runs without --enable-priority-scheduling: a priority it would not honour
    is refused (the overtaking itself is tested on the scheduler)."""
    assert chat(client, priority=0).choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="enable-priority-scheduling"):
        chat(client, priority=2)
    native = httpx.post(runtime.url + "/generate", json={"text": "Hi", "priority": 3}, timeout=60)
    assert native.status_code == 400 and "priority" in native.text
