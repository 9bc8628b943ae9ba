"""The one chat core every chat-shaped door shares (OpenAI chat completions, Anthropic
Messages, OpenAI Responses, Ollama): an OpenAI chat body in, replies out as plain data
(reasoning, content, tool calls, finish and usage), whole or as a stream of events. A door
translates its request into the chat body and these replies into its own shapes; the chat
template, tool grammars and parsers, reasoning split, constraints and sampling live here and
in chat.py only.

A stream's first event is read before the door writes any byte, so a request refused before
its first token (a grammar that does not compile, a prompt past the context) raises its
HttpError with its status; a later failure comes as an event with `error` set.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from radixflow.runtime.protocol.messages import Chunk, Error, Generate
from radixflow.runtime.server.chat import ChatPlan, ChatStream
from radixflow.runtime.server.http_request import STATUS_OF_CODE, HttpError, prepend
from radixflow.runtime.server.media_fetch import fetch_media
from radixflow.runtime.server.tool_calls import ToolCall


@dataclass(frozen=True)
class ChatJob:
    """A chat request ready to run: its plan (prompt, constraint, readers) and one Generate
    per choice."""

    plan: ChatPlan
    msgs: list[Generate]
    body: dict[str, Any]  # the chat completions body it was built from


@dataclass
class ChatReply:
    """One finished choice."""

    reasoning: str
    content: str
    calls: list[ToolCall]
    meta: dict[str, Any]  # the scheduler's meta_info: finish_reason, token counts

    @property
    def stop(self) -> str:
        """ "tool_calls", "length", "stop" (eos or a stop string) or "abort"."""
        return stop_kind(self.meta, bool(self.calls))

    @property
    def matched(self) -> Any:
        """The stop string (or token id) that ended the reply; None for eos and the rest."""
        return (self.meta.get("finish_reason") or {}).get("matched")


@dataclass
class ChatEvent:
    """What one step of a stream adds to choice `index`: new reasoning and content text, the
    tool calls (whole, once the reply has finished), and `final` (the finished choice) or
    `error` (the request failed mid-stream)."""

    index: int
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    final: ChatReply | None = None
    error: HttpError | None = None


def stop_kind(meta: dict[str, Any], calls: bool) -> str:
    if calls:
        return "tool_calls"
    return (meta.get("finish_reason") or {}).get("type") or "stop"


def usage_of(replies: list[ChatReply]) -> dict[str, int]:
    """Token counts of one prompt's choices: the prompt once, its cached part the least any
    choice found cached, the completions summed."""
    metas = [r.meta for r in replies]
    return {
        "prompt_tokens": metas[0].get("prompt_tokens", 0),
        "cached_tokens": min(m.get("cached_tokens", 0) for m in metas),
        "completion_tokens": sum(m.get("completion_tokens", 0) for m in metas),
    }


class ChatRunner:
    """Runs ChatJobs through one HTTP door's submit/replies plumbing (http_api.HttpDoor)."""

    def __init__(self, door: Any) -> None:
        self.door = door

    async def complete(self, job: ChatJob) -> list[ChatReply]:
        """Every choice, finished; an error reply raises as an HttpError."""
        msgs = await fetch_media(job.msgs, self.door.server.config)  # remote image URLs
        finals = await self.door.finals(self.door.submit(msgs))
        return [self.reply(job.plan, data["text"], data["meta_info"]) for data in finals]

    @staticmethod
    def reply(plan: ChatPlan, text: str, meta: dict[str, Any]) -> ChatReply:
        reasoning, content = plan.split(text)
        calls: list[ToolCall] = []
        if plan.tool_format is not None:
            content, calls = plan.tool_format.parse(content)
        return ChatReply(reasoning, content, calls, meta)

    async def stream(self, job: ChatJob) -> AsyncIterator[ChatEvent]:
        """Events as the replies arrive (see the module docstring). Closing the iterator early
        (the client went away) aborts what is still running."""
        sinks = self.door.submit(await fetch_media(job.msgs, self.door.server.config))
        readers = [ChatStream(job.plan) for _ in sinks]
        async with contextlib.aclosing(self.door.replies(sinks)) as replies:
            first = await self.door.first_reply(replies)  # a refusal raises its status here
            async for i, reply in prepend(first, replies):
                if isinstance(reply, Error):
                    status = STATUS_OF_CODE.get(reply.code, 500)
                    yield ChatEvent(i, error=HttpError(status, reply.message, code=reply.code))
                    return
                final = None if isinstance(reply, Chunk) else reply.data
                text = reply.text if final is None else final["text"]
                event = ChatEvent(i)
                for delta in readers[i].deltas(text, final is not None):
                    event.reasoning += delta.get("reasoning_content", "")
                    event.content += delta.get("content", "")
                if final is not None:
                    event.calls = list(readers[i].calls)
                    event.final = self.reply(job.plan, text, final["meta_info"])
                if event.reasoning or event.content or event.final is not None:
                    yield event
