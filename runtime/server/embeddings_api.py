"""Embeddings and the tokenizer over HTTP: OpenAI's `POST /v1/embeddings`, Ollama's
`POST /api/embed` and its older `POST /api/embeddings`, and `POST /tokenize` /
`POST /detokenize` in SGLang's and vLLM's shapes.

A decoder model embeds from its own hidden states: every input becomes one `embed` message's
prefill-only request (runtime/protocol/messages.py), batched in the scheduler with whatever
else runs; its vector is the final hidden state after the model's final norm at the last
token, L2-normalized. Inputs are tokenized as /generate tokenizes text (no special tokens
added). An encoder (BERT, XLM-RoBERTa; served with --is-embedding) gets its special tokens
([CLS] ... [SEP]) and pools as its sentence-transformers config says (models/bert.py).
Neither kind is known to be trained for truncated (Matryoshka) vectors, so `dimensions` is
refused. Errors on the two Ollama paths come in Ollama's shape `{"error": "..."}`.
"""

from __future__ import annotations

import base64
import time
from typing import Any

import numpy as np
from aiohttp import web

from radixflow.runtime.protocol.messages import Embed
from radixflow.runtime.server.chat import clean_messages, render
from radixflow.runtime.server.http_request import (
    HttpError,
    check_fields,
    is_int_list,
    json_response,
    new_rid,
    typed,
)
from radixflow.runtime.server.openai_api import OpenAiRoutes
from radixflow.runtime.server.validation import MAX_CHARS_PER_TOKEN

OPENAI_FIELDS = {"input", "model", "encoding_format", "dimensions", "user"}
OLLAMA_EMBED_FIELDS = {"model", "input", "truncate", "keep_alive", "options", "dimensions"}
OLLAMA_LEGACY_FIELDS = {"model", "prompt", "keep_alive", "options"}
TOKENIZE_FIELDS = {
    "model", "prompt", "text", "add_special_tokens", "messages", "add_generation_prompt",
    "chat_template_kwargs",
}  # fmt: skip
NO_DIMENSIONS = (
    "dimensions is not supported: the served model is not known to be trained for truncated "
    "(Matryoshka) embeddings, so a cut vector would not be a meaningful embedding"
)
OLLAMA_PREFIX = "/api/embed"  # covers /api/embed and /api/embeddings


def ollama_error(error: HttpError) -> web.Response:
    """Ollama's error shape: {"error": message}, with the error's status."""
    return json_response({"error": str(error)}, error.status)


