"""A tools template given with --chat-template (a Qwen-style one: tools in the system turn,
calls as <tool_call> blocks, `enable_thinking`), on SmolLM2 with --reasoning-parser qwen3: the
hermes format is inferred from the template, required calls come out of its grammar and parse,
streamed too; reasoning_content is split from content, streamed too; enable_thinking false and
separate_reasoning false are honoured."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from test_tools_openai import ASK, PARAMS, TOOLS, valid_calls

from conftest import start_server

TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these tools:
<tools>{% for t in tools %}
{{ t | tojson }}{% endfor %}
</tools>
Reply with <tool_call>{"name": ..., "arguments": ...}</tool_call> for each call.<|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""
THINK = r"<think>\n[a-z ]{3,30}\n</think>\n\n[A-Za-z ]{3,30}"  # a reply with a think block
# With a reasoning parser a constraint starts after </think>; a structural tag that sets its own
# `after` ("" here: from the first token) keeps it, so the regex can shape the think block too.
WHOLE = {"type": "structural_tag", "structures": [{"begin": "", "regex": THINK, "end": ""}],
         "triggers": [""], "after": "", "stop_after_first": True}  # fmt: skip
FORCE = {"response_format": WHOLE}
# thinking on, the tools' grammar would wait for a </think> SmolLM2 never writes
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    with start_server(chat_template=TEMPLATE, reasoning_parser="qwen3") as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=600)


def test_hermes_calls_from_the_templates_format(client: openai.OpenAI) -> None:
    for stream in (False, True):
        reply = client.chat.completions.create(
            model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=96,
            temperature=0, stream=stream, extra_body=NO_THINKING,
        )  # fmt: skip
        if not stream:
            assert reply.choices[0].finish_reason == "tool_calls"
            assert valid_calls(reply.choices[0].message, PARAMS)
            continue
        calls, finish = {}, None
        for chunk in reply:
            for choice in chunk.choices:
                for delta in choice.delta.tool_calls or []:
                    calls[delta.index] = delta.function
                finish = choice.finish_reason or finish
        assert finish == "tool_calls" and calls
        for function in calls.values():
            assert json.loads(function.arguments) is not None and function.name in PARAMS


def test_reasoning_is_split_from_content(client: openai.OpenAI) -> None:
    kwargs = {"model": "smollm2", "messages": ASK, "max_tokens": 64, "temperature": 0}
    reply = client.chat.completions.create(**kwargs, extra_body=FORCE)
    message = reply.choices[0].message.model_dump()
    assert message["reasoning_content"] and "<think>" not in message["content"]
    assert "</think>" not in message["reasoning_content"]
    stream = client.chat.completions.create(**kwargs, stream=True, extra_body=FORCE)
    reasoning = content = ""
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
    assert (reasoning, content) == (message["reasoning_content"], message["content"])


def test_thinking_off_and_unseparated(client: openai.OpenAI) -> None:
    kwargs = {"model": "smollm2", "messages": ASK, "max_tokens": 64, "temperature": 0}
    on = client.chat.completions.create(**kwargs)
    off = client.chat.completions.create(
        **kwargs, extra_body={"regex": THINK, "chat_template_kwargs": {"enable_thinking": False}}
    )
    # the template closed an empty think block in the prompt; the reply is all content
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    assert off.choices[0].message.model_dump().get("reasoning_content") is None
    assert off.choices[0].message.content.startswith("<think>")
    whole = client.chat.completions.create(
        **kwargs, extra_body={**FORCE, "separate_reasoning": False}
    )
    assert whole.choices[0].message.content.startswith("<think>")
