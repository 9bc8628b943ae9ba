"""A Responses request's fields as the chat core's (torch-free, no I/O): `input` items
(messages, function calls and their outputs, reasoning) in Responses' own shape with ids, then
as chat completions messages; flat function tools, tool_choice, text.format, reasoning and
metadata. Each function raises HttpError (400) naming the field that is wrong; the routes that
use them are in responses_api.py.
"""

from __future__ import annotations

from typing import Any

from radixflow.runtime.server.http_request import HttpError
from radixflow.runtime.server.response_events import new_id

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
SUMMARIES = ("auto", "concise", "detailed")
MAX_METADATA = 16  # OpenAI's limits on metadata: pairs, key and value lengths
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512


# ---- input items -> chat messages ------------------------------------------------------------


def input_items(value: Any) -> list[dict[str, Any]]:
    """The request's `input` (a string: one user message) as items in Responses' own shape,
    each with an id (what GET .../input_items lists and a next turn continues)."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise HttpError(400, "input must be a string or a list of items", "input")
    return [input_item(item, i) for i, item in enumerate(value)]


def input_item(item: Any, i: int) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise HttpError(400, f"input[{i}] must be an object", "input")
    kind = item.get("type", "message" if "role" in item else None)
    fields = {k: item.get(k) for k in ("call_id", "name", "arguments", "output")}
    if kind == "message":
        return message_item(item, i)
    if kind == "function_call":
        for name in ("call_id", "name", "arguments"):
            if not isinstance(fields[name], str):
                raise HttpError(400, f"input[{i}].{name} must be a string", "input")
        call = {k: fields[k] for k in ("call_id", "name", "arguments")}
        return {"type": kind, "id": item_id(item, "fc"), **call, "status": "completed"}
    if kind == "function_call_output":
        output = fields["output"]
        if isinstance(output, list):
            output = parts_text(output, f"input[{i}].output")
        if not isinstance(fields["call_id"], str) or not isinstance(output, str):
            raise HttpError(400, f"input[{i}] needs call_id and output strings", "input")
        return {"type": kind, "id": item_id(item, "fco"), "call_id": fields["call_id"],
                "output": output, "status": "completed"}  # fmt: skip
    if kind == "reasoning":  # kept in the conversation, never shown to the model
        summary = item.get("summary")
        return {**item, "id": item_id(item, "rs"), "summary": summary if summary else []}
    raise HttpError(400, f"input[{i}]: item type {kind!r} is not supported", "input")


def message_item(item: dict[str, Any], i: int) -> dict[str, Any]:
    role, content = item.get("role"), item.get("content")
    if role not in ROLES:
        raise HttpError(400, f"input[{i}].role must be one of {ROLES}, got {role!r}", "input")
    if isinstance(content, list):
        content = parts_text(content, f"input[{i}].content")
    if not isinstance(content, str):
        raise HttpError(400, f"input[{i}].content must be a string or text parts", "input")
    part: dict[str, Any] = {"type": "input_text", "text": content}
    if role == "assistant":
        part = {"type": "output_text", "text": content, "annotations": []}
    return {"type": "message", "id": item_id(item, "msg"), "role": role, "content": [part],
            "status": "completed"}  # fmt: skip


def parts_text(parts: list[Any], where: str) -> str:
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise HttpError(400, f"{where}[{j}]: only {TEXT_PARTS} parts are supported", "input")
    return "".join(part["text"] for part in parts)


def item_id(item: dict[str, Any], prefix: str) -> str:
    given = item.get("id")
    return given if isinstance(given, str) and given else new_id(prefix)


def chat_messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """Chat completions messages of the items: `instructions` a system message first, function
    calls the assistant turn's tool_calls, their outputs tool messages; a function_call_output
    whose call_id no earlier function_call has is a 400."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    names: dict[str, str] = {}  # call_id -> function name
    for item in items:
        kind = item["type"]
        if kind == "message":
            text = "".join(part["text"] for part in item["content"])
            messages.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            names[item["call_id"]] = item["name"]
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            last = messages[-1] if messages else {}
            if last.get("role") == "assistant":  # the reply's text and calls are one turn
                last["tool_calls"] = [*last.get("tool_calls", []), call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            name = names.get(item["call_id"])
            if name is None:
                raise HttpError(
                    400,
                    f"function_call_output for call_id {item['call_id']!r}: no function_call "
                    "with that call_id comes before it",
                    "input",
                )
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "name": name,
                             "content": item["output"]})  # fmt: skip
    return messages


