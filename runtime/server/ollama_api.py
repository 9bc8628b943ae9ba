"""Ollama's API (`POST /api/chat`, `/api/generate`, `/api/show`, `GET /api/tags`, `/api/ps`,
`/api/version`, the `GET /` probe) with its fields, NDJSON streams and `{"error"}` errors.

A thin translation (DESIGN §11): a chat request becomes an OpenAI chat body that the shared
chat core runs (OpenAiRoutes.chat_job + ChatRunner: template, tools, grammars, reasoning);
`/api/generate` is a one-turn chat through the same core, or with `raw` (or a `suffix`: the
model's fill-in-the-middle layout, server/fim.py) a prompt taken as is and submitted as
/v1/completions submits it (OpenAiRoutes.choices_of), read by the same runner. `options` become
the sampling fields (OPTIONS); an option that would change the output in a way radixflow does
not implement is refused naming it, one that only tunes how Ollama loads a model is accepted.
Ollama has no tool_choice: with tools, the model decides (`auto`). Durations are in
nanoseconds: the prompt's is the time to the first token, the reply's the rest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from datetime import datetime, timezone
from typing import Any

from aiohttp import web

from radixflow.runtime.server.chat import ChatPlan
from radixflow.runtime.server.chat_runner import ChatJob, ChatReply, ChatRunner
from radixflow.runtime.server.fim import fim_prompt, find_fim
from radixflow.runtime.server.http_request import (
    HttpError,
    check_fields,
    dumps,
    is_int_list,
    json_response,
    prepend,
    typed,
)
from radixflow.runtime.server.ollama_messages import chat_messages, with_images
from radixflow.runtime.server.tool_calls import ToolCall

# Ollama 0.12's API is what this door speaks. Clients parse the version as semver and gate
# features on it (tools from 0.3, format schemas from 0.5, think from 0.9), so it is a bare
# version, not radixflow's own.
OLLAMA_VERSION = "0.12.0"
NDJSON = "application/x-ndjson"
FOREVER = "2318-01-01T00:00:00Z"  # expires_at of a model that stays loaded (keep_alive -1)
COMMON = {"model", "stream", "format", "options", "keep_alive", "think", "truncate", "shift"}
CHAT = COMMON | {"messages", "tools"}
GENERATE = COMMON | {"prompt", "suffix", "system", "template", "context", "raw", "images"}
LOADED = {"done": True, "done_reason": "load"}  # the answer to a "load the model" call
# newer fields refused unless off: logprobs (not on this door yet), image generation
NOOP = {"logprobs": False, "top_logprobs": 0, "width": None, "height": None, "steps": None}
# Ollama option -> (the chat body's sampling field, its type)
OPTIONS: dict[str, tuple[str, Any]] = {
    "temperature": ("temperature", float), "top_p": ("top_p", float), "top_k": ("top_k", int),
    "min_p": ("min_p", float), "seed": ("seed", int), "stop": ("stop", (list, str)),
    "repeat_penalty": ("repetition_penalty", float),
    "presence_penalty": ("presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", float),
}  # fmt: skip
# options that only tune how Ollama loads and runs a model (or act only through an option
# refused here, or only when the context shifts, which it never does here): no effect
NO_EFFECT = (
    "num_thread", "num_gpu", "main_gpu", "num_batch", "use_mmap", "use_mlock", "numa",
    "low_vram", "f16_kv", "logits_all", "vocab_only", "embedding_only", "num_keep",
    "mirostat_tau", "mirostat_eta",
)  # fmt: skip
# options that change the output, not implemented: accepted only at the value that is off
NEUTRAL = {"mirostat": 0, "tfs_z": 1.0, "typical_p": 1.0, "penalize_newline": True}


def option(options: dict[str, Any], name: str, kind: Any, default: Any = None) -> Any:
    """options[name] if it has type `kind`, else a 400 naming options.<name>."""
    return typed({f"options.{name}": options.get(name)}, f"options.{name}", kind, default)


def rfc3339(seconds: float | None = None) -> str:
    moment = datetime.fromtimestamp(time.time() if seconds is None else seconds, timezone.utc)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


def ollama_error(e: HttpError) -> web.Response:
    """An HttpError in Ollama's shape: {"error": message}."""
    return json_response({"error": str(e)}, e.status)


