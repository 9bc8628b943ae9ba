"""Anthropic's Messages request (runtime/server/anthropic_api.py) as the OpenAI chat body the
shared chat core takes: `system` is the system turn, `tool_use` blocks the assistant's
`tool_calls` (arguments as JSON text), `tool_result` blocks `tool` messages (`is_error` results
start with "Error: "), custom tools OpenAI functions, `tool_choice` any `required` and
`disable_parallel_tool_use` `parallel_tool_calls: false`, `stop_sequences` `stop`, `thinking`
`chat_template_kwargs.enable_thinking`, `output_config.format` `response_format`.

Anthropic validates strictly, and so does this door: a wrong type, an unknown role, a
`tool_result` for no earlier `tool_use`, or a block radixflow cannot take (documents, hosted
tools) is a 400 naming the field. A user turn's `image` blocks (base64 or url source) become
OpenAI `image_url` parts (a vision model's; a text-only model refuses them with a 400).
Unknown top-level fields are ignored with a warning, as on the OpenAI routes.
"""

from __future__ import annotations

import json
import re
from typing import Any

from radixflow.runtime.server.http_request import HttpError, check_fields, typed

COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config"}
FIELDS = COUNT_FIELDS | {
    "max_tokens", "stop_sequences", "temperature", "top_p", "top_k", "stream", "metadata",
    # Anthropic's routing, caching and billing options: nothing to do here at any value
    "service_tier", "cache_control", "inference_geo", "speed", "diagnostics", "user_profile_id",
    "workspace_id",
}  # fmt: skip
# fields that ask for what radixflow does not have (hosted tools, containers): only "none"
NOOP = {"mcp_servers": None, "container": None, "context_management": None}
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
THINKING = ("enabled", "disabled", "adaptive")
JOIN = "\n\n"  # between the text blocks of one turn, and between joined turns
RANGES = {"temperature": (float, 0, 1), "top_p": (float, 0, 1), "top_k": (int, 1, None)}


def bad(message: str, field: str | None = None) -> HttpError:
    return HttpError(400, message, field)


def check_body(body: Any, fields: set[str]) -> dict[str, Any]:
    """The body's top level: an object with a model name; unknown fields warned about."""
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    check_fields(body, fields, NOOP, (), "")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise bad("model: a model name (string) is required", "model")
    typed(body, "metadata", dict)
    return body


def chat_body(body: dict[str, Any], most_tokens: int) -> dict[str, Any]:
    """Anthropic's request as the chat completions body the chat core takes; raises a 400
    naming the Anthropic field that is wrong. `most_tokens`: the largest max_tokens."""
    max_tokens = typed(body, "max_tokens", int, None)
    if max_tokens is None or not 1 <= max_tokens <= most_tokens:
        raise bad(f"max_tokens: a positive integer up to {most_tokens} is required", "max_tokens")
    messages = chat_messages(body.get("messages"))
    system = system_text(body.get("system"))
    if system:
        messages.insert(0, {"role": "system", "content": system})
    tools = chat_tools(body.get("tools"))
    choice, parallel = chat_tool_choice(body.get("tool_choice"), tools)
    chat: dict[str, Any] = {
        "messages": messages,
        "max_completion_tokens": max_tokens,
        "stream": typed(body, "stream", bool, False),
        "parallel_tool_calls": parallel,
        "stop": stop_sequences(body),
        "chat_template_kwargs": thinking_kwargs(body.get("thinking"), max_tokens),
        "thinking_budget": (body.get("thinking") or {}).get("budget_tokens"),  # enforced
        "response_format": output_format(body.get("output_config")),
        "model": body.get("model"),  # a LoRA adapter's name runs under it (OpenAiRoutes)
    }
    if tools:
        chat.update(tools=tools, tool_choice=choice)
    for name, (kind, low, high) in RANGES.items():
        chat[name] = value = typed(body, name, kind, None)
        if value is not None and not (low <= value and (high is None or value <= high)):
            raise bad(f"{name} must be in [{low}, {high or 'inf'}]", name)
    return {k: v for k, v in chat.items() if v is not None}


def shows_thinking(body: dict[str, Any]) -> bool:
    """Thinking blocks come back only when asked for, as Anthropic's do."""
    thinking = body.get("thinking")
    return isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive")


def system_text(value: Any) -> str:
    if value is None or isinstance(value, str):
        return value or ""
    if not isinstance(value, list):
        raise bad("system must be a string or a list of text blocks", "system")
    return JOIN.join(text_of(block, f"system[{i}]") for i, block in enumerate(value))


