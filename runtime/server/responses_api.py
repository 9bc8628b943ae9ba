"""OpenAI's Responses API: `POST /v1/responses` (whole, or streamed as typed events),
`GET` and `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items` and
`POST /v1/responses/{id}/cancel`. Errors are OpenAI's shape (the door's default).

A thin translation into the shared chat core (chat_runner.py): `instructions` and the input
items (messages, function calls and their outputs; reasoning items are dropped) become a chat
completions body (messages, tools, tool_choice, response_format, max_completion_tokens,
enable_thinking), which OpenAiRoutes.chat_job renders and checks, and ChatRunner runs; its
replies become output items (response_events.py). With `store` (the default) the response and
its conversation are kept (response_store.py), so `previous_response_id` continues it: the
earlier turns are prepended as they were, and their prompt is a radix-cache hit. As OpenAI's,
a previous response's `instructions` are not carried over. A response in flight is found by
id, so `cancel` aborts its request (the response ends "cancelled").
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from radixflow.runtime.server.chat_runner import ChatEvent, ChatJob, ChatReply, ChatRunner
from radixflow.runtime.server.http_request import (
    HttpError,
    check_fields,
    dumps,
    json_response,
    prepend,
    typed,
)
from radixflow.runtime.server.openai_api import OpenAiRoutes
from radixflow.runtime.server.response_events import ResponseState, new_id, status_of
from radixflow.runtime.server.response_request import (
    chat_messages,
    function_tools,
    input_items,
    metadata_of,
    reasoning_of,
    text_format,
    tool_choice,
)
from radixflow.runtime.server.response_store import ResponseStore

HONORED = {
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
    "reasoning", "max_output_tokens", "temperature", "top_p", "stream", "store",
    "previous_response_id", "metadata", "user", "truncation",
}  # fmt: skip
# fields real clients send that change nothing here at these values (http_request.is_noop)
NOOP = {
    "include": None,  # any list: the output has no encrypted reasoning or logprobs to add
    "background": False,
    "service_tier": None,
    "prompt_cache_key": None,  # any: the radix cache finds shared prefixes by itself
    "prompt_cache_retention": None,
    "safety_identifier": None,
    "stream_options": None,
    "max_tool_calls": None,  # any: it limits hosted tools, which are refused
    "top_logprobs": 0,
    "conversation": None,
    "prompt": None,
}
ANY = ("include", "service_tier", "prompt_cache_key", "prompt_cache_retention",
       "safety_identifier", "stream_options", "max_tool_calls")  # fmt: skip
CANCEL_WAIT_S = 10.0  # a cancel waits this long for its response to end (one step, usually)
# the chat body's field a chat_job error names -> the request's own
PARAM_OF = {"messages": "input", "response_format": "text.format",
            "max_completion_tokens": "max_output_tokens"}  # fmt: skip


@dataclass
class Turn:
    """A Responses request translated: the chat body, the response object's head (the echo of
    the request), and the items the model sees (earlier turns, then this input)."""

    chat: dict[str, Any]
    head: dict[str, Any]
    context: list[dict[str, Any]]
    stream: bool
    store: bool


@dataclass
class Running:
    """A response in flight: found by id for GET and cancel."""

    state: ResponseState
    job: ChatJob
    done: asyncio.Event = field(default_factory=asyncio.Event)


class ResponsesRoutes:
    def __init__(self, door: Any) -> None:
        self.door = door
        self.chat = OpenAiRoutes(door)
        self.runner = ChatRunner(door)
        self.store = ResponseStore()
        self.running: dict[str, Running] = {}

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/responses", self.create),
            web.get("/v1/responses/{response_id}", self.retrieve),
            web.delete("/v1/responses/{response_id}", self.delete),
            web.get("/v1/responses/{response_id}/input_items", self.input_items),
            web.post("/v1/responses/{response_id}/cancel", self.cancel),
        ]

    # ---- POST /v1/responses ------------------------------------------------------------

    async def create(self, request: web.Request) -> web.StreamResponse:
        turn = self.turn(await self.door.body(request))
        job = self.chat_job(turn.chat)
        state = ResponseState(turn.head)
        self.running[state.id] = running = Running(state, job)
        try:
            if turn.stream:
                return await self.stream(request, turn, running)
            (reply,) = await self.runner.complete(job)
            state.add(ChatEvent(0, reply.reasoning, reply.content, reply.calls, reply))
            self.finish(turn, state, status_of(reply), self.usage(reply))
            return json_response(state.response)
        finally:
            del self.running[state.id]
            running.done.set()

    async def stream(
        self, request: web.Request, turn: Turn, running: Running
    ) -> web.StreamResponse:
        """Typed SSE events (response_events.py). The first chat event is read before any
        byte: a request refused before its first token gets its status, not a stream."""
        state = running.state
        async with contextlib.aclosing(self.runner.stream(running.job)) as steps:
            first = await anext(steps)
            response = await self.door.sse(request)
            for event in state.start():
                await send(response, event)
            async for step in prepend(first, steps):
                if step.error is not None:
                    error = {"code": "server_error", "message": str(step.error)}
                    for event in self.finish(turn, state, "failed", None, error):
                        await send(response, event)
                    break
                for event in state.add(step):
                    await send(response, event)
                if step.final is not None:
                    usage = self.usage(step.final)
                    for event in self.finish(turn, state, status_of(step.final), usage):
                        await send(response, event)
        await response.write_eof()
        return response

    def finish(
        self,
        turn: Turn,
        state: ResponseState,
        status: str,
        usage: dict[str, Any] | None,
        error: dict[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        """The terminal event; the response is stored when asked (failed ones too)."""
        events = state.finish(status, usage, error)
        if turn.store:
            self.store.put(state.response, turn.context)
        return events

    def usage(self, reply: ChatReply) -> dict[str, Any]:
        meta = reply.meta
        prompt, cached = meta.get("prompt_tokens", 0), meta.get("cached_tokens", 0)
        output = meta.get("completion_tokens", 0)
        reasoning = len(self.chat.tokenize(reply.reasoning)) if reply.reasoning else 0
        written = 0 if self.door.server.config.disable_radix_cache else prompt - cached
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": min(reasoning, output)},
            "total_tokens": prompt + output,
        }

    def chat_job(self, chat: dict[str, Any]) -> ChatJob:
        """The chat core's job; its errors name this request's fields (`tools[0].name`, not
        `tools[0].function.name`)."""
        try:
            return self.chat.chat_job(chat)
        except HttpError as e:
            message = str(e).replace(".function.", ".")
            param = PARAM_OF.get(e.param, e.param)
            param = next((p for p in ("tool_choice", "tools") if message.startswith(p)), param)
            raise HttpError(e.status, message, param, e.code) from e

    # ---- the request -------------------------------------------------------------------

    def turn(self, body: Any) -> Turn:
        """A Responses body as a chat completions body and the response's head; HttpError
        (400, 404 for an unknown model or previous response) naming the field."""
        if not isinstance(body, dict):
            raise HttpError(400, "the body must be a JSON object")
        check_fields(body, HONORED, NOOP, ANY, "")
        model = typed(body, "model", str, None)
        self.chat.check_model(model)
        previous = typed(body, "previous_response_id", str, None)
        context = self.previous(previous) + input_items(body.get("input"))
        if not context:
            raise HttpError(400, "input must have at least one item", "input")
        instructions = typed(body, "instructions", str, None)
        tools, echo_tools = function_tools(body.get("tools"))
        choice, echo_choice = tool_choice(body.get("tool_choice"))
        text, response_format = text_format(body.get("text"))
        reasoning, kwargs = reasoning_of(body.get("reasoning"))
        if body.get("truncation") not in (None, "disabled"):
            raise HttpError(400, "truncation must be 'disabled' ('auto' is not supported)",
                            "truncation")  # fmt: skip
        chat = {
            "messages": chat_messages(context, instructions),
            "tools": tools,
            "tool_choice": choice,
            "parallel_tool_calls": typed(body, "parallel_tool_calls", bool, True),
            "response_format": response_format,
            "max_completion_tokens": self.max_output_tokens(body),
            "temperature": typed(body, "temperature", float, None),
            "top_p": typed(body, "top_p", float, None),
            "stream": typed(body, "stream", bool, False),
            "chat_template_kwargs": kwargs,
            "reasoning_effort": (reasoning or {}).get("effort"),  # its thinking budget
            "model": model,  # a LoRA adapter's name runs under it (OpenAiRoutes.adapter_of)
        }
        chat = {k: v for k, v in chat.items() if v is not None}
        echo = {
            "instructions": instructions,
            "previous_response_id": previous,
            "reasoning": reasoning,
            "text": text,
            "tool_choice": echo_choice,
            "tools": echo_tools,
        }
        head = self.head(body, chat, echo)
        return Turn(chat, head, context, chat["stream"], head["store"])

    def head(self, body: dict[str, Any], chat: dict[str, Any], echo: dict[str, Any]) -> dict:
        """The response object's head: its id and the echo of the request."""
        return {
            "id": new_id("resp"),
            "object": "response",
            "created_at": int(time.time()),
            "model": self.chat.model_name(),
            "background": False,
            "error": None,
            "incomplete_details": None,
            **echo,
            "max_output_tokens": chat.get("max_completion_tokens"),
            "metadata": metadata_of(body.get("metadata")),
            "parallel_tool_calls": chat["parallel_tool_calls"],
            "store": typed(body, "store", bool, True),
            "temperature": chat.get("temperature", 1.0),  # the sampler's defaults, as OpenAI's
            "top_p": chat.get("top_p", 1.0),
            "truncation": "disabled",
            "user": typed(body, "user", str, None),
        }

    def max_output_tokens(self, body: dict[str, Any]) -> int | None:
        value = typed(body, "max_output_tokens", int, None)
        limit = self.door.server.config.max_new_tokens_limit
        if value is not None and not 1 <= value <= limit:
            raise HttpError(400, f"max_output_tokens must be in [1, {limit}], got {value}",
                            "max_output_tokens")  # fmt: skip
        return value

    def previous(self, response_id: str | None) -> list[dict[str, Any]]:
        """The conversation a previous response continues: its context and its output."""
        if response_id is None:
            return []
        stored = self.store.get(response_id)
        if stored is None:
            raise HttpError(
                404,
                f"Previous response with id '{response_id}' not found.",
                "previous_response_id",
                "previous_response_not_found",
            )
        return stored.conversation

    # ---- stored and running responses --------------------------------------------------

    def found(self, request: web.Request) -> dict[str, Any]:
        """The response of the path's id: running (as it stands) or stored; else 404."""
        response_id = request.match_info["response_id"]
        running = self.running.get(response_id)
        if running is not None:
            return running.state.response
        stored = self.store.get(response_id)
        if stored is None:
            raise HttpError(404, f"Response with id '{response_id}' not found.", "response_id")
        return stored.response

    async def retrieve(self, request: web.Request) -> web.Response:
        return json_response(self.found(request))

    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        if not self.store.delete(response_id):
            raise HttpError(404, f"Response with id '{response_id}' not found.", "response_id")
        return json_response({"id": response_id, "object": "response.deleted", "deleted": True})

    async def cancel(self, request: web.Request) -> web.Response:
        """Aborts a running response's request and answers the response once it has ended
        ("cancelled"); a finished one is answered as it is (cancel is idempotent, as
        OpenAI's)."""
        running = self.running.get(request.match_info["response_id"])
        if running is None:
            return json_response(self.found(request))
        for msg in running.job.msgs:
            self.door.server.abort_rid(msg.rid, "cancelled by the client")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(running.done.wait(), CANCEL_WAIT_S)
        return json_response(running.state.response)

    async def input_items(self, request: web.Request) -> web.Response:
        """The items the response's model saw (earlier turns included), newest first unless
        `order=asc`; `limit` (1-100, 20) and `after` (an item id) page them."""
        response_id = request.match_info["response_id"]
        stored = self.store.get(response_id)
        if stored is None:
            raise HttpError(404, f"Response with id '{response_id}' not found.", "response_id")
        query = request.query
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise HttpError(400, "order must be 'asc' or 'desc'", "order")
        limit = query.get("limit", "20")
        if not limit.isdigit() or not 1 <= int(limit) <= 100:
            raise HttpError(400, "limit must be an integer in [1, 100]", "limit")
        items = stored.context if order == "asc" else stored.context[::-1]
        after = query.get("after")
        if after is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                raise HttpError(400, f"after: no input item {after!r}", "after")
            items = items[ids.index(after) + 1 :]
        page = items[: int(limit)]
        return json_response({
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > len(page),
        })  # fmt: skip


async def send(response: web.StreamResponse, event: dict[str, Any]) -> None:
    await response.write(f"event: {event['type']}\ndata: {dumps(event)}\n\n".encode())
