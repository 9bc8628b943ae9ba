"""One OpenAI Responses response as it is built from the chat core's events (chat_runner.py):
its output items (reasoning, the assistant message, function calls) and the typed stream
events each step adds, numbered by `sequence_number` (torch-free, no I/O).

A stream reads:
  response.created, response.in_progress
  reasoning (with --reasoning-parser): output_item.added, content_part.added,
    reasoning_text.delta*, reasoning_text.done, content_part.done, output_item.done
  the message: output_item.added, content_part.added, output_text.delta*, output_text.done,
    content_part.done, output_item.done
  per call: output_item.added, function_call_arguments.delta, function_call_arguments.done,
    output_item.done
  response.completed, or response.incomplete (cut by max_output_tokens, or cancelled: status
  "cancelled"; OpenAI's SDK knows no event of its own for that), or response.failed.
A whole (unstreamed) response is built the same way, its events dropped.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from radixflow.runtime.server.chat_runner import ChatEvent, ChatReply
from radixflow.runtime.server.tool_calls import ToolCall

TERMINAL = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "cancelled": "response.incomplete",
    "failed": "response.failed",
}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def status_of(reply: ChatReply) -> str:
    """completed, incomplete (max_output_tokens) or cancelled (aborted by a cancel)."""
    return {"length": "incomplete", "abort": "cancelled"}.get(reply.stop, "completed")


class ResponseState:
    """A response object (`response`, the request's echo plus output and usage) and the stream
    events that build it. `add` takes the chat core's events in order; `finish` ends it."""

    def __init__(self, head: dict[str, Any]) -> None:
        self.response = {**head, "status": "in_progress", "output": [], "usage": None}
        self.seq = -1
        self.open: dict[str, Any] | None = None  # the reasoning or message item still growing
        self.text_so_far = ""  # the open item's text so far
        self.message_sent = False

    @property
    def id(self) -> str:
        return self.response["id"]

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq, **fields}

    def start(self) -> list[dict[str, Any]]:
        return [
            self.event("response.created", response=dict(self.response, output=[])),
            self.event("response.in_progress", response=dict(self.response, output=[])),
        ]

    def add(self, step: ChatEvent) -> list[dict[str, Any]]:
        """The events of one step: reasoning and text deltas, and at the reply's end its open
        item closed, then its function calls."""
        out: list[dict[str, Any]] = []
        if step.reasoning:
            out += self.grow("reasoning", step.reasoning)
        if step.content:
            out += self.grow("message", step.content)
        if step.final is not None:
            status = "completed" if status_of(step.final) == "completed" else "incomplete"
            if self.open is None and not self.message_sent and not step.final.calls:
                out += self.grow("message", "")  # an empty reply is an empty message
            out += self.close(status)
            for call in step.final.calls:
                out += self.call(call)
        return out

    def finish(
        self, status: str, usage: dict[str, Any] | None, error: dict[str, Any] | None = None
    ) -> list[dict[str, Any]]:
        """The terminal event with the whole response: status, usage, error (failed)."""
        out = self.close("incomplete") if self.open is not None else []
        self.response["status"] = status
        self.response["usage"] = usage
        self.response["error"] = error
        if status == "incomplete":
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        if status == "completed":
            self.response["completed_at"] = int(time.time())
        return [*out, self.event(TERMINAL[status], response=self.response)]

    # ---- items ---------------------------------------------------------------------------

    def grow(self, kind: str, delta: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.open is not None and self.open["type"] != kind:
            out += self.close("completed")
        if self.open is None:
            out += self.open_item(kind)
        self.text_so_far += delta
        if not delta:
            return out
        where = self.where()
        if kind == "reasoning":
            return [*out, self.event("response.reasoning_text.delta", **where, delta=delta)]
        delta_event = self.event("response.output_text.delta", **where, delta=delta, logprobs=[])
        return [*out, delta_event]

    def open_item(self, kind: str) -> list[dict[str, Any]]:
        if kind == "reasoning":
            item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": []}
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": "message", "id": new_id("msg"), "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": []}
            self.message_sent = True
        item["status"] = "in_progress"
        self.open, self.text_so_far = item, ""
        self.response["output"].append(item)
        index = len(self.response["output"]) - 1
        return [
            self.event("response.output_item.added", output_index=index, item=dict(item)),
            self.event("response.content_part.added", **self.where(), part=part),
        ]

    def close(self, status: str) -> list[dict[str, Any]]:
        """The open item's done events; it takes its text and `status`."""
        item, text = self.open, self.text_so_far
        if item is None:
            return []
        self.open = None
        where = self.where(item)
        if item["type"] == "reasoning":
            part: dict[str, Any] = {"type": "reasoning_text", "text": text}
            done = self.event("response.reasoning_text.done", **where, text=text)
        else:
            part = {"type": "output_text", "text": text, "annotations": []}
            done = self.event("response.output_text.done", **where, text=text, logprobs=[])
        item.update(content=[part], status=status)
        index = where["output_index"]
        return [
            done,
            self.event("response.content_part.done", **where, part=part),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def call(self, call: ToolCall) -> list[dict[str, Any]]:
        item = {"type": "function_call", "id": new_id("fc"), "call_id": call.id,
                "name": call.name, "arguments": "", "status": "in_progress"}  # fmt: skip
        self.response["output"].append(item)
        index = len(self.response["output"]) - 1
        where = {"item_id": item["id"], "output_index": index}
        added = self.event("response.output_item.added", output_index=index, item=dict(item))
        delta = self.event("response.function_call_arguments.delta", **where, delta=call.arguments)
        item.update(arguments=call.arguments, status="completed")
        done = self.event(
            "response.function_call_arguments.done", **where, name=call.name,
            arguments=call.arguments,
        )  # fmt: skip
        return [
            added,
            delta,
            done,
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def where(self, item: dict[str, Any] | None = None) -> dict[str, Any]:
        item = item if item is not None else self.open
        assert item is not None, "no open item"
        index = next(i for i, x in enumerate(self.response["output"]) if x is item)
        return {"item_id": item["id"], "output_index": index, "content_index": 0}
