"""LiteLLM as a program's backend (`sgl.LiteLLM`): one interface to many providers' chat APIs.

    backend = sgl.LiteLLM("gpt-4o-mini")
    backend = sgl.LiteLLM("openai/smollm2", base_url="http://localhost:30000/v1", api_key="x")

A chat model: the conversation goes as messages (`gen` right after `sgl.assistant()`). It takes
max_tokens, stop, temperature, top_p, the penalties, n, seed and json_schema (as
response_format); any other parameter set raises ValueError. select generates and matches.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from radixflow.backends.api import (
    DEFAULT_MAX_TOKENS,
    ApiBackend,
    Completion,
    Prompt,
    chat_messages,
    import_sdk,
)
from radixflow.chat_template import ChatTemplate

PASSED = ("n", "temperature", "top_p", "frequency_penalty", "presence_penalty", "seed")
SUPPORTED = {*PASSED, "max_new_tokens", "stop", "json_schema"}


class LiteLLM(ApiBackend):
    """SGLang's constructor (`model_name`, `chat_template`, `api_key`, `organization`,
    `base_url`, `timeout`, `max_retries`, `default_headers`), plus `num_api_spec_tokens` as
    for OpenAI. Raises ImportError without the litellm package."""

    name = "LiteLLM"
    is_chat_model = True

    def __init__(
        self,
        model_name: str,
        chat_template: ChatTemplate | str | None = None,
        api_key: str | None = None,
        organization: str | None = None,
        base_url: str | None = None,
        timeout: float | None = 600,
        max_retries: int | None = None,
        default_headers: Mapping[str, str] | None = None,
        num_api_spec_tokens: int | None = None,
    ) -> None:
        super().__init__(model_name, chat_template, num_api_spec_tokens)
        self.sdk = import_sdk("litellm", "litellm", "LiteLLM")
        self.client_params = {
            "api_key": api_key,
            "organization": organization,
            "base_url": base_url,
            "timeout": timeout,
            "max_retries": self.sdk.num_retries if max_retries is None else max_retries,
            "default_headers": default_headers,
        }

    def complete(self, prompt: Prompt, params: dict[str, Any]) -> Completion:
        ret = self.sdk.completion(**self._request(prompt, params))
        usage = getattr(ret, "usage", None)
        self.count(usage.prompt_tokens if usage else 0, usage.completion_tokens if usage else 0)
        choices = sorted(ret.choices, key=lambda c: c.index)
        texts = [c.message.content or "" for c in choices]
        return Completion(texts, [c.finish_reason for c in choices])

    def complete_stream(self, prompt: Prompt, params: dict[str, Any]) -> Iterator[str]:
        for chunk in self.sdk.completion(**self._request(prompt, params), stream=True):
            piece = chunk.choices[0].delta.content if chunk.choices else None
            if piece:
                yield piece
        self.count(0, 0)  # a stream reports no usage here

    def _request(self, prompt: Prompt, params: dict[str, Any]) -> dict[str, Any]:
        given = self.checked(params, SUPPORTED)
        request: dict[str, Any] = {
            "model": self.model_name,
            "messages": chat_messages(prompt, continues_assistant=False),
            **self.client_params,
            "max_tokens": given.get("max_new_tokens", DEFAULT_MAX_TOKENS),
        }
        request.update({k: v for k, v in given.items() if k in PASSED})
        if given.get("stop"):
            request["stop"] = list(given["stop"])
        if given.get("json_schema"):
            schema = {"name": "output", "schema": json.loads(given["json_schema"])}
            request["response_format"] = {"type": "json_schema", "json_schema": schema}
        return request
