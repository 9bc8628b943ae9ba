"""Anthropic's Messages API as a program's backend (`sgl.Anthropic`).

    backend = sgl.Anthropic("claude-3-5-haiku-latest")   # ANTHROPIC_API_KEY; base_url= works

A chat model: the conversation goes as messages, a leading system message as `system`. The
API continues a trailing assistant message, so text the program put in the assistant's turn
before a gen is sent as that message and the answer continues it. It takes max_tokens, stop
(as stop_sequences), temperature, top_p and top_k; any other parameter set (regex, json_schema,
n > 1, penalties...) raises ValueError. select generates and matches (no logprobs here).
"""

from __future__ import annotations

from collections.abc import Iterator
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

SUPPORTED = {"max_new_tokens", "stop", "temperature", "top_p", "top_k"}
FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length"}


class Anthropic(ApiBackend):
    """SGLang's constructor: `model_name`, then arguments for `anthropic.Anthropic` (api_key,
    base_url, ...); `num_api_spec_tokens` as for OpenAI. Raises ImportError without the
    anthropic package."""

    name = "Anthropic"
    is_chat_model = True
    continues_assistant = True

    def __init__(
        self,
        model_name: str,
        *args: Any,
        chat_template: ChatTemplate | str | None = None,
        num_api_spec_tokens: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(model_name, chat_template, num_api_spec_tokens)
        self.sdk = import_sdk("anthropic", "anthropic", "Anthropic")
        self.client = self.sdk.Anthropic(*args, **kwargs)

    def complete(self, prompt: Prompt, params: dict[str, Any]) -> Completion:
        ret = self.client.messages.create(**self._request(prompt, params))
        self.count(ret.usage.input_tokens, ret.usage.output_tokens)
        text = "".join(block.text for block in ret.content if block.type == "text")
        return Completion([text], [FINISH.get(ret.stop_reason, ret.stop_reason)])

    def complete_stream(self, prompt: Prompt, params: dict[str, Any]) -> Iterator[str]:
        with self.client.messages.stream(**self._request(prompt, params)) as stream:
            yield from stream.text_stream
            usage = stream.get_final_message().usage
        self.count(usage.input_tokens, usage.output_tokens)

    def _request(self, prompt: Prompt, params: dict[str, Any]) -> dict[str, Any]:
        if params.get("n", 1) != 1:
            raise ValueError("the Anthropic API cannot honour n > 1: fork the state instead")
        given = self.checked({k: v for k, v in params.items() if k != "n"}, SUPPORTED)
        messages = chat_messages(prompt, continues_assistant=True)
        request: dict[str, Any] = {"model": self.model_name, "messages": messages}
        if messages and messages[0]["role"] == "system":
            request["system"] = messages.pop(0)["content"]
        request["max_tokens"] = given.pop("max_new_tokens", DEFAULT_MAX_TOKENS)
        stop = given.pop("stop", None)
        if stop:
            request["stop_sequences"] = list(stop)
        if given.get("top_k") == -1:  # the neutral value: the whole vocabulary
            del given["top_k"]
        if given:  # in the body: not every SDK version names them as arguments
            request["extra_body"] = given
        return request
