"""Anthropic's Messages API: `POST /v1/messages` (a whole message, or Anthropic's server-sent
events) and `POST /v1/messages/count_tokens`, so the `anthropic` SDK and the tools built on it
work unchanged against `base_url=http://host:port`.

A request is translated into an OpenAI chat body (runtime/server/anthropic_request.py), which
the shared chat core builds and runs (OpenAiRoutes.chat_job, chat_runner.ChatRunner). Its reply
comes back as content blocks (thinking when asked for, text, tool_use), with `stop_reason` and
`usage` in Anthropic's terms: `input_tokens` is the prompt's part not found in the radix cache,
`cache_read_input_tokens` the part found there (their sum is the prompt, as Anthropic counts
it). Errors on every /v1/messages path are Anthropic's shape, `{"type": "error", "error":
{"type", "message"}}`, with the status's Anthropic type (503 while draining: overloaded_error).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from typing import Any

from aiohttp import web

from radixflow.runtime.server.anthropic_request import (
    COUNT_FIELDS,
    FIELDS,
    chat_body,
    check_body,
    shows_thinking,
)
from radixflow.runtime.server.chat_runner import ChatEvent, ChatJob, ChatReply, ChatRunner, usage_of
from radixflow.runtime.server.http_request import HttpError, dumps, json_response, prepend
from radixflow.runtime.server.openai_api import OpenAiRoutes
from radixflow.runtime.server.tool_calls import ToolCall

PREFIX = "/v1/messages"
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",  # draining or a full queue: Anthropic's "try again shortly"
    529: "overloaded_error",
}
ZERO_USAGE = {
    "input_tokens": 0,
    "output_tokens": 0,
    "cache_read_input_tokens": 0,
    "cache_creation_input_tokens": 0,
}


def anthropic_error(e: HttpError) -> web.Response:
    """An HttpError in Anthropic's shape (the door's `error_shapes` entry)."""
    return json_response(error_body(e), e.status)


def error_body(e: HttpError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": str(e)}}


class AnthropicRoutes:
    def __init__(self, door: Any) -> None:
        self.door = door
        self.chat = OpenAiRoutes(door)  # the chat core's builder (chat_job, check_model)
        self.runner = ChatRunner(door)
        door.error_shapes.append((PREFIX, anthropic_error))

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post(PREFIX, self.messages),
            web.post(f"{PREFIX}/count_tokens", self.count_tokens),
        ]

    async def job(self, request: web.Request, count: bool) -> tuple[dict[str, Any], ChatJob]:
        """The request's body and chat job (the chat core's: prompt rendered, tools and
        sampling checked). `count`: count_tokens, whose body has no max_tokens."""
        body = check_body(await self.door.body(request), COUNT_FIELDS if count else FIELDS)
        self.chat.check_model(body["model"])  # 404 for a model this server does not serve
        server = self.door.server
        most = min(server.model_info["context_length"], server.config.max_new_tokens_limit)
        limits = {"max_tokens": most, "stream": False} if count else {}
        return body, self.chat.chat_job(chat_body({**body, **limits}, most))

    async def messages(self, request: web.Request) -> web.StreamResponse:
        body, job = await self.job(request, count=False)
        head = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant"}
        head["model"] = body["model"]
        if job.msgs[0].stream:
            return await self.stream(request, job, head, body)
        (reply,) = await self.runner.complete(job)
        reason, sequence = stop_of(reply, body)
        message = {**head, "content": content_of(reply, shows_thinking(body))}
        message.update(stop_reason=reason, stop_sequence=sequence, usage=usage(reply))
        return json_response(message)

    async def count_tokens(self, request: web.Request) -> web.Response:
        """The prompt's tokens as /v1/messages renders it (system and tools included)."""
        _, job = await self.job(request, count=True)
        return json_response({"input_tokens": len(job.msgs[0].input_ids)})

    # ---- the stream ----------------------------------------------------------------------

    async def stream(
        self, request: web.Request, job: ChatJob, head: dict[str, Any], body: dict[str, Any]
    ) -> web.StreamResponse:
        """Anthropic's events: message_start, ping, per content block content_block_start,
        its deltas and content_block_stop (indices from 0), message_delta (stop_reason and
        the final usage), message_stop; a failure after the first byte is an `error` event."""
        async with contextlib.aclosing(self.runner.stream(job)) as events:
            first = await anext(events)  # a refused request raises its status here
            response = await self.door.sse(request)
            blocks = BlockWriter(response)
            prompt = len(job.msgs[0].input_ids)
            start = {**head, "content": [], "stop_reason": None, "stop_sequence": None}
            # the cache's share is known at the end: message_delta's usage overwrites this
            start["usage"] = {**ZERO_USAGE, "input_tokens": prompt}
            await blocks.send("message_start", {"message": start})
            await blocks.send("ping", {})
            async for event in prepend(first, events):
                try:
                    done = await self.send(blocks, event, body)
                except HttpError as e:
                    await blocks.send("error", {"error": error_body(e)["error"]})
                    break
                if done:
                    break
        await response.write_eof()
        return response

    async def send(self, blocks: BlockWriter, event: ChatEvent, body: dict[str, Any]) -> bool:
        """One event's blocks; True once the message is finished."""
        if event.error is not None:
            raise event.error
        if event.reasoning and shows_thinking(body):
            await blocks.delta("thinking", event.reasoning)
        if event.content:
            await blocks.delta("text", event.content)
        if event.final is None:
            return False
        reason, sequence = stop_of(event.final, body)
        for call in event.final.calls:
            await blocks.tool_use(call)
        if blocks.index < 0:  # an empty reply is still one (empty) text block, as whole
            await blocks.start({"type": "text", "text": ""})
        await blocks.stop()
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        await blocks.send("message_delta", {"delta": delta, "usage": usage(event.final)})
        await blocks.send("message_stop", {})
        return True