class EmbeddingsRoutes:
    def __init__(self, door: Any) -> None:
        self.door = door
        self.server = door.server
        self.openai = OpenAiRoutes(door)  # the served model's name and the model check
        door.error_shapes.append((OLLAMA_PREFIX, ollama_error))

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/embeddings", self.openai_embeddings),
            web.post("/api/embed", self.ollama_embed),
            web.post("/api/embeddings", self.ollama_embeddings),
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
        ]

    # ---- the model's vectors -----------------------------------------------------------

    async def embed(self, id_lists: list[list[int]]) -> dict[str, Any]:
        """{"embeddings", "prompt_tokens", "cached_tokens"} of one embed message; a refused
        input (too long for the context, ids outside the vocabulary) raises HttpError 400."""
        data = await self.door.ask(Embed(new_rid(), input_ids=id_lists))
        if data.get("aborted"):
            raise HttpError(400, "the request was aborted")
        return data

    def context_length(self) -> int:
        return int(self.server.model_info["context_length"])

    def encode(self, text: str, special: bool = False, where: str = "input") -> list[int]:
        """Token ids of `text`; text that cannot fit the context is refused untokenized."""
        if len(text) > MAX_CHARS_PER_TOKEN * self.context_length():
            raise HttpError(400, f"text of {len(text)} chars is too long", where)
        return list(self.server.tokenizer.encode(text, add_special_tokens=special))

    def embed_ids(self, text: str) -> list[int]:
        """An input's ids: an encoder's with its special tokens ([CLS] ... [SEP]), as
        sentence-transformers tokenizes; a decoder's without, as /generate tokenizes."""
        return self.encode(text, special=bool(self.server.model_info.get("is_encoder")))

    # ---- OpenAI ------------------------------------------------------------------------

    async def openai_embeddings(self, request: web.Request) -> web.Response:
        body = await self.door.body(request)
        if not isinstance(body, dict):
            raise HttpError(400, "the body must be a JSON object")
        check_fields(body, OPENAI_FIELDS, {}, (), "")
        self.openai.check_model(typed(body, "model", str, None), adapters=False)
        typed(body, "user", str, None)
        fmt = typed(body, "encoding_format", str, "float")
        if fmt not in ("float", "base64"):
            raise HttpError(400, "encoding_format must be float or base64", "encoding_format")
        if body.get("dimensions") is not None:
            raise HttpError(400, NO_DIMENSIONS, "dimensions")
        id_lists = self.openai_inputs(body.get("input"))
        data = await self.embed(id_lists)
        items = [
            {"object": "embedding", "index": i, "embedding": encoded(vector, fmt)}
            for i, vector in enumerate(data["embeddings"])
        ]
        tokens = sum(data["prompt_tokens"])
        return json_response(
            {
                "object": "list",
                "data": items,
                "model": self.openai.model_name(),
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    def openai_inputs(self, value: Any) -> list[list[int]]:
        """OpenAI's `input`: a string, a list of strings, a list of token ids or a list of
        such lists, as token id lists."""
        if isinstance(value, str):
            return [self.embed_ids(value)]
        if isinstance(value, list) and value:
            if all(isinstance(v, str) for v in value):
                return [self.embed_ids(v) for v in value]
            if is_int_list(value):
                return [value]
            if all(is_int_list(v) for v in value):
                return value
        raise HttpError(
            400,
            "input must be a non-empty string, list of strings, list of token ids or list of "
            "token id lists",
            "input",
        )

    # ---- Ollama ------------------------------------------------------------------------

    def check_ollama_model(self, body: dict[str, Any]) -> str:
        name = typed(body, "model", str, None)
        if not name:
            raise HttpError(400, "model is required")
        served = self.openai.model_name()
        known = {served, f"{served}:latest", self.server.model_info.get("model_path"), "default"}
        if name not in known:
            raise HttpError(404, f"model '{name}' not found")
        return name

    def ollama_body(self, body: Any, fields: set[str]) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise HttpError(400, "the body must be a JSON object")
        check_fields(body, fields, {}, (), "")
        typed(body, "options", dict, None)
        if body.get("dimensions") is not None:
            raise HttpError(400, NO_DIMENSIONS)
        return body

    def ollama_ids(self, text: str, truncate: bool) -> list[int]:
        """`text`'s ids, cut to the context (truncate) or refused when too long."""
        limit = self.context_length() - 1  # a prompt must leave the context one slot
        if truncate:
            text = text[: MAX_CHARS_PER_TOKEN * self.context_length()]
        ids = self.embed_ids(text)
        if len(ids) > limit and not truncate:
            raise HttpError(
                400, f"the input has {len(ids)} tokens; the context length is {limit + 1}"
            )
        return ids[:limit]

    async def ollama_embed(self, request: web.Request) -> web.Response:
        """{model, input: string | [string], truncate} -> {model, embeddings, ...}. As in
        Ollama, no input (an empty string or list) answers no embeddings: a load request."""
        start = time.perf_counter_ns()
        body = self.ollama_body(await self.door.body(request), OLLAMA_EMBED_FIELDS)
        name = self.check_ollama_model(body)
        truncate = typed(body, "truncate", bool, True)
        value = body.get("input")
        texts = [value] if isinstance(value, str) else value
        if value is not None and not (
            isinstance(texts, list) and all(isinstance(t, str) for t in texts)
        ):
            raise HttpError(400, "invalid input type: a string or a list of strings")
        texts = [t for t in texts or [] if t]
        data: dict[str, Any] = {"embeddings": [], "prompt_tokens": []}
        if texts:
            data = await self.embed([self.ollama_ids(t, truncate) for t in texts])
        return json_response(
            {
                "model": name,
                "embeddings": data["embeddings"],
                "total_duration": time.perf_counter_ns() - start,
                "load_duration": 0,
                "prompt_eval_count": sum(data["prompt_tokens"]),
            }
        )

    async def ollama_embeddings(self, request: web.Request) -> web.Response:
        """The older {model, prompt} -> {embedding}; an empty prompt answers an empty one."""
        body = self.ollama_body(await self.door.body(request), OLLAMA_LEGACY_FIELDS)
        self.check_ollama_model(body)
        prompt = typed(body, "prompt", str, "")
        if not prompt:
            return json_response({"embedding": []})
        data = await self.embed([self.ollama_ids(prompt, True)])
        return json_response({"embedding": data["embeddings"][0]})

    # ---- tokenizer ---------------------------------------------------------------------

    async def tokenize(self, request: web.Request) -> web.Response:
        """SGLang's {prompt | text: string or list, add_special_tokens} or vLLM's
        {messages, add_generation_prompt} -> {tokens, count, max_model_len}."""
        body = await self.door.body(request)
        if not isinstance(body, dict):
            raise HttpError(400, "the body must be a JSON object")
        check_fields(body, TOKENIZE_FIELDS, {}, (), "")
        self.openai.check_model(typed(body, "model", str, None), adapters=False)
        context = self.context_length()
        if body.get("messages") is not None:
            ids = self.chat_ids(body)
            return json_response({"tokens": ids, "count": len(ids), "max_model_len": context})
        key = "prompt" if "prompt" in body else "text"
        prompt = body.get(key)
        special = typed(body, "add_special_tokens", bool, True)
        if isinstance(prompt, str):
            ids = self.encode(prompt, special, key)
            return json_response({"tokens": ids, "count": len(ids), "max_model_len": context})
        if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            lists = [self.encode(p, special, key) for p in prompt]
            counts = [len(ids) for ids in lists]
            return json_response({"tokens": lists, "count": counts, "max_model_len": context})
        raise HttpError(400, "give prompt (or text): a string or a list of strings", key)

    def chat_ids(self, body: dict[str, Any]) -> list[int]:
        """vLLM's chat form: the messages through the model's chat template."""
        add = typed(body, "add_generation_prompt", bool, True)
        kwargs = typed(body, "chat_template_kwargs", dict, {})
        try:
            prompt = render(self.server.tokenizer, clean_messages(body["messages"], False), None,
                            kwargs, add_generation_prompt=add)  # fmt: skip
        except ValueError as e:  # ToolError among them: the message says what is wrong
            raise HttpError(400, str(e), "messages") from e
        return self.encode(prompt, False, "messages")

    async def detokenize(self, request: web.Request) -> web.Response:
        """{tokens: [id, ...]} -> {prompt} (vLLM's name) and {text} (SGLang's)."""
        body = await self.door.body(request)
        if not isinstance(body, dict):
            raise HttpError(400, "the body must be a JSON object")
        check_fields(body, {"model", "tokens"}, {}, (), "")
        self.openai.check_model(typed(body, "model", str, None), adapters=False)
        tokens = body.get("tokens")
        vocab = int(self.server.model_info["vocab_size"])
        if not is_int_list(tokens) or not all(0 <= t < vocab for t in tokens):
            raise HttpError(400, f"tokens must be a list of token ids in [0, {vocab})", "tokens")
        text = self.server.tokenizer.decode(tokens)
        return json_response({"prompt": text, "text": text})


def encoded(vector: list[float], fmt: str) -> list[float] | str:
    """A vector as floats, or OpenAI's base64: the little-endian float32 bytes."""
    if fmt == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
