"""Ollama's chat messages as OpenAI's (the chat core's input): tool calls with ids, a tool
message matched to the call it answers (Ollama's carry a name, not an id)."""

from __future__ import annotations

from typing import Any

from radixflow.runtime.server.http_request import HttpError

ROLES = ("system", "user", "assistant", "tool")


def chat_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Ollama's messages as OpenAI's: a call's arguments may stay an object (the chat core
    takes both); calls get ids, and a tool message (`tool_name`, no id in Ollama's API)
    answers the first open call of that name, else the first open call."""
    out: list[dict[str, Any]] = []
    open_calls: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise HttpError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}", "role")
        content = message.get("content") or ""  # clients drop an empty content
        if not isinstance(content, str):
            raise HttpError(400, f"messages[{i}].content must be a string", "content")
        entry: dict[str, Any] = {"role": message["role"], "content": content}
        if message.get("images"):
            entry["content"] = with_images(content, message["images"], f"messages[{i}].images")
        if message["role"] == "assistant" and message.get("tool_calls"):
            entry["tool_calls"] = openai_calls(message["tool_calls"], i)
            open_calls = list(entry["tool_calls"])
        if message["role"] == "tool":
            entry["tool_call_id"], entry["name"] = answered(message, open_calls, i)
        out.append(entry)
    return out


def with_images(text: str, images: Any, where: str) -> list[dict[str, Any]]:
    """Ollama's base64 `images` and the text as OpenAI content parts: the images first (in
    their order), as data: URLs; a text-only model refuses them in the chat core."""
    if not isinstance(images, list) or not all(isinstance(b, str) and b for b in images):
        raise HttpError(400, f"{where} must be a list of base64 strings", "images")
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": f"data:image/*;base64,{b.strip()}"}}
        for b in images
    ]
    return [*parts, {"type": "text", "text": text}] if text else parts


def openai_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise HttpError(400, f"messages[{i}].tool_calls must be a list of objects", "tool_calls")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise HttpError(400, f"messages[{i}].tool_calls[{j}] needs function.name")
        arguments = function.get("arguments") or {}
        call_id = call.get("id") if isinstance(call.get("id"), str) else f"call_{i}_{j}"
        out.append({"id": call_id, "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})  # fmt: skip
    return out


def answered(message: dict[str, Any], open_calls: list[dict[str, Any]], i: int) -> tuple:
    """(tool_call_id, tool name) of a tool message; the call it answers is no longer open."""
    given = message.get("tool_call_id")
    name = message.get("tool_name", message.get("name"))
    if name is not None and not isinstance(name, str):
        raise HttpError(400, f"messages[{i}].tool_name must be a string", "tool_name")
    match = next((c for c in open_calls if c["id"] == given), None)
    match = match or next((c for c in open_calls if c["function"]["name"] == name), None)
    if match is None and name is None and open_calls:
        match = open_calls[0]
    if match is None:
        return (given if isinstance(given, str) else f"call_{i}"), name
    open_calls.remove(match)
    return match["id"], match["function"]["name"]
