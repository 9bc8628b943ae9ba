"""llama.cpp's code-infill route, `POST /infill`, with its fields and response shape: what
editor plugins made for llama.cpp (llama.vscode, llama.vim, Twinny) send as the user types.

A thin translation: `input_prefix`, `input_suffix`, `input_extra` (other files' chunks) and
`prompt` (continues the prefix) become the model's fill-in-the-middle prompt (fim.py), which
is submitted as /v1/completions submits a prompt (OpenAiRoutes.choices_of) and read by the
shared ChatRunner. llama.cpp's sampling fields map onto OpenAI's names; a field that would
change the output in a way radixflow does not implement is refused unless it is at its off
value (NOOP); llama.cpp's unknown fields are ignored with a warning, as it ignores them. The
answer is llama.cpp's /completion object (content, stop, stop_type, tokens_predicted,
tokens_evaluated, tokens_cached, timings, ...), or with `stream` its server-sent events: one
per delta (`stop` false), then the whole object (`stop` true, content empty). Errors are in
llama.cpp's shape `{"error": {"code", "message", "type"}}`.
"""

from __future__ import annotations

import contextlib
from typing import Any

from aiohttp import web

from radixflow.runtime.server.chat import ChatPlan
from radixflow.runtime.server.chat_runner import ChatJob, ChatReply, ChatRunner
from radixflow.runtime.server.fim import extra_chunks, fim_prompt
from radixflow.runtime.server.http_request import HttpError, check_fields, json_response, typed

# llama.cpp field -> (OpenAI's name, type); n_predict -1 is "until the context ends"
SAMPLING: dict[str, tuple[str, Any]] = {
    "temperature": ("temperature", float), "top_k": ("top_k", int), "top_p": ("top_p", float),
    "min_p": ("min_p", float), "seed": ("seed", int), "stop": ("stop", (list, str)),
    "repeat_penalty": ("repetition_penalty", float),
    "presence_penalty": ("presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", float), "ignore_eos": ("ignore_eos", bool),
}  # fmt: skip
FIELDS = {"input_prefix", "input_suffix", "input_extra", "prompt", "n_predict", "max_tokens",
          "stream", *SAMPLING}  # fmt: skip
# fields that change the output, not implemented here: accepted only at their off value
NOOP = {
    "n_indent": 0, "t_max_predict_ms": 0, "n_probs": 0, "typical_p": 1.0, "mirostat": 0,
    "dynatemp_range": 0.0, "xtc_probability": 0.0, "dry_multiplier": 0.0, "grammar": "",
    "json_schema": None, "logit_bias": None, "lora": None,
}  # fmt: skip
# fields that tune how llama.cpp runs, with no effect on the output (one model is served,
# as llama.cpp's is, but `model` naming a loaded LoRA adapter runs under it; the radix cache
# is always on; no slots; penalties cover the whole reply)
ANY = ("model", "cache_prompt", "id_slot", "samplers", "repeat_last_n", "return_tokens", "n_keep",
       "timings_per_token", "response_fields", "min_keep", "post_sampling_probs")  # fmt: skip
RAW = ChatPlan("", {}, None, None, False)  # a prompt taken as is: no template, tools, thinking


def infill_error(e: HttpError) -> web.Response:
    """An HttpError in llama.cpp's shape: {"error": {"code", "message", "type"}}."""
    kind = "invalid_request_error" if e.status < 500 else "server_error"
    return json_response({"error": {"code": e.status, "message": str(e), "type": kind}}, e.status)