def human_count(count: int) -> str:
    """A parameter count as Ollama writes it: "134.52M", "8.0B"."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.1f}{unit}" if unit == "B" else f"{count / size:.2f}{unit}"
    return str(count)


def ollama_call(call: ToolCall, index: int) -> dict[str, Any]:
    """A tool call as Ollama writes it: arguments as an object."""
    arguments = json.loads(call.arguments)
    return {"id": call.id, "function": {"index": index, "name": call.name, "arguments": arguments}}


def timings(meta: dict[str, Any], started_ns: int) -> dict[str, int]:
    e2e = meta.get("e2e_latency") or 0.0
    ttft = meta.get("ttft") or e2e  # no token (num_predict 0): all of it was the prompt's
    return {
        "total_duration": time.monotonic_ns() - started_ns,
        "load_duration": 0,  # the model is loaded once, at start
        "prompt_eval_count": meta.get("prompt_tokens", 0),
        "prompt_eval_duration": int(ttft * 1e9),
        "eval_count": meta.get("completion_tokens", 0),
        "eval_duration": int(max(e2e - ttft, 0.0) * 1e9),
    }


class OllamaRoutes:
    """Ollama's routes on one HTTP door, over the door's OpenAI routes (their chat core)."""

    def __init__(self, door: Any, openai: Any) -> None:
        self.door = door
        self.server = door.server
        self.openai = openai  # OpenAiRoutes: chat_job, choices_of, tokenize
        self.runner = ChatRunner(door)
        self.started = time.time()
        door.error_shapes.append(("/api/", ollama_error))

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/api/chat", self.chat),
            web.post("/api/generate", self.generate),
            web.get("/api/tags", self.tags),
            web.post("/api/show", self.show),
            web.get("/api/ps", self.ps),
            web.get("/api/version", self.version),
            web.get("/", self.root),  # HEAD too; the app has no other root route
        ]

    # ---- the model -------------------------------------------------------------------------

    def listed_name(self) -> str:
        name = self.openai.model_name()
        return name if ":" in name else f"{name}:latest"

    def check_model(self, body: dict[str, Any], key: str = "model") -> str:
        name = body.get(key)
        if name is None or name == "":
            raise HttpError(400, "model is required", key)
        if not isinstance(name, str):
            raise HttpError(400, "model must be a string", key)
        known = {self.openai.model_name(), self.server.model_info.get("model_path"), "default"}
        if name not in known and name.removesuffix(":latest") not in known:
            raise HttpError(404, f"model '{name}' not found", key)
        return name

    def card(self) -> dict[str, Any]:
        """What the weights are (runtime/models/card.py), as the scheduler reported it."""
        return self.server.model_info.get("card") or {}

    def details(self) -> dict[str, Any]:
        card = self.card()
        family = card.get("family", "unknown")
        return {
            "parent_model": "",
            "format": card.get("format", "unknown"),
            "family": family,
            "families": [family],
            "parameter_size": human_count(card.get("parameter_count", 0)),
            "quantization_level": card.get("quantization", "unknown"),
        }

    def entry(self) -> dict[str, Any]:
        card = self.card()
        name = self.listed_name()
        return {
            "name": name,
            "model": name,
            "modified_at": rfc3339(card.get("modified", self.started)),
            "size": card.get("size_bytes", 0),
            "digest": card.get("digest", ""),
            "details": self.details(),
        }

    async def tags(self, request: web.Request) -> web.Response:
        return json_response({"models": [self.entry()]})

    async def ps(self, request: web.Request) -> web.Response:
        """The one model, loaded for as long as the server runs; its size is its weights'."""
        entry = self.entry()
        on_gpu = str(self.server.model_info.get("device", "cpu")).startswith("cuda")
        context = self.server.model_info.get("context_length")
        loaded = {"expires_at": FOREVER, "size_vram": entry["size"] if on_gpu else 0}
        return json_response({"models": [{**entry, **loaded, "context_length": context}]})

    async def show(self, request: web.Request) -> web.Response:
        body = await self.object_body(request)
        self.check_model(body, "model" if "model" in body else "name")  # older clients: name
        info, card = self.server.model_info, self.card()
        family, template = card.get("family", "unknown"), info.get("chat_template") or ""
        parameters = f'stop "{info["eos_token"]}"' if info.get("eos_token") else ""
        source = f'FROM {info.get("model_path")}\nTEMPLATE """{template}"""\n'
        stop = f"PARAMETER {parameters}\n" if parameters else ""
        modelfile = f"# the served model, described\n{source}{stop}"
        thinking = ["thinking"] if self.server.config.reasoning_parser else []
        tokenizer = self.server.tokenizer  # `suffix` works where the model has FIM tokens
        insert = ["insert"] if tokenizer is not None and find_fim(tokenizer, info) else []
        model_info = {
            "general.architecture": family,
            "general.parameter_count": card.get("parameter_count", 0),
            f"{family}.context_length": info.get("context_length"),
            f"{family}.vocab_size": info.get("vocab_size"),
        }
        shown = {
            "modelfile": modelfile,
            "parameters": parameters,
            "template": template,  # Jinja, the model's own (Ollama's are Go templates)
            "details": self.details(),
            "model_info": model_info,
            "capabilities": ["completion", "tools", *thinking, *insert],  # tools: every model
            "modified_at": rfc3339(card.get("modified", self.started)),
        }
        return json_response(shown)

    async def version(self, request: web.Request) -> web.Response:
        return json_response({"version": OLLAMA_VERSION})

    async def root(self, request: web.Request) -> web.Response:  # what clients probe
        return web.Response(text="Ollama is running")

    # ---- requests --------------------------------------------------------------------------

    async def object_body(self, request: web.Request) -> dict[str, Any]:
        body = await self.door.body(request)
        if not isinstance(body, dict):
            raise HttpError(400, "the body must be a JSON object")
        return body

    async def request_body(self, request: web.Request, known: set[str]) -> tuple[dict, str]:
        """(the body, its model). Taken and left at what this server does: keep_alive (any
        value: the model stays loaded), truncate (a prompt past the context is refused, never
        cut), shift (a reply stops at the end of the context)."""
        body = await self.object_body(request)
        check_fields(body, known, NOOP, (), "")
        typed(body, "truncate", bool)
        typed(body, "shift", bool)
        return body, self.check_model(body)

    def sampling_fields(self, body: dict[str, Any]) -> dict[str, Any]:
        """`options`, `format` and `think` as the chat body's fields (OpenAI's names)."""
        options = typed(body, "options", dict, {})
        check_fields(options, set(OPTIONS) | {"num_predict", "num_ctx", "repeat_last_n"},
                     {**NEUTRAL, **dict.fromkeys(NO_EFFECT)}, NO_EFFECT, "options.")  # fmt: skip
        fields: dict[str, Any] = {}
        for name, (ours, kind) in OPTIONS.items():
            value = option(options, name, kind)
            if value is not None:
                fields[ours] = value
        if fields.get("seed", 0) < 0:  # Ollama's -1: a random seed
            del fields["seed"]
        if fields.get("top_k", 1) <= 0:  # Ollama's 0: no top-k
            del fields["top_k"]
        penalized = {"repetition_penalty", "presence_penalty", "frequency_penalty"} & set(fields)
        if options.get("repeat_last_n") is not None and penalized:
            why = "the penalties here cover the whole reply, not the last n tokens"
            raise HttpError(400, f"options.repeat_last_n is not supported: {why}", "repeat_last_n")
        predict = option(options, "num_predict", int, -1)
        limit = self.server.config.max_new_tokens_limit
        if predict < -2 or predict > limit:
            raise HttpError(400, f"options.num_predict must be -1, -2 or 0..{limit}", "num_predict")
        if predict >= 0:
            fields["max_tokens"] = predict
        fields["response_format"] = response_format(body.get("format"))
        think = self.thinking(body)
        if think is not None:
            fields["chat_template_kwargs"] = {"enable_thinking": think}
        if isinstance(body.get("think"), str):  # a level: its thinking budget (chat.py)
            fields["reasoning_effort"] = body["think"]
        return fields

    def thinking(self, body: dict[str, Any]) -> bool | None:
        think = body.get("think")
        if think is None:
            return None
        if not isinstance(think, bool) and think not in ("low", "medium", "high"):
            raise HttpError(400, 'think must be true, false, "low", "medium" or "high"', "think")
        on = think is not False  # a level turns thinking on (and sets its budget)
        if on and not self.server.config.reasoning_parser:
            raise HttpError(400, f"model '{body.get('model')}' does not support thinking", "think")
        return on

    def fit(self, job: ChatJob, options: dict[str, Any]) -> ChatJob:
        """num_ctx: a prompt that does not fit it is refused; the reply stops at its end (a
        num_ctx past the served context is the served context)."""
        num_ctx = option(options, "num_ctx", int)
        if num_ctx is None:
            return job
        if num_ctx <= 0:
            raise HttpError(400, "options.num_ctx must be positive", "num_ctx")
        window = min(num_ctx, self.server.model_info["context_length"])
        msgs = []
        for msg in job.msgs:
            size = len(msg.input_ids or ())
            if size >= window:
                raise HttpError(
                    400, f"the prompt has {size} tokens; num_ctx is {num_ctx}", "num_ctx"
                )
            params = dict(msg.sampling_params)
            params["max_new_tokens"] = min(params.get("max_new_tokens", window), window - size)
            msgs.append(dataclasses.replace(msg, sampling_params=params))
        return ChatJob(job.plan, msgs, job.body)

    # ---- /api/chat -------------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic_ns()
        body, name = await self.request_body(request, CHAT)
        messages = typed(body, "messages", list, [])
        if not messages:  # Ollama's "load the model" call
            message = {"role": "assistant", "content": ""}
            return json_response({**self.head(name), "message": message, **LOADED})
        stream = typed(body, "stream", bool, True)
        if body.get("format") not in (None, "") and body.get("tools"):
            raise HttpError(400, "format cannot be combined with tools here", "format")
        chat = {
            "messages": chat_messages(messages),
            "tools": body.get("tools"),
            "stream": stream,
            **self.sampling_fields(body),
        }
        job = self.fit(self.openai.chat_job(chat), body.get("options") or {})
        respond = self.stream if stream else self.answer
        return await respond(request, job, name, started, True)

    # ---- /api/generate ---------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic_ns()
        body, name = await self.request_body(request, GENERATE)
        prompt = typed(body, "prompt", str, "")
        if not prompt:  # Ollama's "load the model" call
            return json_response({**self.head(name), "response": "", **LOADED})
        suffix = typed(body, "suffix", str, "")  # an insert: the model's FIM layout, as is
        raw = typed(body, "raw", bool, False) or bool(suffix)
        refuse_generate_fields(body, raw)
        context = body.get("context") or []
        if not is_int_list(context):
            raise HttpError(400, "context must be a list of token ids", "context")
        stream = typed(body, "stream", bool, True)
        fields = {"stream": stream, **self.sampling_fields(body)}
        if raw:
            fields.pop("chat_template_kwargs", None)  # think false; true is refused above
            insert = fim_prompt(self.server, "suffix", prompt, suffix) if suffix else None
            ids = context + (insert[0] if insert else self.openai.tokenize(prompt))
            fields["stop_token_ids"] = insert[1] if insert else None
            msgs = self.openai.choices_of([ids], fields, "max_tokens", -1)
            job = ChatJob(ChatPlan(prompt, {}, None, None, False), msgs, fields)
        else:
            system = typed(body, "system", str, "")
            turns = [{"role": "system", "content": system}] if system else []
            user: Any = prompt
            if body.get("images"):  # a vision model's: the chat core refuses them otherwise
                user = with_images(prompt, body["images"], "images")
            job = self.openai.chat_job(
                {"messages": [*turns, {"role": "user", "content": user}], **fields}
            )
            ids = [*context, *job.msgs[0].input_ids]
            job = ChatJob(job.plan, [dataclasses.replace(job.msgs[0], input_ids=ids)], job.body)
        job = self.fit(job, body.get("options") or {})
        respond = self.stream if stream else self.answer
        return await respond(request, job, name, started, False)

    # ---- answers ---------------------------------------------------------------------------

    def head(self, name: str) -> dict[str, Any]:
        return {"model": name, "created_at": rfc3339()}

    def finish(self, reply: ChatReply, job: ChatJob, started: int, chat: bool) -> dict:
        """The last object's fields: done, the reason, durations, counts; for generate the
        `context` to send back (the prompt's ids and the reply's, not its thinking: Ollama's)."""
        reason = "stop" if reply.stop == "tool_calls" else reply.stop  # Ollama's: stop, length
        out: dict[str, Any] = {"done": True, "done_reason": reason}
        if not chat:
            reply_ids = self.openai.tokenize(reply.content) if reply.content else []
            out["context"] = [*(job.msgs[0].input_ids or ()), *reply_ids]
        return {**out, **timings(reply.meta, started)}

    async def answer(
        self, request: web.Request, job: ChatJob, name: str, started: int, chat: bool
    ) -> web.StreamResponse:
        """One object with the whole reply."""
        (reply,) = await self.runner.complete(job)
        whole = part(reply.content, reply.reasoning, reply.calls, chat)
        return json_response({**self.head(name), **whole, **self.finish(reply, job, started, chat)})

    async def stream(
        self, request: web.Request, job: ChatJob, name: str, started: int, chat: bool
    ) -> web.StreamResponse:
        """NDJSON: an object per delta (done false), the last one (done true, the tool calls in
        its message); an error after the first byte is a last `{"error": ...}` line (Ollama's)."""
        async with contextlib.aclosing(self.runner.stream(job)) as events:
            first = await anext(events)  # a refused request raises its status here
            response = web.StreamResponse(headers={"Content-Type": NDJSON})
            await response.prepare(request)
            async for event in prepend(first, events):
                if event.error is not None:
                    await write_line(response, {"error": str(event.error)})
                    break
                if event.content or event.reasoning:
                    delta = part(event.content, event.reasoning, [], chat)
                    await write_line(response, {**self.head(name), **delta, "done": False})
                if event.final is not None:
                    last = part("", "", event.final.calls, chat)
                    last.update(self.finish(event.final, job, started, chat))
                    await write_line(response, {**self.head(name), **last})
        await response.write_eof()
        return response


