"""OpenAI-compatible routes: `GET /v1/models`, `POST /v1/completions`,
`POST /v1/chat/completions`, with OpenAI's request fields and response/chunk shapes, plus the
fields SGLang adds (`regex`, `top_k`, `min_p`, ...) and the ones its router inserts.

Each choice is one scheduler request; the `n` choices of a prompt are submitted in one batch
so they are admitted together and prefill the prompt's KV once. Chat messages are rendered
with the model's own chat template (the tokenizer's), then tokenized here, so `usage` counts
exactly the tokenizer's tokens. `response_format` (json_object, json_schema, structural_tag),
`regex` and `ebnf` go through the constrained decoder.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any

from aiohttp import web

from radixflow.runtime.protocol.messages import Chunk, Error, Generate
from radixflow.runtime.server.chat import ChatPlan, ChatStream, plan_chat
from radixflow.runtime.server.chat_runner import ChatJob
from radixflow.runtime.server.fim import fim_prompt
from radixflow.runtime.server.http_request import (
    HttpError,
    check_fields,
    clean_sampling,
    error_body,
    foreign_fields,
    is_int_list,
    prepend,
    response_format,
    typed,
)
from radixflow.runtime.server.media_fetch import fetch_media
from radixflow.runtime.server.openai_shapes import echoed, finish, logprobs_of, usage_of

COMMON = {
    "model",
    "n",
    "stop",
    "max_tokens",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "user",
    "logprobs",
    "response_format",
    # SGLang's extras
    "top_k",
    "min_p",
    "min_tokens",
    "regex",
    "json_schema",
    "ebnf",
    "choices",
    "structural_tag",
    "repetition_penalty",
    "stop_token_ids",
    "stop_regex",
    "ignore_eos",
    "skip_special_tokens",
    "rid",
    "logit_bias",
    "priority",
    "lora_path",  # a loaded LoRA adapter's name (SGLang's); `model` may name one instead
}
CHAT = COMMON | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
    "parallel_tool_calls", "chat_template_kwargs", "separate_reasoning",
    "continue_final_message", "reasoning_effort", "thinking_budget",
}  # fmt: skip
COMPLETION = COMMON | {"prompt", "echo", "suffix", "best_of"}
# fields OpenAI clients or SGLang's router send that are no-ops at these values (None and
# empty lists and maps too: http_request.is_noop); other names are ignored with a warning
NOOP = {
    "no_stop_trim": False,
    "stream_reasoning": True,
    "return_hidden_states": False,
    "session_params": None,
    "custom_logit_processor": None,
    "custom_params": None,
    "extra_key": None,
    "cache_salt": None,
    "data_parallel_rank": None,
    "metadata": None,
    "store": False,
    "service_tier": None,
    "modalities": None,
    "audio": None,
    "prediction": None,
    "web_search_options": None,
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
    "return_routed_experts": False,
    "return_cached_tokens_details": None,
    "return_prompt_token_ids": False,
    "return_meta_info": False,
    "return_token_ids": False,
    "parallel_sample_num": None,
}
ANY = ("user", "metadata", "return_cached_tokens_details", "store")
MAX_TOP_LOGPROBS = 20  # OpenAI's own limit


class OpenAiRoutes:
    def __init__(self, door: Any) -> None:
        self.door = door
        self.server = door.server
        self.created = int(time.time())

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model:.+}", self.model),
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
        ]

    # ---- models ------------------------------------------------------------------------

    def model_name(self) -> str:
        return self.server.model_info.get("model", "default")

    def card(self) -> dict[str, Any]:
        name = self.model_name()
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "radixflow",
            "root": self.server.model_info.get("model_path", name),
            "max_model_len": self.server.model_info.get("context_length"),
            "sampling_defaults": self.server.model_info.get("sampling_defaults", {}),
        }

    def adapters(self) -> dict[str, str]:
        """The loaded LoRA adapters, {name: path}: each is a model of its own here."""
        return self.server.model_info.get("lora_adapters", {})

    def adapter_card(self, name: str) -> dict[str, Any]:
        """vLLM's card of an adapter: its path as root, the base model as parent."""
        base = self.card()
        return {**base, "id": name, "root": self.adapters()[name], "parent": base["id"]}

    async def models(self, request: web.Request) -> web.Response:
        cards = [self.card()] + [self.adapter_card(name) for name in self.adapters()]
        return web.json_response({"object": "list", "data": cards})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        self.check_model(name)
        return web.json_response(
            self.adapter_card(name) if name in self.adapters() else self.card()
        )

    def check_model(self, name: Any, adapters: bool = True) -> None:
        """404 for a model this server does not serve. A LoRA adapter's name is one on the
        generation routes (`adapters`), a 400 on the others (embeddings: the base model's)."""
        known = {self.model_name(), self.server.model_info.get("model_path"), "default"}
        if name in self.adapters() and not adapters:
            raise HttpError(400, f"'{name}' is a LoRA adapter: this route serves the base", "model")
        if name is not None and name not in known and name not in self.adapters():
            raise HttpError(404, f"The model '{name}' does not exist", "model", "model_not_found")

    def adapter_of(self, body: dict[str, Any]) -> str | None:
        """The LoRA adapter a body runs under: `model` naming one (vLLM's convention), else
        SGLang's `lora_path`; None for the base model. An unknown lora_path is refused later,
        with the other generate checks."""
        model = body.get("model")
        return model if model in self.adapters() else typed(body, "lora_path", str, None)

    # ---- requests ----------------------------------------------------------------------

    async def request_body(self, request: web.Request, honored: set[str]) -> dict[str, Any]:
        body = await self.door.body(request)
        if not isinstance(body, dict):
            raise HttpError(400, "the body must be a JSON object")
        body = foreign_fields(body)
        check_fields(body, honored, NOOP, ANY, "")
        if not isinstance(body.get("model", ""), (str, type(None))):
            raise HttpError(400, "model must be a string", "model")
        self.check_model(body.get("model"))
        return body

    def sampling(
        self, body: dict[str, Any], prompt_len: int, max_key: str, plan: ChatPlan | None
    ) -> dict[str, Any]:
        """OpenAI's fields as SGLang's sampling_params (SamplingParams checks the values);
        a chat `plan` adds what the request's tools require (a second constraint is a 400)
        and starts constraints after the reasoning."""
        context = self.server.model_info["context_length"]
        default = min(self.server.config.max_new_tokens_limit, max(context - prompt_len, 0))
        params: dict[str, Any] = {"max_new_tokens": default}
        names = {
            "temperature": "temperature",
            "top_p": "top_p",
            "seed": "seed",
            "stop": "stop",
            "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty",
            "top_k": "top_k",
            "min_p": "min_p",
            "min_tokens": "min_new_tokens",
            "repetition_penalty": "repetition_penalty",
            "stop_token_ids": "stop_token_ids",
            "stop_regex": "stop_regex",
            "logit_bias": "logit_bias",
            "ignore_eos": "ignore_eos",
            "skip_special_tokens": "skip_special_tokens",
            "regex": "regex",
            "json_schema": "json_schema",
            "ebnf": "ebnf",
            "choices": "choices",
            "structural_tag": "structural_tag",
            max_key: "max_new_tokens",
        }
        for name, ours in names.items():
            if body.get(name) is not None:
                params[ours] = body[name]
        if max_key == "max_completion_tokens" and body.get("max_tokens") is not None:
            params.setdefault("max_new_tokens", body["max_tokens"])
            if body.get("max_completion_tokens") is None:
                params["max_new_tokens"] = body["max_tokens"]
        nested = self.server.config.grammar_backend == "llguidance"
        formatted = response_format(body.get("response_format"), nested)
        clash = [k for k in formatted if params.get(k) is not None]
        if clash:
            raise HttpError(400, f"response_format and {clash[0]} both given", "response_format")
        params.update(formatted)
        if plan is not None:
            try:
                params = plan.sampling(params)
            except ValueError as e:  # ToolError, or a json_schema that is not JSON
                raise HttpError(400, str(e), "tool_choice") from e
        return clean_sampling(params, "")

    def choices_of(
        self,
        prompts: list[list[int]],
        body: dict[str, Any],
        max_key: str,
        top: int,
        plan: ChatPlan | None = None,
        echo: bool = False,
    ) -> list[Generate]:
        n = typed(body, "n", int, 1)
        if not 1 <= n <= 64:
            raise HttpError(400, f"n must be in [1, 64], got {n}", "n")
        stream = typed(body, "stream", bool, False)
        want_logprobs = top >= 0
        msgs = []
        for ids in prompts:
            base = self.sampling(body, len(ids), max_key, plan)
            for j in range(n):
                params = dict(base)
                if n > 1 and type(params.get("seed")) is int:
                    params["seed"] += j  # n equal seeds would give n equal choices
                msgs.append(
                    Generate(
                        uuid.uuid4().hex,
                        input_ids=ids,
                        sampling_params=params,
                        stream=stream,
                        return_logprob=want_logprobs,
                        logprob_start_len=0 if echo and want_logprobs else -1,
                        top_logprobs_num=max(top, 0),
                        priority=typed(body, "priority", int, 0),
                        lora_path=self.adapter_of(body),
                        image_data=list(plan.images) if plan is not None and plan.images else None,
                    )
                )
        return msgs

    def stream_usage(self, body: dict[str, Any]) -> bool:
        options = body.get("stream_options")
        if options is None:
            return False
        if not isinstance(options, dict) or set(options) - {
            "include_usage",
            "continuous_usage_stats",
        }:
            raise HttpError(400, "stream_options must be {include_usage: bool}", "stream_options")
        return bool(typed(options, "include_usage", bool, False))

    def tokenize(self, text: str) -> list[int]:
        try:
            return self.server.tokenize(text)
        except ValueError as e:
            raise HttpError(400, str(e), "prompt") from e

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        job = self.chat_job(await self.request_body(request, CHAT))
        return await self.respond(request, job.body, job.msgs, job.plan)

    def chat_job(self, body: dict[str, Any]) -> ChatJob:
        """A chat completions body (its fields already checked) ready to run: the prompt
        rendered and tokenized, one Generate per choice. Every chat-shaped door builds one
        (chat_runner.py); raises HttpError naming the field that is wrong."""
        try:
            vision = self.server.model_info.get("vision") is not None
            plan = plan_chat(body, self.server.tokenizer, self.server.config, vision)
        except ValueError as e:  # ToolError among them: the message names the field
            raise HttpError(400, str(e), "messages") from e
        logprobs = typed(body, "logprobs", bool, False)
        top = typed(body, "top_logprobs", int, None)
        if top is not None and not (logprobs and 0 <= top <= MAX_TOP_LOGPROBS):
            raise HttpError(
                400, f"top_logprobs needs logprobs=true and 0..{MAX_TOP_LOGPROBS}", "top_logprobs"
            )
        msgs = self.choices_of(
            [self.tokenize(plan.prompt)],
            body,
            "max_completion_tokens",
            (top or 0) if logprobs else -1,
            plan,
        )
        return ChatJob(plan, msgs, body)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self.request_body(request, COMPLETION)
        echo = typed(body, "echo", bool, False)
        if echo and typed(body, "stream", bool, False):
            raise HttpError(400, "echo is not supported with stream; send stream=false", "echo")
        prompt = body.get("prompt")
        texts: list[str] | None = None
        if isinstance(prompt, str):
            texts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            texts = list(prompt)
        suffix = typed(body, "suffix", str, "")
        if suffix and texts is None:
            raise HttpError(400, "suffix needs a text prompt (the code before it)", "suffix")
        if suffix:  # fill-in-the-middle: the model's FIM layout, stopped by its end tokens
            inserts = [fim_prompt(self.server, "suffix", t, suffix) for t in texts]
            prompts = [ids for ids, _ in inserts]
            body["stop_token_ids"] = [*(body.get("stop_token_ids") or ()), *inserts[0][1]]
        elif texts is not None:
            prompts = [self.tokenize(t) for t in texts]
        elif is_int_list(prompt) and prompt:
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(is_int_list(p) for p in prompt):
            prompts = list(prompt)
        else:
            raise HttpError(
                400,
                "prompt must be a string, a list of strings, a list of token "
                "ids or a list of such lists",
                "prompt",
            )
        if body.get("logprobs") is False:  # some clients send chat's boolean default here
            body["logprobs"] = None
        top = typed(body, "logprobs", int, None)
        if top is not None and not 0 <= top <= 5:
            raise HttpError(400, "logprobs must be in [0, 5]", "logprobs")
        if body.get("max_tokens") is None:
            body["max_tokens"] = 16  # OpenAI's default for completions (also for null)
        msgs = self.choices_of(prompts, body, "max_tokens", -1 if top is None else top, echo=echo)
        echoes = None
        if echo:  # each choice's text starts with its prompt, as given
            texts = texts or [self.server.tokenizer.decode(ids) for ids in prompts]
            echoes = [t for t in texts for _ in range(len(msgs) // len(prompts))]
        return await self.respond(request, body, msgs, None, echoes)

    # ---- answers -----------------------------------------------------------------------

    async def respond(
        self,
        request: web.Request,
        body: dict[str, Any],
        msgs: list[Generate],
        plan: ChatPlan | None,
        echoes: list[str] | None = None,
    ) -> web.StreamResponse:
        """A chat completion when `plan` is given (messages, tool calls, reasoning), else a
        text completion (`echoes`: each choice's prompt text, to start its text with)."""
        chat = plan is not None
        include_usage = self.stream_usage(body)  # checked even when not streaming
        sinks = self.door.submit(await fetch_media(msgs, self.server.config))
        head = {
            "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            "created": int(time.time()),
            "model": self.model_name(),
        }
        if msgs[0].stream:
            return await self.stream(request, include_usage, sinks, msgs, head, plan)
        finals = await self.door.finals(sinks)
        choices = []
        for i, data in enumerate(finals):
            meta = data["meta_info"]
            choice: dict[str, Any] = {"index": i}
            calls = False
            if plan is not None:
                choice["message"], calls = plan.message(data["text"])
            else:
                choice["text"] = (echoes[i] if echoes else "") + data["text"]
            if echoes and "input_token_logprobs" in meta:
                meta = echoed(meta)
            choice["logprobs"] = logprobs_of(meta, msgs[i], chat, self.door.token_texts)
            choice.update(finish(meta, calls))
            choices.append(choice)
        obj = "chat.completion" if chat else "text_completion"
        usage = usage_of([f["meta_info"] for f in finals], msgs)
        return web.json_response({**head, "object": obj, "choices": choices, "usage": usage})

    async def stream(
        self,
        request: web.Request,
        include_usage: bool,
        sinks: list[Any],
        msgs: list[Generate],
        head: dict[str, Any],
        plan: ChatPlan | None,
    ) -> web.StreamResponse:
        """OpenAI's chunks: per choice a role chunk (chat), content (and reasoning, tool call)
        deltas with their tokens' logprobs, a last chunk with finish_reason; a usage chunk
        when asked; `[DONE]`."""
        chat = plan is not None
        obj = "chat.completion.chunk" if chat else "text_completion"
        chats = [ChatStream(plan) for _ in sinks] if plan is not None else []
        shown = [""] * len(sinks)
        streamed = [0] * len(sinks)  # logprob entries sent so far, per choice
        metas: list[dict[str, Any] | None] = [None] * len(sinks)

        async def send(i: int, text: str, meta: dict[str, Any], final: dict | None) -> None:
            if chat:
                deltas = chats[i].deltas(text, final is not None)
                if not deltas and final is None and not msgs[i].return_logprob:
                    return  # held back (a tool call may be starting): nothing to say yet
                deltas = deltas or [{}]
            else:
                delta = text[len(shown[i]) :] if text.startswith(shown[i]) else ""
                shown[i] = text if text.startswith(shown[i]) else shown[i]
                deltas = [delta]
            for j, delta in enumerate(deltas):
                choice: dict[str, Any] = {"index": i}
                choice["delta" if chat else "text"] = delta
                first, last = j == 0, j == len(deltas) - 1
                choice["logprobs"] = (
                    logprobs_of(meta, msgs[i], chat, self.door.token_texts)
                    if meta and first
                    else None
                )
                choice["finish_reason"] = None
                if final is not None and last:
                    choice.update(finish(final, bool(chat and chats[i].calls)))
                chunk = {**head, "object": obj, "choices": [choice]}
                if include_usage:
                    chunk["usage"] = None
                await self.door.event(response, chunk)

        async with contextlib.aclosing(self.door.replies(sinks)) as replies:
            first_reply = await self.door.first_reply(replies)  # a refusal: its status
            response = await self.door.sse(request)
            for i in range(len(sinks) if chat else 0):
                first = {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                await self.door.event(response, {**head, "object": obj, "choices": [first]})
            async for i, reply in prepend(first_reply, replies):
                if isinstance(reply, Error):
                    status = 503 if reply.code in ("unavailable", "shutdown") else 400
                    await self.door.event(
                        response, error_body(status, reply.message, None, reply.code)
                    )
                    break
                if isinstance(reply, Chunk):
                    text, meta, final = reply.text, reply.meta_info, None
                else:
                    text, final = reply.data["text"], reply.data["meta_info"]
                    metas[i] = final
                    meta = {**final}
                    if "output_token_logprobs" in final:  # only the entries not yet streamed
                        meta["output_token_logprobs"] = final["output_token_logprobs"][
                            streamed[i] :
                        ]
                        top = final.get("output_top_logprobs")
                        meta["output_top_logprobs"] = top[streamed[i] :] if top else None
                streamed[i] += len(meta.get("output_token_logprobs") or ())
                await send(i, text, meta, final)
        if include_usage and all(metas):
            usage = usage_of(metas, msgs)
            await self.door.event(response, {**head, "object": obj, "choices": [], "usage": usage})
        await self.door.event(response, "[DONE]")
        await response.write_eof()
        return response
