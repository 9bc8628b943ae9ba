"""API speculative execution (SGLang's `num_api_spec_tokens`): fewer calls to a hosted model by
letting one call run past a gen and matching what follows from its output.

Completion models (`CompletionSpeculation`): a gen with stop strings asks for up to
max(its max_tokens, num_api_spec_tokens) tokens with no stop; its value is the output up to
its first stop string, and the rest is kept. Constant text the program appends next is
checked against that rest (kept when it matches, dropped when not), and the next gen takes
its value from what is left, without a call, while its stop string is in sight. So a program
`"Name:" + gen(stop="\n") + "\nAge:" + gen(stop="\n")` costs one call when the model writes
the `\nAge:` itself, and gives the text a call per gen would: the same tokens, generated
from the same text. A speculated gen ends at its stop string; its own max_tokens is not
counted within the longer call.

Chat models (`ChatSpeculation`): a chat API cannot continue an assistant message, so inside
an assistant turn the constant text and gens wait until the turn ends; then one call writes
the whole turn (at most num_api_spec_tokens tokens, no stop), and the turn's text and gens are
matched from it in order: each constant must come next in the answer, each gen takes the
answer up to its first stop string (the last gen: the rest). A greedy answer that does not
fit raises; a sampled one is asked for again, up to 3 times.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_TRIES = 3  # SGLang's, for sampled answers


def first_stop(text: str, stops: list[str] | tuple[str, ...]) -> int:
    """Where the earliest stop string starts in `text`, or -1."""
    found = [pos for stop in stops if stop and (pos := text.find(stop)) >= 0]
    return min(found, default=-1)


class CompletionSpeculation:
    """The speculated text not yet used, for one program stream on a completion model."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens
        self.text = ""
        self.ended = False  # the call that wrote `text` ended on its own, not at its limit

    def on_text(self, text: str) -> None:
        """The program appended constant text: keep the speculation only if it goes on so."""
        if self.text.startswith(text):
            self.text = self.text[len(text) :]
        else:
            self.clear()

    def clear(self) -> None:
        self.text, self.ended = "", False

    def take(self, stops: list[str]) -> str | None:
        """The next gen's value: the kept text up to its first stop string (the stop stays
        for the text after the gen), all of it when the call ended on its own; None when
        the value cannot be told from it (no stop in sight and the call was cut)."""
        if not self.text:
            return None
        pos = first_stop(self.text, stops)
        if pos >= 0:
            value, self.text = self.text[:pos], self.text[pos:]
            return value
        if self.ended:
            value = self.text
            self.clear()
            return value
        return None

    def refill(self, text: str, ended: bool) -> None:
        self.text, self.ended = text, ended

    def call_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """The gen's parameters for the speculative call: more tokens, no stop."""
        limit = max(params.get("max_new_tokens", 0), self.num_tokens)
        return {**params, "max_new_tokens": limit, "stop": []}


@dataclass
class Term:
    """One piece of a deferred assistant turn: constant `text`, or a gen (`name`, `stops`;
    its `text` None until matched)."""

    text: str | None = None
    name: str | None = None
    stops: list[str] = field(default_factory=list)
    is_gen: bool = False


class ChatSpeculation:
    """The deferred pieces of the open assistant turn, for one stream on a chat model."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens
        self.terms: list[Term] = []
        self.params: dict[str, Any] | None = None

    def add_text(self, text: str) -> None:
        self.terms.append(Term(text=text))

    def add_gen(self, name: str | None, params: dict[str, Any]) -> None:
        """Defer a gen. Raises ValueError when its sampling parameters (besides stop and
        max_tokens) differ from the turn's other gens': one call serves them all."""
        shared = {k: v for k, v in params.items() if k not in ("stop", "max_new_tokens")}
        if self.params is not None and shared != self.params:
            raise ValueError(
                "with API speculative execution, the gens of one assistant turn must share "
                f"their sampling parameters: {shared} vs {self.params}"
            )
        self.params = shared
        self.terms.append(Term(name=name, stops=list(params.get("stop") or ()), is_gen=True))

    @property
    def has_gen(self) -> bool:
        return any(term.is_gen for term in self.terms)

    def call_params(self) -> dict[str, Any]:
        return {**(self.params or {}), "max_new_tokens": self.num_tokens, "stop": []}

    def tries(self) -> int:
        greedy = (self.params or {}).get("temperature", 1.0) < 1e-6
        return 1 if greedy else MAX_TRIES

    def match(self, answer: str) -> list[Term] | None:
        """The terms with every gen's text filled from `answer`, or None when the answer
        does not follow the turn's constant text."""
        filled, rest = [], answer
        last_gen = max(i for i, term in enumerate(self.terms) if term.is_gen)
        for i, term in enumerate(self.terms):
            if not term.is_gen:
                if not rest.startswith(term.text):
                    return None
                rest = rest[len(term.text) :]
                filled.append(term)
                continue
            pos = first_stop(rest, term.stops)
            if pos < 0 and i != last_gen:
                return None
            value, rest = (rest, "") if pos < 0 else (rest[:pos], rest[pos:])
            filled.append(Term(value, term.name, term.stops, is_gen=True))
        return filled

    def clear(self) -> None:
        self.terms, self.params = [], None
