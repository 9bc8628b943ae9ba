"""Chat completions' messages and replies: the conversation (tool calls and tool results
included) through the chat template, `tools`/`tool_choice` into a grammar, and each reply back
into OpenAI's message (`content`, `reasoning_content`, `tool_calls`), whole or as stream deltas
(torch-free).

The tool-call format is `--tool-call-parser`, or inferred from the chat template
(runtime/server/tool_calls.py); `--reasoning-parser` splits the think block. Per request,
`chat_template_kwargs` reach the template (for example `enable_thinking: false`) and
`separate_reasoning: false` leaves the think block in `content`.

Constraints and reasoning: with a reasoning parser and thinking on, a request's constraint
(tools, json_schema, regex, ebnf, structural_tag) applies from the end of the think block: it
becomes a structural tag whose watch starts `after` "</think>" (`after_reasoning`). With
`enable_thinking: false` the template closes the block in the prompt, and the constraint
applies from the first token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from radixflow.runtime.server.images import TEXT_ONLY, ImageError
from radixflow.runtime.server.reasoning import CLOSE, ReasoningParser
from radixflow.runtime.server.tool_calls import (
    Format,
    Tool,
    ToolCall,
    ToolChoice,
    ToolError,
    chosen,
    generic_system,
    get_format,
    infer_format,
    message_for_template,
    parse_tool_choice,
    parse_tools,
)

ROLES = ("system", "user", "assistant", "developer", "tool")
CONSTRAINTS = ("regex", "json_schema", "ebnf", "structural_tag", "choices")
REGEX_META = set("\\.^$|?*+()[]{}")
BODY_OF = {"regex": "regex", "json_schema": "schema", "ebnf": "ebnf"}  # structural tag names


@dataclass(frozen=True)
class ChatPlan:
    """What one chat request asks: its prompt, the constraint its tools add, and how its
    replies are read back."""

    prompt: str
    constraint: dict[str, str]  # sampling params (regex / json_schema / structural_tag) or {}
    tool_format: Format | None  # None: tools are off (none given, or tool_choice none)
    reasoning: ReasoningParser | None
    thinking: bool
    after: str = ""  # constraints apply once the reply has written this ("</think>")
    soft: bool = False  # the constraint (auto's trigger) gives way to the request's own
    budget: int | None = None  # most tokens of thinking before the scheduler ends the block
    images: list[str] = field(default_factory=list)  # image_url URLs, in prompt order

    def sampling(self, params: dict[str, Any]) -> dict[str, Any]:
        """The request's sampling params with this plan's constraint; ToolError when both
        constrain (tool_choice required takes no other constraint)."""
        own = any(params.get(k) for k in CONSTRAINTS)
        if self.constraint and own and not self.soft:
            raise ToolError("tool_choice required (or named) takes no other constraint")
        params = params if own else {**params, **self.constraint}
        if self.budget is not None and self.after:  # thinking on, its end known
            params = {**params, "max_thinking_tokens": self.budget, "thinking_end": self.after}
        return after_reasoning(params, self.after)

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """(the assistant message of a finished reply, whether it calls tools)."""
        reasoning, content = self.split(text)
        calls: list[ToolCall] = []
        if self.tool_format is not None:
            content, calls = self.tool_format.parse(content)
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if not calls and message["content"] is None:
            message["content"] = ""
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning or None
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
        return message, bool(calls)

    def split(self, text: str, final: bool = True) -> tuple[str, str]:
        if self.reasoning is None:
            return "", text
        if final:
            return self.reasoning.split(text, self.thinking)
        return self.reasoning.visible(text, self.thinking)


@dataclass
class ChatStream:
    """One choice's stream: cumulative text in, OpenAI deltas out. Content that may be the
    start of a tool call is held back until the reply shows what it is."""

    plan: ChatPlan
    sent_reasoning: str = ""
    sent_content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        reasoning, content = self.plan.split(text, final)
        fmt = self.plan.tool_format
        if fmt is not None and final:
            content, self.calls = fmt.parse(content)
        elif fmt is not None:
            content = content[: fmt.holdback(content)]
        out = []
        if reasoning.startswith(self.sent_reasoning) and len(reasoning) > len(self.sent_reasoning):
            out.append({"reasoning_content": reasoning[len(self.sent_reasoning) :]})
            self.sent_reasoning = reasoning
        if content.startswith(self.sent_content) and len(content) > len(self.sent_content):
            out.append({"content": content[len(self.sent_content) :]})
            self.sent_content = content
        for i, call in enumerate(self.calls):
            out.append({"tool_calls": [{"index": i, **call.openai()}]})
        return out


def plan_chat(body: dict[str, Any], tokenizer: Any, config: Any, vision: bool = False) -> ChatPlan:
    """Render a chat request's prompt and read its tool and reasoning options; `vision`:
    whether the model takes images (image parts are refused otherwise). Raises ToolError
    (or ValueError) naming the field that is wrong."""
    tools = parse_tools(body.get("tools"))
    choice = parse_tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls must be a boolean")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ToolError("chat_template_kwargs must be an object")
    kwargs = with_effort(kwargs, body.get("reasoning_effort"))
    name = config.tool_call_parser or infer_format(getattr(tokenizer, "chat_template", None))
    fmt = get_format(name) if choice.mode != "none" else None
    generic = name == "generic"
    images: list[str] = []
    messages = clean_messages(body.get("messages"), generic, images)
    if images and not vision:
        raise ImageError(TEXT_ONLY)
    offered = chosen(tools, choice) if fmt is not None else []
    if generic and offered:
        messages = with_system(messages, generic_system(offered))
    template_tools = [t.openai() for t in offered] if offered and not generic else None
    prompt = render(tokenizer, messages, template_tools, kwargs, continuing(body, messages))
    constraint: dict[str, str] = {}
    trigger = fmt.trigger(offered, parallel) if fmt is not None and offered else None
    if fmt is not None and choice.mode == "required":
        constraint = fmt.grammar(offered, parallel)
    elif fmt is not None and generic:  # auto: a call or an answer, always one that parses
        constraint = fmt.constraint(offered, parallel, answer=True)
    elif trigger is not None:  # auto: free until the reply opens a call
        constraint = {"structural_tag": json.dumps(trigger)}
    separate = body.get("separate_reasoning", True)
    reasoning = ReasoningParser(config.reasoning_parser) if config.reasoning_parser else None
    thinking = bool(kwargs.get("enable_thinking", True))
    after = CLOSE if reasoning is not None and thinking else ""
    reader = reasoning if separate else None
    soft = trigger is not None and choice.mode == "auto" and not generic
    budget = thinking_budget(body)
    return ChatPlan(prompt, constraint, fmt, reader, thinking, after, soft, budget, images)


EFFORTS = {"none": False, "minimal": False, "low": True, "medium": True, "high": True,
           "xhigh": True}  # fmt: skip


# reasoning_effort -> most thinking tokens (high, and no effort: the model ends its block)
EFFORT_BUDGETS = {"low": 1024, "medium": 4096}


def thinking_budget(body: dict[str, Any]) -> int | None:
    """The think block's token budget: radixflow's `thinking_budget` (Anthropic's
    budget_tokens arrives as it), else reasoning_effort's; None for no budget."""
    budget = body.get("thinking_budget")
    if budget is None:
        return EFFORT_BUDGETS.get(body.get("reasoning_effort"))
    if type(budget) is not int or budget < 1:
        raise ToolError("thinking_budget must be a positive integer")
    return budget


