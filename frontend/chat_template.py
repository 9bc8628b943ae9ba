"""Role prefixes and suffixes for `system`/`user`/`assistant`.

A backend's template is derived from the model's own Jinja chat template (its `model_info`):
rendering a few messages with marker contents yields each role's prefix and suffix, the
default system prompt the template inserts when a conversation starts without one (SmolLM2
does), and the stop string that ends an assistant turn (`<|im_end|>` for ChatML). A model
without a template gets SGLang's `default` one. A template that cannot be rendered or split
into role blocks is never swapped silently for another format: the first role a program uses
raises ChatTemplateError naming the model and the reason (pass `chat_template=` to choose one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")


class ChatTemplateError(ValueError):
    """The served model's chat template cannot give role prefixes and suffixes."""


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    role_prefix_and_suffix: dict[str, tuple[str, str]]
    default_system_prompt: str | None = None
    stop_str: tuple[str, ...] = ()
    error: str | None = None  # set when the model's template is unusable (see module doc)

    def get_prefix_and_suffix(self, role: str) -> tuple[str, str]:
        """Raises ValueError for a role the template does not have, ChatTemplateError when
        the model's template could not be used."""
        if self.error is not None:
            raise ChatTemplateError(self.error)
        if role not in self.role_prefix_and_suffix:
            raise ValueError(f"chat template {self.name!r} has no role {role!r}")
        return self.role_prefix_and_suffix[role]


def _chatml(name: str, system_prompt: str | None) -> ChatTemplate:
    roles = {r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ROLES}
    return ChatTemplate(name, roles, system_prompt, ("<|im_end|>",))


TEMPLATES = {
    "default": ChatTemplate("default", {r: (f"{r.upper()}:", "\n") for r in ROLES}),
    "chatml": _chatml("chatml", None),
    "qwen": _chatml("qwen", "You are a helpful assistant."),
    "smollm2": _chatml(
        "smollm2", "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    ),
}


def get_chat_template(name: str) -> ChatTemplate:
    """A registered template by name; raises ValueError for an unknown name."""
    if name not in TEMPLATES:
        raise ValueError(f"unknown chat template {name!r}; known: {sorted(TEMPLATES)}")
    return TEMPLATES[name]


def template_for_model(model_info: dict[str, Any]) -> ChatTemplate:
    """The template of a served model, from its Jinja source; `default` if it has none. An
    unusable template gives a ChatTemplate whose roles raise ChatTemplateError."""
    source = model_info.get("chat_template")
    if not source:
        return TEMPLATES["default"]
    try:
        render = _jinja_renderer(source, model_info)
        return derive_template(render)
    except Exception as e:  # jinja raises many kinds; each becomes the same clear error
        name = model_info.get("model") or model_info.get("model_path") or "the model"
        message = (
            f"the chat template of {name} cannot be split into role blocks "
            f"({type(e).__name__}: {e}); pass chat_template='chatml', 'default' or a "
            "ChatTemplate to run(), or serve the model with another template"
        )
        logger.warning("%s", message)
        return ChatTemplate("unusable", {}, error=message)


Render = Callable[[list[dict[str, str]]], str]
MARK = {r: f"@@{r.upper()}@@" for r in ROLES}


def _jinja_renderer(source: str, model_info: dict[str, Any]) -> Render:

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    template = env.from_string(source)
    tokens = {k: model_info.get(k) or "" for k in ("bos_token", "eos_token")}
    return lambda messages: template.render(messages=messages, **tokens)


def _split(text: str, head: str, mark: str) -> tuple[str, str]:
    """(prefix, suffix) around `mark` in `text`, which must start with `head`."""
    if not text.startswith(head) or text.count(mark) != 1:
        raise ValueError("template output is not a sequence of role blocks")
    return tuple(text[len(head) :].split(mark))  # type: ignore[return-value]


def derive_template(render: Render) -> ChatTemplate:
    """Split renders of growing conversations into role prefixes/suffixes. Raises ValueError
    when the template is not a plain concatenation of per-role blocks."""
    msgs = [{"role": r, "content": MARK[r]} for r in ROLES]
    texts = [render(msgs[: i + 1]) for i in range(3)]
    heads = ["", texts[0], texts[1]]
    roles = {r: _split(texts[i], heads[i], MARK[r]) for i, r in enumerate(ROLES)}
    user_block = roles["user"][0] + MARK["user"] + roles["user"][1]
    alone = render(msgs[1:2])
    if not alone.endswith(user_block):
        raise ValueError("a user-only conversation does not end with the user block")
    system_prompt = _default_system(alone[: -len(user_block)], roles["system"])
    stop = roles["assistant"][1].strip()
    name = "chatml" if roles == TEMPLATES["chatml"].role_prefix_and_suffix else "model"
    return ChatTemplate(name, roles, system_prompt, (stop,) if stop else ())


def _default_system(head: str, system: tuple[str, str]) -> str | None:
    """The system prompt the template inserts before a first non-system message, if any."""
    prefix, suffix = system
    if not head:
        return None
    if head.startswith(prefix) and head.endswith(suffix) and len(head) >= len(prefix + suffix):
        return head[len(prefix) : len(head) - len(suffix)]
    raise ValueError(f"unrecognized text before the first user message: {head!r}")