def part(content: str, reasoning: str, calls: list[ToolCall], chat: bool) -> dict[str, Any]:
    """A reply's (or a delta's) message, for chat, or response, for generate."""
    if not chat:
        return {"response": content, **({"thinking": reasoning} if reasoning else {})}
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        message["thinking"] = reasoning
    if calls:
        message["tool_calls"] = [ollama_call(c, i) for i, c in enumerate(calls)]
    return {"message": message}


async def write_line(response: web.StreamResponse, value: dict[str, Any]) -> None:
    await response.write((dumps(value) + "\n").encode())


def response_format(value: Any) -> dict[str, Any] | None:
    """Ollama's `format` as OpenAI's response_format: "json" any JSON object, a JSON schema
    object that schema (both through the constrained decoder), "" or null none."""
    if value in (None, ""):
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}
    raise HttpError(400, 'format must be "json" or a JSON schema object', "format")


def refuse_generate_fields(body: dict[str, Any], raw: bool) -> None:
    """What /api/generate cannot honour here, refused rather than ignored."""
    if raw and (body.get("system") or body.get("think") not in (None, False)):
        raise HttpError(400, "system and think need the chat template: raw is true", "raw")
    if raw and body.get("images"):
        raise HttpError(400, "images need the chat template: raw is true", "images")
    if body.get("template"):
        why = "prompts go through the model's own chat template (or raw: true)"
        raise HttpError(400, f"template is not supported: {why}", "template")