class InfillRoutes:
    """`POST /infill` on one HTTP door, over the door's OpenAI routes (choices_of)."""

    def __init__(self, door: Any, openai: Any) -> None:
        self.door = door
        self.server = door.server
        self.openai = openai
        self.runner = ChatRunner(door)
        door.error_shapes.append(("/infill", infill_error))

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/infill", self.infill)]

    async def infill(self, request: web.Request) -> web.StreamResponse:
        body = await self.door.body(request)
        if not isinstance(body, dict):
            raise HttpError(400, "the body must be a JSON object")
        check_fields(body, FIELDS, {**NOOP, **dict.fromkeys(ANY)}, ANY, "")
        texts = {k: typed(body, k, str, "") for k in ("input_prefix", "input_suffix", "prompt")}
        extra = extra_chunks(body.get("input_extra"))
        ids, stops = fim_prompt(
            self.server, "input_suffix", texts["input_prefix"], texts["input_suffix"], extra,
            texts["prompt"],
        )  # fmt: skip
        fields = self.sampling(body)
        fields["stop_token_ids"] = stops
        if body.get("model") in self.openai.adapters():  # a LoRA adapter's name picks it
            fields["model"] = body["model"]
        job = ChatJob(RAW, self.openai.choices_of([ids], fields, "max_tokens", -1), fields)
        if fields["stream"]:
            return await self.stream(request, job)
        (reply,) = await self.runner.complete(job)
        return json_response(self.answer(job, reply, reply.content))

    def sampling(self, body: dict[str, Any]) -> dict[str, Any]:
        """llama.cpp's fields as an OpenAI completions body's."""
        fields: dict[str, Any] = {"stream": typed(body, "stream", bool, False)}
        for name, (ours, kind) in SAMPLING.items():
            value = typed(body, name, kind)
            if value is not None:
                fields[ours] = value
        if isinstance(fields.get("stop"), str):
            fields["stop"] = [fields["stop"]]
        if fields.get("seed", 0) < 0:  # llama.cpp's -1: a random seed
            del fields["seed"]
        if fields.get("top_k", 1) <= 0:  # llama.cpp's 0: no top-k
            del fields["top_k"]
        predict = typed(body, "n_predict", int, typed(body, "max_tokens", int, -1))
        if predict < -1:
            raise HttpError(400, "n_predict must be -1 (no limit) or at least 0", "n_predict")
        if predict >= 0:
            fields["max_tokens"] = predict
        return fields

    def answer(self, job: ChatJob, reply: ChatReply, content: str) -> dict[str, Any]:
        """llama.cpp's finished /completion object."""
        meta, msg = reply.meta, job.msgs[0]
        prompt_n, cached = meta.get("prompt_tokens", 0), meta.get("cached_tokens", 0)
        predicted = meta.get("completion_tokens", 0)
        matched = reply.matched if isinstance(reply.matched, str) else ""
        kinds = {"length": "limit", "stop": "word" if matched else "eos"}
        return {
            "index": 0,
            "content": content,
            "tokens": [],
            "id_slot": 0,
            "stop": True,
            "model": self.openai.model_name(),
            "tokens_predicted": predicted,
            "tokens_evaluated": prompt_n,
            "generation_settings": {
                "n_ctx": self.server.model_info["context_length"],
                "n_predict": msg.sampling_params.get("max_new_tokens"),
                "stop": list(job.body.get("stop") or []),
                "stream": msg.stream,
            },
            "prompt": self.server.tokenizer.decode(msg.input_ids, skip_special_tokens=False),
            "has_new_line": "\n" in content,
            "truncated": False,
            "stop_type": kinds.get(reply.stop, "none"),
            "stopping_word": matched,
            "tokens_cached": cached,
            "timings": timings(meta, prompt_n - cached, predicted),
        }

    async def stream(self, request: web.Request, job: ChatJob) -> web.StreamResponse:
        """An event per delta, then the whole object; a failure after the first byte is a last
        `{"error": ...}` event."""
        async with contextlib.aclosing(self.runner.stream(job)) as events:
            first = await anext(events)  # a refused request raises its status here
            response = await self.door.sse(request)
            event: Any = first
            while event is not None:
                if event.error is not None:
                    error = {"code": event.error.status, "message": str(event.error)}
                    await self.door.event(response, {"error": {**error, "type": "server_error"}})
                    break
                if event.content:
                    delta = {"index": 0, "content": event.content, "tokens": [], "stop": False}
                    await self.door.event(response, {**delta, "id_slot": 0})
                if event.final is not None:
                    await self.door.event(response, self.answer(job, event.final, ""))
                event = await anext(events, None)
        await response.write_eof()
        return response


def timings(meta: dict[str, Any], prompt_n: int, predicted_n: int) -> dict[str, float]:
    """llama.cpp's timings: the prompt's time is the time to the first token."""
    e2e = meta.get("e2e_latency") or 0.0
    ttft = meta.get("ttft") or e2e
    prompt_ms, predicted_ms = ttft * 1e3, max(e2e - ttft, 0.0) * 1e3
    return {
        "cache_n": meta.get("cached_tokens", 0),
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / max(prompt_n, 1),
        "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_ms else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / max(predicted_n, 1),
        "predicted_per_second": 1e3 * predicted_n / predicted_ms if predicted_ms else 0.0,
    }