# ---- the other fields ------------------------------------------------------------------------


def function_tools(value: Any) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]]]:
    """Responses' flat function tools as chat tools, and as the response echoes them. Hosted
    tools (web_search, file_search, ...) are refused by name."""
    if value is None:
        return None, []
    if not isinstance(value, list):
        raise HttpError(400, "tools must be a list", "tools")
    chat, echo = [], []
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise HttpError(
                400, f"tools[{i}]: type {kind!r} is not supported (only function tools)", "tools"
            )
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        chat.append({"type": "function", "function": function})
        echoed = {k: tool.get(k) for k in ("name", "description", "parameters", "strict")}
        echo.append({"type": "function", **echoed})
    return chat, echo


def tool_choice(value: Any) -> tuple[Any, Any]:
    """(the chat tool_choice, the echo): none, auto, required, or {type: function, name}."""
    if value is None:
        return None, "auto"
    if value in ("none", "auto", "required"):
        return value, value
    if isinstance(value, dict) and value.get("type") == "function":
        name = value.get("name")
        if isinstance(name, str):
            return {"type": "function", "function": {"name": name}}, {"type": "function",
                                                                        "name": name}  # fmt: skip
    raise HttpError(
        400,
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...} "
        "(hosted tools and allowed_tools are not supported)",
        "tool_choice",
    )


def text_format(value: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the echo of `text`, the chat response_format) of text.format: text, json_object or
    json_schema {name, schema, strict}."""
    if value is None:
        return {"format": {"type": "text"}}, None
    if not isinstance(value, dict):
        raise HttpError(400, "text must be an object", "text")
    fmt = value.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    echo = {"format": fmt, "verbosity": value.get("verbosity")}
    if kind == "text":
        return echo, None
    if kind == "json_object":
        return echo, {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
            raise HttpError(
                400, "text.format json_schema needs a name and a schema object", "text.format"
            )
        spec = {"name": fmt["name"], "schema": fmt["schema"], "strict": fmt.get("strict")}
        return echo, {"type": "json_schema", "json_schema": spec}
    raise HttpError(400, "text.format.type must be text, json_object or json_schema",
                    "text.format")  # fmt: skip


def reasoning_of(value: Any) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the echo, chat_template_kwargs): effort none or minimal turns thinking off, any other
    effort on; no effort leaves the template's default."""
    if value is None:
        return None, None
    effort = value.get("effort") if isinstance(value, dict) else "?"
    summary = value.get("summary") if isinstance(value, dict) else None
    if effort not in (None, *EFFORTS) or summary not in (None, *SUMMARIES):
        raise HttpError(
            400, f"reasoning needs effort in {EFFORTS} and summary in {SUMMARIES}", "reasoning"
        )
    echo = {"effort": effort, "summary": summary}
    if effort is None:
        return echo, None
    return echo, {"enable_thinking": effort not in ("none", "minimal")}


def metadata_of(value: Any) -> dict[str, str]:
    """OpenAI's metadata: up to 16 string pairs (keys up to 64 chars, values up to 512)."""
    if value is None:
        return {}
    ok = isinstance(value, dict) and len(value) <= MAX_METADATA
    ok = ok and all(
        isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_METADATA_KEY
        and len(v) <= MAX_METADATA_VALUE for k, v in value.items()
    )  # fmt: skip
    if not ok:
        raise HttpError(
            400,
            f"metadata must be at most {MAX_METADATA} string pairs (keys up to "
            f"{MAX_METADATA_KEY} characters, values up to {MAX_METADATA_VALUE})",
            "metadata",
        )
    return value