def text_of(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise bad(f"{where}: only text blocks are taken here, got {kind!r}{unsupported(kind)}")
    if not isinstance(block.get("text"), str):
        raise bad(f"{where}.text must be a string")
    return block["text"]


IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")  # Anthropic's


def unsupported(kind: Any) -> str:
    if kind == "document":
        return " (radixflow has no document input)"
    return ""


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """Anthropic's turns as chat messages. Consecutive turns of one role are joined into one,
    as Anthropic joins them; a tool_result must answer a tool_use of an earlier turn."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    turns: list[tuple[str, list[tuple[str, dict[str, Any]]]]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            hint = " (the system prompt is the top-level system field)" if role == "system" else ""
            raise bad(f"{where}.role must be 'user' or 'assistant', got {role!r}{hint}", "messages")
        blocks = blocks_of(message.get("content"), f"{where}.content")
        if turns and turns[-1][0] == role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((role, blocks))
    # a last assistant turn with text is a prefill: the chat core continues it (chat.py)
    names: dict[str, str] = {}  # tool_use id -> tool name, from the turns so far
    out: list[dict[str, Any]] = []
    for role, blocks in turns:
        out += user_turn(blocks, names) if role == "user" else [assistant_turn(blocks, names)]
    return out


def blocks_of(content: Any, where: str) -> list[tuple[str, dict[str, Any]]]:
    """(where, block) of a turn's content: a string is one text block."""
    if isinstance(content, str):
        return [(where, {"type": "text", "text": content})]
    if not isinstance(content, list) or not content:
        raise bad(f"{where} must be a string or a non-empty list of content blocks", "messages")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad(f"{where}[{j}] must be a content block (an object with a type)", "messages")
    return [(f"{where}[{j}]", block) for j, block in enumerate(content)]


def user_turn(blocks: list[tuple[str, dict]], names: dict[str, str]) -> list[dict[str, Any]]:
    """Text blocks as user messages, tool_result blocks as tool messages, in their order."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []  # OpenAI content parts: text, image_url
    for where, block in blocks:
        if block["type"] == "tool_result":
            if parts:
                out.append({"role": "user", "content": user_content(parts)})
                parts = []
            out.append(tool_message(block, where, names))
        elif block["type"] == "text":
            parts.append({"type": "text", "text": text_of(block, where)})
        elif block["type"] == "image":
            parts.append({"type": "image_url", "image_url": {"url": image_url(block, where)}})
        else:
            kind = block["type"]
            raise bad(f"{where}: a {kind!r} block cannot be in a user turn{unsupported(kind)}")
    if parts:
        out.append({"role": "user", "content": user_content(parts)})
    return out


def user_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Text alone: one string (blocks joined); with images: parts, adjacent texts joined."""
    if all(p["type"] == "text" for p in parts):
        return JOIN.join(p["text"] for p in parts)
    out: list[dict[str, Any]] = []
    for part in parts:
        if part["type"] == "text" and out and out[-1]["type"] == "text":
            out[-1] = {"type": "text", "text": out[-1]["text"] + JOIN + part["text"]}
        else:
            out.append(part)
    return out


def image_url(block: dict[str, Any], where: str) -> str:
    """An image block's source as the URL the chat core reads: base64 as a data: URL (of
    Anthropic's media types), a url source as it is (the server's remote policy applies)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if media not in IMAGE_TYPES:
            raise bad(f"{where}.source.media_type must be one of {IMAGE_TYPES}", "messages")
        if not isinstance(data, str) or not data:
            raise bad(f"{where}.source.data must be a base64 string", "messages")
        return f"data:{media};base64,{data}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise bad(f"{where}.source must be {{type: base64, media_type, data}} or {{type: url, url}}",
              "messages")  # fmt: skip


def tool_message(block: dict[str, Any], where: str, names: dict[str, str]) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or call_id not in names:
        raise bad(f"{where}.tool_use_id {call_id!r} answers no tool_use of an earlier turn")
    content = block.get("content")
    if content is None or isinstance(content, str):
        text = content or ""
    elif isinstance(content, list):
        text = JOIN.join(text_of(b, f"{where}.content[{k}]") for k, b in enumerate(content))
    else:
        raise bad(f"{where}.content must be a string or a list of text blocks")
    is_error = block.get("is_error")
    if not isinstance(is_error, (bool, type(None))):
        raise bad(f"{where}.is_error must be a boolean")
    if is_error:
        text = f"Error: {text}"  # the model sees that the tool failed
    return {"role": "tool", "tool_call_id": call_id, "name": names[call_id], "content": text}


def assistant_turn(blocks: list[tuple[str, dict]], names: dict[str, str]) -> dict[str, Any]:
    """Text and tool_use blocks as one assistant message; earlier thinking is dropped, as
    Anthropic drops it from the context."""
    texts, calls = [], []
    for where, block in blocks:
        kind = block["type"]
        if kind == "text":
            texts.append(text_of(block, where))
        elif kind == "tool_use":
            call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
            if not isinstance(call_id, str) or not call_id:
                raise bad(f"{where}.id must be a non-empty string")
            if not isinstance(name, str) or not name:
                raise bad(f"{where}.name must be a non-empty string")
            if not isinstance(arguments, dict):
                raise bad(f"{where}.input must be an object")
            names[call_id] = name
            function = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
            calls.append({"id": call_id, "type": "function", "function": function})
        elif kind not in ("thinking", "redacted_thinking"):
            raise bad(f"{where}: a {kind!r} block cannot be in an assistant turn")
    message: dict[str, Any] = {"role": "assistant", "content": JOIN.join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def chat_tools(tools: Any) -> list[dict[str, Any]]:
    """Anthropic's custom tools ({name, description, input_schema}) as OpenAI functions."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad("tools must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad(f"{where} must be an object", "tools")
        kind = tool.get("type") or "custom"
        if kind != "custom":
            hosted = "only custom tools (name, description, input_schema) are supported"
            raise bad(f"{where}.type {kind!r}: {hosted}, not Anthropic's hosted tools", "tools")
        name, description = tool.get("name"), tool.get("description") or ""
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise bad(f"{where}.name must be 1-64 of [A-Za-z0-9_-]", "tools")
        if not isinstance(description, str):
            raise bad(f"{where}.description must be a string", "tools")
        schema = tool.get("input_schema")
        check_input_schema(schema, f"{where}.input_schema")
        function = {"name": name, "description": description, "parameters": schema}
        out.append({"type": "function", "function": function})
    return out


def check_input_schema(schema: Any, where: str) -> None:
    """The shape Anthropic requires (an object schema); the chat core refuses a schema its
    grammar cannot be built from."""
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise bad(f"{where} must be a JSON schema object with type 'object'", "tools")
    properties, required = schema.get("properties", {}), schema.get("required", [])
    if not isinstance(properties, dict) or not all(
        isinstance(p, dict) for p in properties.values()
    ):
        raise bad(f"{where}.properties must map names to schema objects", "tools")
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise bad(f"{where}.required must be a list of property names", "tools")


def chat_tool_choice(choice: Any, tools: list[dict[str, Any]]) -> tuple[Any, bool]:
    """(OpenAI's tool_choice, parallel_tool_calls) of Anthropic's tool_choice."""
    if choice is None:
        return None, True
    kinds = ("auto", "any", "tool", "none")
    if not isinstance(choice, dict) or choice.get("type") not in kinds:
        raise bad(f"tool_choice.type must be one of {kinds}", "tool_choice")
    parallel = not typed(choice, "disable_parallel_tool_use", bool, False)
    kind = choice["type"]
    if kind in ("any", "tool") and not tools:
        raise bad(f"tool_choice {kind!r} needs tools", "tool_choice")
    if kind != "tool":
        return TOOL_CHOICES[kind], parallel
    name = choice.get("name")
    if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
        raise bad(f"tool_choice.name {name!r} is not one of the tools", "tool_choice")
    return {"type": "function", "function": {"name": name}}, parallel


def stop_sequences(body: dict[str, Any]) -> list[str] | None:
    stops = body.get("stop_sequences")
    if stops is not None and not (
        isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)
    ):
        raise bad("stop_sequences must be a list of non-empty strings", "stop_sequences")
    return stops or None


def thinking_kwargs(value: Any, max_tokens: int) -> dict[str, bool] | None:
    """Anthropic's thinking as the template's enable_thinking; without it the template's
    default stands (a model that always thinks still thinks) and no thinking block is
    shown. budget_tokens is checked as Anthropic checks it and bounds the think block (the
    scheduler writes its end when it is spent); max_tokens bounds the reply, thinking
    included."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in THINKING:
        raise bad(f"thinking.type must be one of {THINKING}", "thinking")
    if value["type"] == "enabled":
        budget = typed(value, "budget_tokens", int, None)
        if budget is None or not 1 <= budget < max_tokens:
            raise bad("thinking.budget_tokens must be a positive integer below max_tokens",
                      "thinking")  # fmt: skip
    return {"enable_thinking": value["type"] != "disabled"}


def output_format(config: Any) -> dict[str, Any] | None:
    """output_config.format (a JSON schema the reply must match) as response_format."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise bad("output_config must be an object", "output_config")
    value = config.get("format")
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "json_schema":
        raise bad("output_config.format must be {type: json_schema, schema}", "output_config")
    if not isinstance(value.get("schema"), dict):
        raise bad("output_config.format.schema must be an object", "output_config")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": value["schema"]}}
