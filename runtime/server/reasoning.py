"""Reasoning models (`--reasoning-parser`, SGLang's names): the text between the think tags is
`reasoning_content`, the rest `content` (torch-free).

  qwen3        the reply may open with <think> and closes it with </think>; with
               enable_thinking false the template writes an empty block into the prompt, and
               the reply is all content
  deepseek-r1  the template opens <think> in the prompt: the reply is reasoning until </think>
"""

from __future__ import annotations

from dataclasses import dataclass

PARSERS = ("qwen3", "deepseek-r1")
OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str

    def __post_init__(self) -> None:
        if self.name not in PARSERS:
            raise ValueError(f"unknown reasoning parser {self.name!r}; expected one of {PARSERS}")

    def split(self, text: str, thinking: bool = True) -> tuple[str, str]:
        """(reasoning, content) of a reply, finished or not: an unclosed block is all
        reasoning so far. `thinking` False (enable_thinking off) makes it all content."""
        if not thinking:
            return "", text
        body = text.lstrip()
        opened = body.startswith(OPEN)
        if opened:
            body = body[len(OPEN) :]
        elif self.name == "qwen3" and CLOSE not in body:
            return "", text  # qwen3 without a block: an answer
        reasoning, closed, content = body.partition(CLOSE)
        if not closed:
            return reasoning.strip("\n"), ""
        return reasoning.strip("\n"), content.lstrip("\n")

    def visible(self, text: str, thinking: bool = True) -> tuple[str, str]:
        """What of a reply still streaming may be shown: a reasoning or content part that
        could be the start of a tag is held back."""
        if thinking and text.strip() and OPEN.startswith(text.strip()):
            return "", ""  # the opening tag itself, still arriving
        reasoning, content = self.split(text, thinking)
        if not content and thinking:
            for tag in (CLOSE, OPEN):
                for keep in range(len(tag) - 1, 0, -1):
                    if reasoning.endswith(tag[:keep]):
                        reasoning = reasoning[:-keep]
                        break
            return reasoning.rstrip("\n"), ""  # newlines before the close tag are dropped
        return reasoning, content