class BlockWriter:
    """The content-block events of one streamed message: a block opens on its first delta
    and closes when a block of another kind opens or the message ends."""

    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response
        self.index = -1  # the open block, or the last one
        self.open: str | None = None  # its type

    async def send(self, name: str, data: dict[str, Any]) -> None:
        line = f"event: {name}\ndata: {dumps({'type': name, **data})}\n\n"
        await self.response.write(line.encode())

    async def start(self, block: dict[str, Any]) -> None:
        await self.stop()
        self.index += 1
        self.open = block["type"]
        await self.send("content_block_start", {"index": self.index, "content_block": block})

    async def delta(self, kind: str, text: str) -> None:
        """kind: "text" or "thinking"."""
        if self.open != kind:
            empty = {"type": "thinking", "thinking": "", "signature": ""}
            await self.start(empty if kind == "thinking" else {"type": "text", "text": ""})
        await self.block_delta({"type": f"{kind}_delta", kind: text})

    async def block_delta(self, delta: dict[str, Any]) -> None:
        await self.send("content_block_delta", {"index": self.index, "delta": delta})

    async def tool_use(self, call: ToolCall) -> None:
        await self.start(
            {"type": "tool_use", "id": tool_use_id(call), "name": call.name, "input": {}}
        )
        await self.block_delta({"type": "input_json_delta", "partial_json": call.arguments})

    async def stop(self) -> None:
        if self.open is None:
            return
        if self.open == "thinking":  # Anthropic closes thinking with its signature
            await self.block_delta({"type": "signature_delta", "signature": ""})
        await self.send("content_block_stop", {"index": self.index})
        self.open = None


# ---- the reply, in Anthropic's terms ---------------------------------------------------------


def content_of(reply: ChatReply, thinking: bool) -> list[dict[str, Any]]:
    """thinking (when asked for), text, tool_use blocks; at least one block."""
    blocks: list[dict[str, Any]] = []
    if reply.reasoning and thinking:
        blocks.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.content:
        blocks.append({"type": "text", "text": reply.content})
    for call in reply.calls:
        arguments = json.loads(call.arguments)
        blocks.append({"type": "tool_use", "id": tool_use_id(call), "name": call.name,
                       "input": arguments})  # fmt: skip
    return blocks or [{"type": "text", "text": ""}]


def tool_use_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def stop_of(reply: ChatReply, body: dict[str, Any]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence); an aborted reply raises (Anthropic has no such end)."""
    kind = reply.stop
    if kind == "abort":
        reason = reply.meta.get("finish_reason") or {}
        raise HttpError(500, f"the request was aborted: {reason.get('message', 'aborted')}")
    if kind == "tool_calls":
        return "tool_use", None
    if kind == "length":
        full = reply.meta.get("completion_tokens", 0) >= body["max_tokens"]
        return ("max_tokens" if full else "model_context_window_exceeded"), None
    matched = reply.matched
    if isinstance(matched, str) and matched in (body.get("stop_sequences") or ()):
        return "stop_sequence", matched
    return "end_turn", None


def usage(reply: ChatReply) -> dict[str, int]:
    counts = usage_of([reply])
    cached = counts["cached_tokens"]
    return {
        "input_tokens": counts["prompt_tokens"] - cached,
        "output_tokens": counts["completion_tokens"],
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }
