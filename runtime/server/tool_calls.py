"""OpenAI tool calling: the tools in the prompt, the calls out of the reply, and the grammar
that makes a call parse (torch-free).

A format (`--tool-call-parser`, SGLang's names) says how a model writes its calls:
  hermes / qwen25 / qwen3   <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one per call
  llama3                    {"name": ..., "parameters": {...}}, calls joined by "; "
  mistral                   [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]
  pythonic                  [get_weather(city="Paris"), ...]
  generic                   radixflow's own, for templates that know no tools: the tools are
                            described in the system turn and the whole reply is one JSON object,
                            {"tool_calls": [{"name": ..., "arguments": {...}}]} or
                            {"content": "..."}, always generated under its grammar.
With `tool_choice` required or named, the reply is generated under a grammar built from the
tools' JSON schemas (the name is one of the tools, the arguments valid for that tool), so a
malformed call cannot be written: a regex for the template formats, a JSON schema for generic.
With `auto`, generic is constrained to "a call or an answer"; the template formats generate
freely until the reply opens a call (`trigger`: the format's start tag), and the call is
generated under the same grammar from there (a structural tag, runtime/constrained/
triggered.py): hermes after each `<tool_call>`, mistral after `[TOOL_CALLS]`, llama3 when the
reply opens with `{`. Pythonic is never constrained.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from outlines_core.json_schema import build_regex_from_schema

from radixflow.runtime.constrained.schema_regex import bounded_schema_regex, closed

FORMATS = ("hermes", "qwen25", "qwen3", "llama3", "mistral", "pythonic", "generic")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
MAX_PARALLEL = 8  # calls in one reply: a model that repeats itself still closes the reply


class ToolError(ValueError):
    """A tools, tool_choice or tool message the request got wrong; the message names it."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        """The tool as OpenAI writes it (what chat templates take)."""
        function = {"name": self.name, "description": self.description}
        return {"type": "function", "function": {**function, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # none | auto | required
    name: str | None = None  # a named function (mode "required")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    def openai(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


def parse_tools(value: Any) -> list[Tool]:
    """OpenAI's `tools` (a list of {"type": "function", "function": {...}}), checked."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ToolError("tools must be a list")
    tools = []
    for i, entry in enumerate(value):
        function = entry.get("function") if isinstance(entry, dict) else None
        if entry.get("type", "function") != "function" or not isinstance(function, dict):
            raise ToolError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}')
        name, params = function.get("name"), function.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ToolError(f"tools[{i}].function.name must be 1-64 of [A-Za-z0-9_.-]")
        if not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object")
        description = function.get("description") or ""
        tools.append(Tool(name, str(description), params))
    if len({t.name for t in tools}) != len(tools):
        raise ToolError("tools must have distinct names")
    return tools


def parse_tool_choice(value: Any, tools: list[Tool]) -> ToolChoice:
    """OpenAI's `tool_choice`: none, auto (the default with tools), required, or a named
    function ({"type": "function", "function": {"name": ...}})."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise ToolError("tool_choice 'required' needs tools")
        return ToolChoice(value if tools else "none")  # auto with no tools: what clients send
    name = value.get("function", {}).get("name") if isinstance(value, dict) else None
    if not isinstance(name, str):
        raise ToolError('tool_choice must be none, auto, required or {"type": "function", ...}')
    if name not in {t.name for t in tools}:
        raise ToolError(f"tool_choice names {name!r}, which is not one of the tools")
    return ToolChoice("required", name)


def chosen(tools: list[Tool], choice: ToolChoice) -> list[Tool]:
    return [t for t in tools if choice.name in (None, t.name)]


def call_schema(tools: list[Tool], arguments: str = "arguments") -> dict[str, Any]:
    """One call: the name is one of the tools, the arguments valid for that tool."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, arguments: closed(t.parameters)},
            "required": ["name", arguments],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def schema_regex(schema: dict[str, Any]) -> str:
    """A call's regex: an optional space around every `{ } [ ] , :` (models lay calls out
    their own way; the canonical layout is for json_schema constraints)."""
    try:
        return bounded_schema_regex(schema, build_regex_from_schema, "[ ]?")
    except (ValueError, TypeError) as e:
        raise ToolError(f"a tool's parameters are not a usable JSON schema: {e}") from e