def with_effort(kwargs: dict[str, Any], effort: Any) -> dict[str, Any]:
    """OpenAI's reasoning_effort as the template's enable_thinking: none and minimal turn
    thinking off, low/medium/high on (low and medium with a budget: EFFORT_BUDGETS). An
    explicit chat_template_kwargs.enable_thinking wins."""
    if effort is None:
        return kwargs
    if effort not in EFFORTS:
        raise ToolError(f"reasoning_effort must be one of {tuple(EFFORTS)}, got {effort!r}")
    return {"enable_thinking": EFFORTS[effort], **kwargs}


def continuing(body: dict[str, Any], messages: list[dict[str, Any]]) -> bool:
    """Whether the reply continues the last (assistant) message instead of opening a turn:
    a trailing assistant message with text is continued unless continue_final_message is
    false (assistant prefill); continue_final_message true wants such a message."""
    wanted = body.get("continue_final_message")
    if wanted is not None and not isinstance(wanted, bool):
        raise ToolError("continue_final_message must be a boolean")
    last = messages[-1]
    prefill = last["role"] == "assistant" and bool(last.get("content"))
    if wanted and not prefill:
        raise ToolError("continue_final_message needs a last assistant message with content")
    return prefill and wanted is not False


def after_reasoning(params: dict[str, Any], after: str) -> dict[str, Any]:
    """`params` with its constraint applied from `after` on: a structural tag whose watch
    starts there (a trigger "" fires at once), the constraint itself its one structure."""
    kind = next((k for k in CONSTRAINTS if params.get(k)), None)
    if not after or kind is None:
        return params
    out = {k: v for k, v in params.items() if k != kind}
    value = params[kind]
    if kind == "choices":  # one of the strings, as a regex the structure can hold
        kind, value = "regex", "(" + "|".join(map(regex_literal, value)) + ")"
    if kind == "structural_tag":
        tag = json.loads(value) if isinstance(value, str) else dict(value)
        if isinstance(tag, dict) and "after" not in tag:  # one that says where it starts keeps it
            tag["after"] = after
        out[kind] = json.dumps(tag)
        return out
    if kind == "json_schema" and isinstance(value, str):
        value = json.loads(value)
    structure = {"begin": "", BODY_OF[kind]: value, "end": ""}
    tag = {"type": "structural_tag", "structures": [structure], "triggers": [""]}
    out["structural_tag"] = json.dumps({**tag, "after": after, "stop_after_first": True})
    return out


