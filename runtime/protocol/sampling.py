"""SamplingParams: the one definition of every sampling parameter (torch-free).

The frontend's `gen()` and the wire protocol derive their field lists from this class, so a
new parameter is added here once. Names and meanings follow SGLang's server.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None  # a grammar in GBNF (SGLang's ebnf; Lark syntax too): llguidance
    # SGLang's structural tag (JSON text): free text, and a grammar from each trigger on
    # (runtime/constrained/triggered.py; also tool_choice auto and reasoning)
    structural_tag: str | None = None
    choices: tuple[str, ...] | None = None
    seed: int | None = None
    stop_regex: tuple[str, ...] = ()  # generation stops when the generated text matches one
    # OpenAI's map: token id (a decimal string) -> bias added to its logit; -100 bans the token
    logit_bias: dict[str, float] | None = None
    # a think block's budget: past this many output tokens with `thinking_end` not written,
    # the scheduler writes it (reasoning_effort, Anthropic's budget_tokens); None: no budget
    max_thinking_tokens: int | None = None
    thinking_end: str = ""

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6 or self.top_k == 1

    @property
    def grammar_key(self) -> tuple[str, str] | None:
        """(kind, text) of the output constraint, or None."""
        if self.regex:
            return ("regex", self.regex)
        if self.json_schema:
            return ("json", self.json_schema)
        if self.ebnf:
            return ("ebnf", self.ebnf)
        if self.structural_tag:
            return ("structural_tag", self.structural_tag)
        if self.choices:
            return ("choices", json.dumps(list(self.choices)))
        return None

    def validate(self) -> None:
        """Raise ValueError naming the first bad parameter."""
        checks = [
            ("max_new_tokens", self.max_new_tokens >= 0),
            ("min_new_tokens", 0 <= self.min_new_tokens <= max(self.max_new_tokens, 0)),
            ("n", 1 <= self.n <= 64),
            ("temperature", 0.0 <= self.temperature <= 100.0),
            ("top_p", 0.0 < self.top_p <= 1.0),
            ("top_k", self.top_k == -1 or 1 <= self.top_k < 2**31),
            ("min_p", 0.0 <= self.min_p <= 1.0),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0),
            ("repetition_penalty", 0.01 <= self.repetition_penalty <= 10.0),
            ("stop", all(isinstance(s, str) and s for s in self.stop)),
            ("stop_token_ids", all(0 <= t < 2**31 for t in self.stop_token_ids)),
            ("choices", self.choices is None or (len(self.choices) > 0 and all(self.choices))),
            ("seed", self.seed is None or 0 <= self.seed < 2**63),
            ("logit_bias", self.logit_bias is None or _valid_bias(self.logit_bias)),
            (
                "max_thinking_tokens",
                self.max_thinking_tokens is None
                or (self.max_thinking_tokens >= 0 and bool(self.thinking_end)),
            ),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"invalid sampling parameter {name}={getattr(self, name)!r}")
        for pattern in self.stop_regex:
            problem = regex_problem(pattern)
            if problem:
                raise ValueError(f"invalid sampling parameter stop_regex={pattern!r}: {problem}")
        constraints = (self.regex, self.json_schema, self.ebnf, self.choices, self.structural_tag)
        if sum(x is not None and x != () for x in constraints) > 1:
            raise ValueError(
                "at most one of regex, json_schema, ebnf, choices and structural_tag may be set"
            )

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> SamplingParams:
        """Build from a plain dict (user or wire input), checking names, types and ranges."""
        params = dict(params or {})
        if "max_tokens" in params and "max_new_tokens" not in params:
            params["max_new_tokens"] = params.pop("max_tokens")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - set(fields))
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        clean: dict[str, Any] = {}
        for name, value in params.items():
            if value is None:
                continue
            clean[name] = _coerce(name, fields[name].default, value)
        sampling = cls(**clean)
        sampling.validate()
        return sampling

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for name in ("stop", "stop_token_ids", "choices", "stop_regex"):
            if out[name] is not None:
                out[name] = list(out[name])
        return out


def _coerce(name: str, default: Any, value: Any) -> Any:
    def bad() -> ValueError:
        return ValueError(f"invalid sampling parameter {name}={value!r}")

    if name == "logit_bias":
        return _coerce_bias(value, bad)
    if name in ("stop", "choices", "stop_regex"):
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise bad()
        return tuple(value)
    if name == "stop_token_ids":
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise bad()
        return tuple(value)
    if name in ("json_schema", "structural_tag"):
        if isinstance(value, dict):
            return json.dumps(value)
        if not isinstance(value, str):
            raise bad()
        return value or None
    if name in ("regex", "ebnf"):
        if not isinstance(value, str):
            raise bad()
        return value or None
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise bad()
        return value
    if isinstance(default, str):  # thinking_end
        if not isinstance(value, str):
            raise bad()
        return value
    if isinstance(default, int) or name in ("seed", "max_thinking_tokens"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad()
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad()
        if value != value:  # NaN
            raise bad()
        return float(value)
    return value


def regex_problem(pattern: Any) -> str | None:
    """Why `pattern` is not a usable regex (re's message), or None if it compiles."""
    if not isinstance(pattern, str) or not pattern:
        return "must be a non-empty string"
    try:
        re.compile(pattern)
    except (re.error, OverflowError, RecursionError) as e:  # a{10**10} overflows
        return str(e)
    return None


def _coerce_bias(value: Any, bad: Any) -> dict[str, float] | None:
    """OpenAI's logit_bias (keys token ids as decimal strings or ints) -> {"id": bias}, None
    when empty. The ids are checked against the vocabulary where the model is known."""
    if not isinstance(value, dict):
        raise bad()
    out = {}
    for key, bias in value.items():
        if isinstance(key, str) and key.isdecimal() and key.isascii() and len(key) < 10:
            token = int(key)
        elif type(key) is int and 0 <= key < 2**31:
            token = key
        else:
            raise bad()
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise bad()
        out[str(token)] = float(bias)
    return out or None


def _valid_bias(bias: dict[str, float]) -> bool:
    return all(
        isinstance(k, str)
        and k.isdecimal()
        and isinstance(v, float)
        and math.isfinite(v)
        and -100.0 <= v <= 100.0
        for k, v in bias.items()
    )


def with_defaults(
    params: dict[str, Any] | None, model_info: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(params with the model's sampling defaults for the fields it leaves unset, the
    defaults so applied): a request's own value, even null, wins over the model's."""
    params = dict(params or {})
    applied = {
        name: value
        for name, value in model_info.get("sampling_defaults", {}).items()
        if name not in params
    }
    return {**params, **applied}, applied