# ---- formats ---------------------------------------------------------------------------------


class Format:
    """How one model family writes tool calls. `start` opens a call in free text."""

    name = ""
    start = ""

    def grammar(self, tools: list[Tool], parallel: bool) -> dict[str, str]:
        """Sampling parameters (regex or json_schema) that admit only valid calls."""
        raise ToolError(f"the {self.name} format has no grammar for required calls")

    def trigger(self, tools: list[Tool], parallel: bool) -> dict[str, Any] | None:
        """tool_choice auto: the structural tag that leaves the reply free until it opens a
        call, then generates the call under the tools' grammar; None: no constraint."""
        return None

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a reply; text that does not parse as calls stays content."""
        raise NotImplementedError

    def holdback(self, text: str) -> int:
        """How much of `text` may stream as content: up to where a call may be starting."""
        if not self.start:
            return len(text)
        at = text.find(self.start)
        if at >= 0:
            return at
        for keep in range(min(len(self.start) - 1, len(text)), 0, -1):
            if self.start.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)


def _call(name: Any, arguments: Any) -> ToolCall | None:
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False), new_id())


def new_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _tag(structures: list[dict[str, str]], trigger: str, **flags: bool) -> dict[str, Any]:
    return {"type": "structural_tag", "structures": structures, "triggers": [trigger], **flags}


def _repeat(one: str, separator: str, parallel: bool) -> str:
    return f"{one}(?:{separator}{one}){{0,{MAX_PARALLEL - 1}}}" if parallel else one


class Hermes(Format):
    name, start = "hermes", "<tool_call>"

    def grammar(self, tools: list[Tool], parallel: bool) -> dict[str, str]:
        one = rf"<tool_call>\n(?:{schema_regex(call_schema(tools))})\n</tool_call>"
        return {"regex": _repeat(one, r"\n", parallel)}

    def trigger(self, tools: list[Tool], parallel: bool) -> dict[str, Any] | None:
        """Each `<tool_call>` opens a call (one per tag: after it the reply is free again,
        or must end when parallel_tool_calls is false)."""
        call = schema_regex(call_schema(tools))
        structure = {"begin": "<tool_call>\n", "regex": call, "end": "\n</tool_call>"}
        return _tag([structure], self.start, stop_after_first=not parallel)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls, content = [], text
        for match in re.finditer(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.S):
            try:
                body = json.loads(match.group(1))
            except json.JSONDecodeError:
                continue
            call = (
                _call(body.get("name"), body.get("arguments")) if isinstance(body, dict) else None
            )
            if call is not None:
                calls.append(call)
                content = content.replace(match.group(0), "", 1)
        return (content.strip() if calls else content), calls


class Llama3(Format):
    name, start = "llama3", "{"

    def grammar(self, tools: list[Tool], parallel: bool) -> dict[str, str]:
        one = f"(?:{schema_regex(call_schema(tools, 'parameters'))})"
        return {"regex": _repeat(one, "; ", parallel)}

    def trigger(self, tools: list[Tool], parallel: bool) -> dict[str, Any] | None:
        """A reply that opens with "{" is calls: the trigger is that brace, the grammar the
        rest of the first call (each tool's call regex less its opening brace), then more."""
        calls = [schema_regex(call_schema([t], "parameters")) for t in tools]
        assert all(c.startswith(r"\{") for c in calls), calls
        rest = "|".join(f"(?:{c[2:]})" for c in calls)
        more = f"(?:; (?:{'|'.join(calls)})){{0,{MAX_PARALLEL - 1}}}" if parallel else ""
        structure = {"begin": "{", "regex": f"(?:{rest}){more}", "end": ""}
        return _tag([structure], "{", at_start=True, stop_after_first=True)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>")
        calls = []
        parts = body.split("; ") if body.startswith("{") else []
        for i, part in enumerate(parts):
            try:
                obj = json.loads(part)
            except json.JSONDecodeError:
                if calls and i == len(parts) - 1:  # cut by max_tokens: the complete calls
                    return "", calls
                return text, []
            call = _call(obj.get("name"), obj.get("parameters", obj.get("arguments")))
            if not isinstance(obj, dict) or call is None:
                return text, []
            calls.append(call)
        return ("" if calls else text), calls

    def holdback(self, text: str) -> int:  # a reply that opens with "{" is a call
        opened = text.lstrip().startswith(("{", "<|python_tag|>"))
        return 0 if opened or not text.strip() else len(text)


class Mistral(Format):
    name, start = "mistral", "[TOOL_CALLS]"

    def grammar(self, tools: list[Tool], parallel: bool) -> dict[str, str]:
        return {"regex": r"\[TOOL_CALLS\] ?\[" + self.calls(tools, parallel) + r"\]"}

    def calls(self, tools: list[Tool], parallel: bool) -> str:
        return _repeat(f"(?:{schema_regex(call_schema(tools))})", ", ?", parallel)

    def trigger(self, tools: list[Tool], parallel: bool) -> dict[str, Any] | None:
        """Everything after `[TOOL_CALLS]` is the list of calls."""
        regex = r" ?\[" + self.calls(tools, parallel) + r"\]"
        structure = {"begin": self.start, "regex": regex, "end": ""}
        return _tag([structure], self.start, stop_after_first=True)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        head, marker, tail = text.partition(self.start)
        if not marker:
            return text, []
        try:
            items = json.loads(tail.strip())
        except json.JSONDecodeError:
            return text, []
        items = items if isinstance(items, list) else [items]
        calls = [_call(x.get("name"), x.get("arguments")) for x in items if isinstance(x, dict)]
        if not calls or None in calls:
            return text, []
        return head.strip(), calls  # type: ignore[return-value]


class Pythonic(Format):
    name, start = "pythonic", "["

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:
            return text, []
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return text, []
            try:
                arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            except ValueError:
                return text, []
            calls.append(ToolCall(node.func.id, json.dumps(arguments), new_id()))
        return "", calls

    def holdback(self, text: str) -> int:
        return 0 if text.lstrip().startswith("[") or not text.strip() else len(text)


class Generic(Format):
    name, start = "generic", ""

    def grammar(self, tools: list[Tool], parallel: bool) -> dict[str, str]:
        return self.constraint(tools, parallel, answer=False)

    def constraint(self, tools: list[Tool], parallel: bool, answer: bool) -> dict[str, str]:
        """As a regex (schema_regex: bounded numbers take at most a few fraction digits, so a
        model cannot write 1.000... until max_tokens); a JSON schema where the answer's free
        text makes the regex too large to be worth it."""
        schema = self.schema(tools, parallel, answer)
        return {"json_schema": json.dumps(schema)} if answer else {"regex": schema_regex(schema)}

    def schema(self, tools: list[Tool], parallel: bool, answer: bool) -> dict[str, Any]:
        calls = {"type": "array", "items": call_schema(tools), "minItems": 1}
        calls["maxItems"] = MAX_PARALLEL if parallel else 1
        call = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"]}
        if not answer:
            return call
        reply = {"type": "object", "properties": {"content": {"type": "string"}}}
        return {"anyOf": [call, {**reply, "required": ["content"]}]}

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:  # cut by max_tokens: the calls completed before the cut
            calls = complete_calls(text)
            return ("", calls) if calls else (text, [])
        if isinstance(obj, dict) and isinstance(obj.get("content"), str):
            return obj["content"], []
        items = obj.get("tool_calls") if isinstance(obj, dict) else None
        items = items if isinstance(items, list) else []
        calls = [_call(x.get("name"), x.get("arguments")) for x in items if isinstance(x, dict)]
        if not calls or None in calls:
            return text, []
        return "", calls  # type: ignore[return-value]

    def holdback(self, text: str) -> int:
        return 0  # one JSON object: known to be an answer or a call only at the end


def complete_calls(text: str) -> list[ToolCall]:
    """The whole calls at the start of a generic reply cut short (`{"tool_calls": [{...},
    {...}, {..` gives the first two): a model that repeats its call until max_tokens still
    hands back the calls it finished."""
    head = re.match(r'\{\s*"tool_calls"\s*:\s*\[', text)
    decoder, at, calls = json.JSONDecoder(), head.end() if head else len(text), []
    while head:
        at = len(text) - len(text[at:].lstrip(" \n,"))
        try:
            item, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            break
        call = _call(item.get("name"), item.get("arguments")) if isinstance(item, dict) else None
        if call is None:
            break
        calls.append(call)
    return calls


def get_format(name: str) -> Format:
    if name in ("hermes", "qwen25", "qwen3"):
        return Hermes()
    by_name = {"llama3": Llama3, "mistral": Mistral, "pythonic": Pythonic, "generic": Generic}
    if name not in by_name:
        raise ValueError(f"unknown tool-call parser {name!r}; expected one of {FORMATS}")
    return by_name[name]()


def infer_format(template: str | None) -> str:
    """The format a chat template writes calls in; generic where it knows no tools."""
    source = template or ""
    if "tools" not in source:
        return "generic"
    if "<tool_call>" in source:
        return "hermes"
    if "[TOOL_CALLS]" in source:
        return "mistral"
    if "<|python_tag|>" in source or "ipython" in source:
        return "llama3"
    return "generic"


# ---- the prompt ----------------------------------------------------------------------------

GENERIC_SYSTEM = (
    "You can call these tools (JSON schemas of their arguments):\n{tools}\n"
    "Reply with one JSON object and nothing else. To call tools: "
    '{{"tool_calls": [{{"name": "<tool name>", "arguments": {{<arguments>}}}}]}}. '
    'To answer without a tool: {{"content": "<your answer>"}}.'
)


def generic_system(tools: list[Tool]) -> str:
    described = [{"name": t.name, "description": t.description, "parameters": t.parameters}
                 for t in tools]  # fmt: skip
    return GENERIC_SYSTEM.format(tools=json.dumps(described, ensure_ascii=False))


def message_for_template(message: dict[str, Any], generic: bool) -> dict[str, Any]:
    """An assistant turn's tool_calls and a tool turn, as the chat template takes them (the
    arguments as objects); with the generic format, as the text the model would write."""
    calls = message.get("tool_calls")
    role = message["role"]
    content = message.get("content") or ""
    if role == "assistant" and calls:
        parsed = [_template_call(c, i) for i, c in enumerate(calls)]
        if generic:
            return {"role": "assistant", "content": json.dumps({"tool_calls": parsed})}
        wrapped = [{"type": "function", "id": c.get("id"), "function": p}
                   for c, p in zip(calls, parsed)]  # fmt: skip
        return {"role": "assistant", "content": content, "tool_calls": wrapped}
    if role == "tool":
        name, call_id = message.get("name"), message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise ToolError("a tool message needs its tool_call_id")
        if generic:
            result = {"tool_result": {"tool_call_id": call_id, "name": name, "content": content}}
            return {"role": "tool", "content": json.dumps(result)}
        return {"role": "tool", "content": content, "tool_call_id": call_id, "name": name}
    return {"role": role, "content": content}


def _template_call(call: Any, i: int) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ToolError(f"tool_calls[{i}] needs function.name")
    arguments = function.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError as e:
        raise ToolError(f"tool_calls[{i}].function.arguments is not JSON") from e
    return {"name": function["name"], "arguments": arguments}
