"""The fuzz tests' own schema of what a request may say: an oracle written from the documents
(docs/http.md, the wire spec in runtime/protocol/messages.py's docstring, SGLang's and OpenAI's
documented fields and ranges), never from the server's validation code, so a body the server
wrongly accepts or wrongly refuses fails the fuzz.

Every rule answers OK (the request must be served), BAD (it must be refused) or EITHER (the
documents leave it open, say temperature 50 or a regex Python accepts that a grammar backend
may not: the server may serve or refuse it, but must answer cleanly). The fuzzers draw most of
their values from the OK and BAD zones, so EITHER stays rare.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

OK, BAD, EITHER = "ok", "bad", "either"


def worst(*verdicts: str) -> str:
    """One request's verdict from its parts': any BAD refuses it, else any EITHER opens it."""
    if BAD in verdicts:
        return BAD
    return EITHER if EITHER in verdicts else OK


@dataclass(frozen=True)
class Limits:
    """What the model info documents: the vocabulary, the context and max_new_tokens' cap."""

    vocab_size: int
    context_length: int
    max_new_tokens_limit: int


def is_int(value: Any) -> bool:
    return type(value) is int  # a bool is not an int (JSON true is not 1)


def is_number(value: Any) -> bool:
    return type(value) in (int, float)


def in_range(value: Any, low: float, high: float, integer: bool = False) -> str:
    """OK inside [low, high], BAD outside it or for a wrong type or NaN."""
    if not (is_int(value) if integer else is_number(value)) or value != value:
        return BAD
    return OK if low <= value <= high else BAD


# Grammars whose fate the documents settle: these compile under any backend, those cannot.
GOOD_REGEX = ("[0-9]+", "yes|no", " [a-z]{1,3}")
BAD_REGEX = ("(", "[a-", "a{2,1}", ")")
GOOD_SCHEMA = ('{"type": "string"}', '{"type": "integer"}', '{"enum": ["a", "b"]}')
GOOD_EBNF = ('root ::= "yes" | "no"',)
BAD_EBNF = ("root ::= (", "root ::= undefined_rule")


def regex_verdict(value: Any) -> str:
    if value is None:
        return OK
    if not isinstance(value, str):
        return BAD
    if value in GOOD_REGEX:
        return OK
    try:
        re.compile(value)
    except (re.error, OverflowError, RecursionError):
        return BAD
    return EITHER  # Python's re is not the grammar backend's


def schema_verdict(value: Any) -> str:
    if value is None:
        return OK
    if isinstance(value, dict):
        return EITHER  # SGLang documents a string; a map is a courtesy
    if not isinstance(value, str):
        return BAD
    if value in GOOD_SCHEMA:
        return OK
    if value == "":
        return EITHER  # "no schema" to some clients, an unparsable one to others
    try:
        parsed = json.loads(value)
    except ValueError:
        return BAD
    return EITHER if isinstance(parsed, (dict, bool)) else BAD


def ebnf_verdict(value: Any) -> str:
    if value is None:
        return OK
    if not isinstance(value, str):
        return BAD
    return OK if value in GOOD_EBNF else BAD if value in BAD_EBNF else EITHER


def stop_verdict(value: Any) -> str:
    if value is None or (isinstance(value, str) and value):
        return OK
    if value == "":
        return EITHER
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        return BAD
    return OK if all(value) else EITHER


def sampling_verdict(params: dict[str, Any], limits: Limits, strict_names: bool) -> str:
    """SGLang's sampling parameters (docs/http.md lists them; ranges are SGLang's documented
    ones, OpenAI's where it defines the field). `strict_names`: an unknown name is BAD (the
    ZeroMQ spec: SamplingParams names) rather than ignored (HTTP: unknown fields are ignored)."""
    verdicts = []
    max_new = params.get("max_new_tokens", 128)
    for name, value in params.items():
        rule = SAMPLING_RULES.get(name)
        if rule is None:
            verdicts.append(EITHER if name in SAMPLING_ALIASES else BAD if strict_names else OK)
        elif value is None:
            verdicts.append(EITHER if strict_names else OK)
        else:
            verdicts.append(rule(value, limits, max_new))
    grammars = [params.get(k) for k in ("regex", "json_schema", "ebnf")]
    if sum(g is not None for g in grammars) > 1:
        verdicts.append(BAD)  # SGLang: only one of regex, json_schema and ebnf
    return worst(*verdicts)


def _max_new(value: Any, limits: Limits, _: Any) -> str:
    return in_range(value, 0, limits.max_new_tokens_limit, integer=True)


def _min_new(value: Any, limits: Limits, max_new: Any) -> str:
    if not is_int(max_new):
        return worst(in_range(value, 0, math.inf, integer=True), EITHER)
    return in_range(value, 0, max_new, integer=True)


def _temperature(value: Any, *_: Any) -> str:
    verdict = in_range(value, 0, 2)  # OpenAI's range; SGLang sets no upper bound
    return EITHER if verdict == BAD and is_number(value) and value > 2 else verdict


def _top_p(value: Any, *_: Any) -> str:
    verdict = in_range(value, 1e-6, 1)  # (0, 1]; a tiny one may round to 0 on the way
    return EITHER if verdict == BAD and is_number(value) and 0 < value < 1e-6 else verdict


def _top_k(value: Any, *_: Any) -> str:
    if not is_int(value):
        return BAD
    if value == -1 or 1 <= value < 2**31:
        return OK
    return EITHER if value >= 2**31 else BAD


def _penalty(value: Any, *_: Any) -> str:
    return in_range(value, -2, 2)


def _repetition(value: Any, *_: Any) -> str:
    verdict = in_range(value, 0.01, 2)  # SGLang: (0, 2]
    return EITHER if verdict == BAD and is_number(value) and value > 0 else verdict


def _token_ids(value: Any, limits: Limits, _: Any) -> str:
    if not isinstance(value, list) or not all(is_int(t) for t in value):
        return BAD
    return OK if all(0 <= t < limits.vocab_size for t in value) else BAD


def _boolean(value: Any, *_: Any) -> str:
    return OK if isinstance(value, bool) else BAD


def _seed(value: Any, *_: Any) -> str:
    if not is_int(value):
        return BAD
    return OK if 0 <= value < 2**63 else EITHER


def _n(value: Any, *_: Any) -> str:
    if not is_int(value) or value < 1:
        return BAD
    return OK if value <= 2 else EITHER  # the ZeroMQ door runs one sample per request


def _open(value: Any, *_: Any) -> str:
    return EITHER


SAMPLING_RULES = {
    "max_new_tokens": _max_new,
    "min_new_tokens": _min_new,
    "temperature": _temperature,
    "top_p": _top_p,
    "top_k": _top_k,
    "min_p": lambda value, *_: in_range(value, 0, 1),
    "frequency_penalty": _penalty,
    "presence_penalty": _penalty,
    "repetition_penalty": _repetition,
    "stop": lambda value, *_: stop_verdict(value),
    "stop_token_ids": _token_ids,
    "ignore_eos": _boolean,
    "skip_special_tokens": _boolean,
    "regex": lambda value, *_: regex_verdict(value),
    "json_schema": lambda value, *_: schema_verdict(value),
    "ebnf": lambda value, *_: ebnf_verdict(value),
    "seed": _seed,
    "n": _n,
    # radixflow's and SGLang's others: typed by the spec, their values not settled by a doc
    "choices": _open,
    "structural_tag": _open,
    "stop_regex": _open,
    "logit_bias": _open,
}
SAMPLING_ALIASES = ("max_tokens", "sampling_seed")  # spellings some clients use
