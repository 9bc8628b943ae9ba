"""OpenAI's API as a program's backend (`sgl.OpenAI`), or any server that speaks it (radixflow's
own /v1, vLLM, SGLang) through `base_url`.

    backend = sgl.OpenAI("gpt-4o-mini")                                  # OPENAI_API_KEY
    backend = sgl.OpenAI("smollm2", base_url="http://localhost:30000/v1", api_key="EMPTY")
    backend = sgl.OpenAI("gpt-3.5-turbo-instruct", is_chat_model=False)  # /v1/completions

A chat model gets the conversation (`gen` right after `sgl.assistant()`), a completion model
the program's text. OpenAI's own fields (max_tokens, n, stop, temperature, top_p, penalties,
seed, logit_bias; json_schema as response_format) go as such; SGLang's extras (regex, ebnf,
stop_regex, top_k, min_p, min_tokens, ...) go in the request body, which radixflow and SGLang
servers honour and OpenAI refuses. select on a completion model scores each choice from one
echo+logprobs call; a chat model (or an API without echo) generates and matches.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from radixflow.backends.api import (
    DEFAULT_MAX_TOKENS,
    NEUTRAL,
    ApiBackend,
    Completion,
    Prompt,
    chat_messages,
    import_sdk,
)
from radixflow.chat_template import ChatTemplate

INSTRUCT_MODEL_NAMES = ("gpt-3.5-turbo-instruct",)  # completion models, as SGLang lists them
OPENAI_FIELDS = {  # ours -> OpenAI's
    "n": "n",
    "temperature": "temperature",
    "top_p": "top_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "seed": "seed",
    "logit_bias": "logit_bias",
}
EXTRA_FIELDS = {  # ours -> the body field of radixflow's and SGLang's servers
    "top_k": "top_k",
    "min_p": "min_p",
    "min_new_tokens": "min_tokens",
    "repetition_penalty": "repetition_penalty",
    "regex": "regex",
    "ebnf": "ebnf",
    "structural_tag": "structural_tag",
    "stop_regex": "stop_regex",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
}
SUPPORTED = {*OPENAI_FIELDS, *EXTRA_FIELDS, "max_new_tokens", "stop", "json_schema"}


class OpenAI(ApiBackend):
    """SGLang's constructor: `model_name`, `is_chat_model` (default: a chat model unless
    SGLang lists it as an instruct one), `chat_template` (formats the program's text;
    SGLang's default), `is_azure`; other arguments go to `openai.OpenAI` (api_key, base_url,
    ...). `num_api_spec_tokens` sets API speculative execution for programs on this backend
    (a @function's own setting wins). Raises ImportError without the openai package."""

    name = "OpenAI"

    def __init__(
        self,
        model_name: str,
        is_chat_model: bool | None = None,
        chat_template: ChatTemplate | str | None = None,
        is_azure: bool = False,
        *args: Any,
        num_api_spec_tokens: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(model_name, chat_template, num_api_spec_tokens)
        self.sdk = import_sdk("openai", "openai", "OpenAI")
        client = self.sdk.AzureOpenAI if is_azure else self.sdk.OpenAI
        self.client = client(*args, **kwargs)
        if is_chat_model is None:
            is_chat_model = model_name not in INSTRUCT_MODEL_NAMES
        self.is_chat_model = is_chat_model

    @property
    def token_usage(self) -> Any:
        """SGLang's name for the usage counts."""
        return self.usage

    def complete(self, prompt: Prompt, params: dict[str, Any]) -> Completion:
        kwargs = self._kwargs(params)
        if self.is_chat_model:
            messages = chat_messages(prompt, continues_assistant=False)
            ret = self.client.chat.completions.create(
                model=self.model_name, messages=messages, **kwargs
            )
            choices = sorted(ret.choices, key=lambda c: c.index)
            texts = [c.message.content or "" for c in choices]
        else:
            ret = self.client.completions.create(
                model=self.model_name, prompt=prompt.text, **kwargs
            )
            choices = sorted(ret.choices, key=lambda c: c.index)
            texts = [c.text for c in choices]
        if ret.usage is not None:
            self.count(ret.usage.prompt_tokens, ret.usage.completion_tokens)
        else:
            self.count(0, 0)
        return Completion(texts, [c.finish_reason for c in choices])

    def complete_stream(self, prompt: Prompt, params: dict[str, Any]) -> Iterator[str]:
        kwargs = {**self._kwargs(params), "stream": True}
        kwargs["stream_options"] = {"include_usage": True}
        if self.is_chat_model:
            messages = chat_messages(prompt, continues_assistant=False)
            events = self.client.chat.completions.create(
                model=self.model_name, messages=messages, **kwargs
            )
        else:
            events = self.client.completions.create(
                model=self.model_name, prompt=prompt.text, **kwargs
            )
        usage = None
        for event in events:
            usage = event.usage or usage
            if event.choices:
                choice = event.choices[0]
                piece = choice.delta.content if self.is_chat_model else choice.text
                if piece:
                    yield piece
        self.count(usage.prompt_tokens if usage else 0, usage.completion_tokens if usage else 0)

    def score(
        self, prefix: str, continuations: list[str], unconditional: bool
    ) -> list[tuple[list[Any], list[Any] | None]] | None:
        """One completions call with echo and logprobs over `prefix + choice` (and each
        choice alone when unconditional): a choice's tokens are those that end past the
        prefix, so a token merging the prefix's last space with the choice counts. None when
        the API refuses echo with logprobs (newer OpenAI models)."""
        prompts = [prefix + c for c in continuations]
        prompts += list(continuations) if unconditional else []
        try:
            ret = self.client.completions.create(
                model=self.model_name, prompt=prompts, echo=True, max_tokens=0, logprobs=0
            )
        except self.sdk.BadRequestError:
            return None
        self.count(ret.usage.prompt_tokens if ret.usage else 0, 0)
        choices = sorted(ret.choices, key=lambda c: c.index)
        num = len(continuations)
        entries = [
            _entries(c.logprobs, len(prefix) if i < num else 0) for i, c in enumerate(choices)
        ]
        return [(entries[i], entries[num + i] if unconditional else None) for i in range(num)]

    def _kwargs(self, params: dict[str, Any]) -> dict[str, Any]:
        """The call's keyword arguments: OpenAI's fields, the others in `extra_body`."""
        given = self.checked(params, SUPPORTED)
        max_key = "max_completion_tokens" if _reasoning_model(self.model_name) else "max_tokens"
        kwargs: dict[str, Any] = {max_key: given.get("max_new_tokens", DEFAULT_MAX_TOKENS)}
        kwargs.update({OPENAI_FIELDS[k]: v for k, v in given.items() if k in OPENAI_FIELDS})
        if given.get("stop"):
            kwargs["stop"] = list(given["stop"])
        extra = {
            EXTRA_FIELDS[k]: list(v) if isinstance(v, tuple) else v
            for k, v in given.items()
            if k in EXTRA_FIELDS and v != NEUTRAL.get(k)
        }
        if given.get("json_schema"):
            schema = {"name": "output", "schema": json.loads(given["json_schema"])}
            response_format = {"type": "json_schema", "json_schema": schema}
            if self.is_chat_model:
                kwargs["response_format"] = response_format
            else:  # not a parameter of the SDK's completions.create
                extra["response_format"] = response_format
        if extra:
            kwargs["extra_body"] = extra
        return kwargs


def _reasoning_model(model_name: str) -> bool:
    """o1/o3-style models take max_completion_tokens only (SGLang's test)."""
    return model_name.startswith(("o1", "o3")) or "o1" in model_name


def _entries(logprobs: Any, start: int) -> list[list[Any]]:
    """[logprob, None, token] of the echoed tokens that end past character `start`."""
    rows = zip(logprobs.tokens, logprobs.token_logprobs, logprobs.text_offset)
    return [[lp, None, token] for token, lp, offset in rows if offset + len(token) > start]