def regex_literal(text: str) -> str:
    return "".join("\\" + c if c in REGEX_META else c for c in text)


def clean_messages(
    messages: Any, generic: bool, images: list[str] | None = None
) -> list[dict[str, Any]]:
    """The messages as the chat template takes them; each image_url part's URL is appended
    to `images` (in prompt order) and stays in its message as an image part."""
    if not isinstance(messages, list) or not messages:
        raise ToolError("messages must be a non-empty list")
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ToolError(f"messages[{i}] needs a role in {ROLES}")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text, and image_url
            parts = [content_part(p, f"messages[{i}]", images) for p in content]
            if any(p["type"] == "image" for p in parts):
                role = "system" if message["role"] == "developer" else message["role"]
                clean.append({"role": role, "content": parts})
                continue
            content = "".join(p["text"] for p in parts)
        calls = message.get("tool_calls") if message["role"] == "assistant" else None
        if content is None and not calls:
            raise ToolError(f"messages[{i}].content must be a string")
        if content is not None and not isinstance(content, str):
            raise ToolError(f"messages[{i}].content must be a string")
        role = "system" if message["role"] == "developer" else message["role"]
        clean.append(message_for_template({**message, "role": role, "content": content}, generic))
    return clean


def content_part(part: Any, where: str, images: list[str] | None) -> dict[str, Any]:
    """A text part as it is; an image_url part (OpenAI's: {"url": ...} or the URL) becomes
    {"type": "image"} for the template, its URL appended to `images`."""
    if not isinstance(part, dict):
        raise ToolError(f"{where}: a content part must be an object")
    if part.get("type") == "text" and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if part.get("type") == "image_url" and images is not None:
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str) or not url:
            raise ToolError(f"{where}: an image_url part needs image_url.url (a string)")
        images.append(url)
        return {"type": "image"}
    raise ToolError(f"{where}: content parts must be text or image_url")


def with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """The tools' description joins the system turn (or opens one)."""
    if messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[Any] | None,
    kwargs: dict,
    prefill: bool = False,
    add_generation_prompt: bool | None = None,
) -> str:
    """The prompt: the conversation and a new assistant turn, or (`prefill`) the last
    assistant message left open to be continued; `add_generation_prompt` False: the
    conversation alone (/tokenize's)."""
    if add_generation_prompt is None:
        add_generation_prompt = not prefill
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=prefill,
            **kwargs,
        )
    except Exception as e:  # jinja raises its own errors for conversations it refuses
        raise ToolError(f"the chat template refused the messages: {e}") from e


__all__ = ["ChatPlan", "ChatStream", "Tool", "ToolChoice", "plan_chat"]
