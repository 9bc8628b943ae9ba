"""Fuzzed bodies for the three generating HTTP routes, each with the statuses the documents give
it (fuzz_schema's verdicts: OK 200, BAD 400, an unknown model 404, a body past
--max-message-bytes 413), decided here from docs/http.md and SGLang's and OpenAI's fields.

A case is a valid body with a few mutations from a seeded RNG: wrong types, missing fields,
numbers out of range, huge or negative token counts, bad grammars, unknown fields with nested
junk (ignored, never refused), malformed JSON, other content types (the docs' own curl sends
form-encoded JSON: the server reads the body as JSON whatever the type). Valid ones ask for at
most two tokens, so a thousand cases run in seconds.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from fuzz_schema import (
    BAD,
    EITHER,
    OK,
    SAMPLING_RULES,
    Limits,
    in_range,
    is_int,
    sampling_verdict,
    worst,
)

GENERATE, COMPLETIONS, CHAT = "/generate", "/v1/completions", "/v1/chat/completions"
NOT_FOUND = "not_found"  # an unknown model: 404 (OpenAI's model_not_found)
CONTENT_TYPES = [
    "application/json",
    "application/json; charset=utf-8",
    "application/x-www-form-urlencoded",  # curl -d's
    "text/plain",
    None,
]


@dataclass(frozen=True)
class Case:
    path: str
    content: bytes
    content_type: str | None
    statuses: frozenset[int]  # what the documents allow
    body: Any  # the JSON value sent, or None when the bytes are not JSON


# ---- the verdicts -------------------------------------------------------------------------


def statuses(verdict: str, model: str = OK) -> frozenset[int]:
    if model == BAD:
        verdict = BAD
    out = {OK: {200}, BAD: {400}, EITHER: {200, 400}}[verdict]
    if model == NOT_FOUND:
        out = {404} | (out - {200})  # a wrong model and another error: either may be named
    return frozenset(out)


def prompt_ids_verdict(value: Any, limits: Limits) -> tuple[str, int]:
    """(verdict, prompt count) of input_ids: one list of ids or a batch of them."""
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        return worst(*(prompt_ids_verdict(v, limits)[0] for v in value)), len(value)
    if not isinstance(value, list) or not value or not all(is_int(t) for t in value):
        return BAD, 1
    return (OK if all(0 <= t < limits.vocab_size for t in value) else BAD), 1


def text_verdict(value: Any, limits: Limits) -> tuple[str, int]:
    """A text prompt or a batch of them; a prompt of more words than the context cannot fit."""
    if isinstance(value, list):
        if not value or not all(isinstance(t, str) for t in value):
            return BAD, 1
        return worst(*(text_verdict(t, limits)[0] for t in value)), len(value)
    if not isinstance(value, str) or not value:
        return BAD, 1
    return (BAD if len(value.split()) > limits.context_length else OK), 1


def generate_verdict(body: Any, limits: Limits) -> str:
    """SGLang's /generate (docs/http.md's field list; unknown fields are ignored)."""
    if not isinstance(body, dict):
        return BAD
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        return BAD
    verdict, count = text_verdict(text, limits) if ids is None else prompt_ids_verdict(ids, limits)
    params = body.get("sampling_params")
    if isinstance(params, list):
        ok = len(params) == count and all(isinstance(p, dict) for p in params)
        verdicts = [sampling_verdict(p, limits, False) for p in params] if ok else [BAD]
    elif params is None or isinstance(params, dict):
        verdicts = [sampling_verdict(params or {}, limits, False)]
    else:
        verdicts = [BAD]
    for name in ("stream", "return_logprob", "return_text_in_logprobs"):
        verdicts.append(optional_bool(body.get(name)))
    start = body.get("logprob_start_len")
    if start is not None:
        verdicts.append(logprob_start_verdict(start, limits))
    top = body.get("top_logprobs_num")
    if top is not None:
        verdicts.append(top_logprobs_verdict(top, limits))
    rid = body.get("rid")
    if rid is not None:
        verdicts.append(rid_verdict(rid))
    return worst(verdict, *verdicts)


def rid_verdict(rid: Any) -> str:
    if isinstance(rid, str):
        return OK if rid else EITHER
    return EITHER if isinstance(rid, list) else BAD  # SGLang's batches name one rid a prompt


def optional_bool(value: Any) -> str:
    return OK if value is None or isinstance(value, bool) else BAD


def logprob_start_verdict(value: Any, limits: Limits) -> str:
    if not is_int(value) or value < -1 or value >= limits.context_length:
        return BAD
    return OK if value <= 0 else EITHER  # past the prompt's end is refused


def top_logprobs_verdict(value: Any, limits: Limits) -> str:
    if not is_int(value) or value < 0 or value >= limits.vocab_size:
        return BAD
    return OK if value <= 20 else EITHER  # OpenAI's cap is 20; SGLang sets none


def openai_common_verdict(body: dict[str, Any], limits: Limits, max_keys: tuple[str, ...]) -> str:
    """The fields both /v1 routes share: OpenAI's, and SGLang's additions (same rules as
    sampling_params); an unknown name is ignored."""
    verdicts = []
    for key in max_keys:
        value = body.get(key)
        if value is not None:
            verdicts.append(in_range(value, 0, limits.max_new_tokens_limit, integer=True))
            if value == 0:
                verdicts.append(EITHER)  # OpenAI asks for at least 1
    max_new = next((body[k] for k in max_keys if body.get(k) is not None), 16)
    params = {"max_new_tokens": max_new}
    for name in SHARED_SAMPLING:
        if body.get(name) is not None:
            params[name] = body[name]
    if body.get("min_tokens") is not None:
        params["min_new_tokens"] = body["min_tokens"]
    verdicts.append(sampling_verdict(params, limits, False))
    n = body.get("n")
    if n is not None:
        verdicts.append(SAMPLING_RULES["n"](n))
    verdicts.append(optional_bool(body.get("stream")))
    verdicts.append(stream_options_verdict(body.get("stream_options"), body.get("stream")))
    return worst(*verdicts)


SHARED_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop_token_ids",
    "ignore_eos",
    "regex",
    "json_schema",
    "ebnf",
)


def stream_options_verdict(value: Any, stream: Any) -> str:
    if value is None:
        return OK
    if not isinstance(value, dict) or not isinstance(value.get("include_usage", False), bool):
        return BAD
    return OK if stream is True else EITHER  # OpenAI: only with stream


def model_verdict(body: dict[str, Any], served: tuple[str, ...]) -> str:
    model = body.get("model")
    if model is None or model in served:
        return OK
    return NOT_FOUND if isinstance(model, str) else BAD


def completions_verdict(body: Any, limits: Limits) -> str:
    if not isinstance(body, dict):
        return BAD
    prompt = body.get("prompt")
    ids = isinstance(prompt, list) and all(is_int(t) or isinstance(t, list) for t in prompt)
    if ids and prompt:
        verdict = prompt_ids_verdict(prompt, limits)[0]
    elif prompt == "":
        verdict = EITHER  # OpenAI starts from its end-of-text token; a prompt needs a token here
    else:
        verdict = text_verdict(prompt, limits)[0]
    logprobs = body.get("logprobs")
    logprobs_verdict = OK if logprobs is None else in_range(logprobs, 0, 5, integer=True)
    if logprobs is False:
        logprobs_verdict = EITHER  # chat's boolean default, sent by some clients
    constraints = [body.get(k) for k in ("regex", "json_schema", "ebnf")]
    return worst(
        verdict,
        logprobs_verdict,
        openai_common_verdict(body, limits, ("max_tokens",)),
        BAD if sum(c is not None for c in constraints) > 1 else OK,
    )


ROLES = ("system", "user", "assistant")


def message_verdict(message: Any) -> str:
    if not isinstance(message, dict) or message.get("role") not in ROLES + ("developer", "tool"):
        return BAD
    if message["role"] in ("developer", "tool"):
        return EITHER
    content = message.get("content")
    if isinstance(content, str):
        return OK
    if isinstance(content, list) and content:
        parts_ok = all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        )
        return OK if parts_ok else BAD
    if content is None and message["role"] == "assistant":
        return EITHER  # OpenAI allows it beside tool_calls
    return BAD


FORMATS = ("text", "json_object", "json_schema")


def response_format_verdict(value: Any) -> tuple[str, bool]:
    """(verdict, whether it constrains the output)."""
    if value is None:
        return OK, False
    if not isinstance(value, dict) or value.get("type") not in FORMATS:
        return BAD, False
    if value["type"] != "json_schema":
        return OK, value["type"] == "json_object"
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        return BAD, True
    return (OK if isinstance(spec.get("name"), str) else EITHER), True


def chat_verdict(body: Any, limits: Limits) -> str:
    if not isinstance(body, dict):
        return BAD
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        verdict = BAD
    else:
        verdict = worst(*(message_verdict(m) for m in messages))
        last = messages[-1]
        if verdict == OK and isinstance(last, dict) and last.get("role") != "user":
            verdict = EITHER  # a prompt that ends on a system or assistant turn
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    verdicts = [verdict, optional_bool(logprobs)]
    if top is not None:
        verdicts.append(in_range(top, 0, 20, integer=True) if logprobs is True else BAD)
    format_verdict, constrains = response_format_verdict(body.get("response_format"))
    constraints = [body.get(k) for k in ("regex", "json_schema", "ebnf")]
    if sum(c is not None for c in constraints) + constrains > 1:
        verdicts.append(BAD)
    verdicts.append(format_verdict)
    verdicts.append(openai_common_verdict(body, limits, ("max_tokens", "max_completion_tokens")))
    return worst(*verdicts)


def expected_statuses(
    path: str, body: Any, limits: Limits, served: tuple[str, ...]
) -> frozenset[int]:
    if path == GENERATE:
        return statuses(generate_verdict(body, limits))
    judge = completions_verdict if path == COMPLETIONS else chat_verdict
    verdict = judge(body, limits)
    return statuses(verdict, model_verdict(body, served) if isinstance(body, dict) else OK)


# ---- the bodies -----------------------------------------------------------------------------

# Values for each field, valid and not, drawn at random (the verdicts above judge each).
TOKENS = [1, 2, 2, 0, -1, -5, 10**9, 2**63, "2", 1.5, True, [2]]
NUMBERS = [0, 0.5, 1, 1.5, -1, -0.01, 3, "1", True, [1], {}]
POOLS: dict[str, list[Any]] = {
    "temperature": [0, 0.7, 1, 2, -1, -0.5, "hot", True, [1]],
    "top_p": [0.5, 0.9, 1, 0, -0.1, 1.5, "x"],
    "top_k": [-1, 1, 5, 0, -2, 1.5, "5"],
    "min_p": [0, 0.1, -0.1, 1.5, "x"],
    "frequency_penalty": [0, 1.5, -1, 3, -2.5, "x"],
    "presence_penalty": [0, 1, 3, -3, "x"],
    "repetition_penalty": [1.0, 1.2, 0, -1, "x"],
    "stop": ["\n", ["a", "b"], [], None, 5, [1, 2], [None]],
    "stop_token_ids": [[], [2], "2", [-1], [10**9], ["a"]],
    "ignore_eos": [True, False, "yes", 1],
    "skip_special_tokens": [True, False, "no", 0],
    "regex": ["[0-9]+", "yes|no", None, "(", "[a-", 7],
    "json_schema": ['{"type": "string"}', '{"type": "integer"}', "{oops", "[1,", 7],
    "ebnf": ['root ::= "yes" | "no"', "root ::= (", 7],
    "seed": [0, 42, "1", 1.5, True],
    "n": [1, 2, 0, -1, "2", 1.5, True],
    "min_new_tokens": [0, 1, 5, -1, "1", 1.5],
    "stream": [True, False, None, "yes", 1],
}
GENERATE_POOLS: dict[str, list[Any]] = {
    "text": ["Hi", "The sky is", ["Hi", "Yo"], "", [], [""], 5, None, [1, 2], {"a": 1}],
    "input_ids": [[1, 2, 3], [[1, 2], [3]], [], ["a"], [-1], [10**9], [[]], "1 2", 7],
    "sampling_params": [3, "x", [], [{"max_new_tokens": 1}]],  # None: 128 tokens, too slow
    "return_logprob": [True, False, "yes", 1],
    "logprob_start_len": [-1, 0, 10**6, -2, "0", 1.5],
    "top_logprobs_num": [0, 1, 2, -1, 10**9, "2", 1.5],
    "rid": ["<rid>", 7, ["a"]],
    "return_text_in_logprobs": [True, False, "x"],
    "stream": POOLS["stream"],
}
OPENAI_POOLS: dict[str, list[Any]] = {
    "model": [None, "<served>", "gpt-9", 5, ["smollm2"]],
    "max_tokens": TOKENS,
    "n": POOLS["n"],
    "stream_options": [None, {"include_usage": True}, {"include_usage": "yes"}, "usage", 3],
    **{name: POOLS[name] for name in SHARED_SAMPLING},
    "min_tokens": POOLS["min_new_tokens"],
    "stream": POOLS["stream"],
}
COMPLETION_POOLS: dict[str, list[Any]] = {
    **OPENAI_POOLS,
    "prompt": ["Hi", ["Hi", "Yo"], [1, 2, 3], [[1, 2], [3]], 5, [], [None], {"a": 1}, [-1]],
    "logprobs": [None, 0, 2, 10, -1, "2", 1.5, True],
}
USER = {"role": "user", "content": "Hi"}
CHAT_POOLS: dict[str, list[Any]] = {
    **OPENAI_POOLS,
    "max_completion_tokens": TOKENS,
    "messages": [
        [USER],
        [{"role": "system", "content": "Be brief."}, USER],
        [USER, {"role": "assistant", "content": "Hello"}, USER],
        [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        [],
        "Hi",
        [5],
        [{"role": "wizard", "content": "x"}],
        [{"role": "user", "content": 5}],
        [{"role": "user"}],
        [{"content": "Hi"}],
        [{"role": "user", "content": [{"type": "image", "text": "x"}]}],
    ],
    "logprobs": [None, True, False, "yes", 1],
    "top_logprobs": [None, 0, 2, 21, -1, "2"],
    "response_format": [
        None,
        {"type": "text"},
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}},
        {"type": "yaml"},
        "json",
        {"type": "json_schema", "json_schema": {"name": "p", "schema": 3}},
        {"type": "json_schema"},
    ],
}
SAMPLING_POOLS = {**POOLS, "max_new_tokens": TOKENS}


def junk(rng: random.Random, depth: int = 0) -> Any:
    """A random JSON value, nested a few levels."""
    kind = rng.randrange(7 if depth < 6 else 4)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False, 0, -1, 10**30, 1e300, 3.5])
    if kind in (2, 3):
        return rng.choice(["", "x", "\u00e9\U0001f600", "{", "\x00"])
    if kind in (4, 5):
        return [junk(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {f"k{i}": junk(rng, depth + 1) for i in range(rng.randrange(3))}


def base_body(rng: random.Random, path: str) -> dict[str, Any]:
    """A valid body asking for at most two tokens."""
    if path == GENERATE:
        body: dict[str, Any] = {"text": rng.choice(["Hi", "The sky is", "1, 2,"])}
        body["sampling_params"] = {"max_new_tokens": rng.choice([0, 1, 1, 2]), "temperature": 0}
        return body
    if path == COMPLETIONS:
        return {"model": "<served>", "prompt": "Hi", "max_tokens": rng.choice([1, 1, 2])}
    return {"model": "<served>", "messages": [USER], "max_tokens": rng.choice([1, 1, 2])}


def mutate(rng: random.Random, path: str, body: dict[str, Any]) -> None:
    """One random change to a field, a sampling parameter or an unknown field."""
    pools = {GENERATE: GENERATE_POOLS, COMPLETIONS: COMPLETION_POOLS, CHAT: CHAT_POOLS}[path]
    roll = rng.random()
    if roll < 0.15:  # unknown fields are ignored, whatever they hold
        body[f"x_{rng.choice(['junk', 'extra', 'tools_v2', 'Model'])}"] = junk(rng)
    elif roll < 0.5 and path == GENERATE:
        params = body.get("sampling_params")
        if isinstance(params, dict):
            name = rng.choice(list(SAMPLING_POOLS) + ["x_unknown"])
            params[name] = rng.choice(SAMPLING_POOLS.get(name, [junk(rng)]))
    else:
        name = rng.choice(list(pools))
        value = rng.choice(pools[name] + ["<delete>"])
        if value == "<delete>":
            if name in ("max_tokens", "sampling_params"):
                return  # the defaults generate 16 or 128 tokens: too slow for the fuzz
            body.pop(name, None)
        else:
            body[name] = value


def fill(value: Any, served: str, rng: random.Random) -> Any:
    """Placeholders: the served model's name, a fresh rid."""
    if value == "<served>":
        return served
    if value == "<rid>":
        return f"fuzz-{rng.getrandbits(64):x}"
    if isinstance(value, dict):
        return {k: fill(v, served, rng) for k, v in value.items()}
    return value


def fuzz_case(rng: random.Random, limits: Limits, served: str, max_bytes: int) -> Case:
    path = rng.choice([GENERATE, COMPLETIONS, CHAT])
    content_type = rng.choice(CONTENT_TYPES)
    roll = rng.random()
    if roll < 0.04:  # not JSON: garbage, a cut body, invalid UTF-8
        raw = rng.choice([b"{not json", b'{"text": "Hi"', b"\xff\xfe\x00", b"", b"[1,]"])
        return Case(path, raw, content_type, frozenset({400}), None)
    if roll < 0.075:  # JSON nested past any parser's recursion, in an unknown field
        prefix = json.dumps(base_body(rng, path))[:-1].replace('"<served>"', json.dumps(served))
        raw = prefix.encode() + b', "x_deep": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        return Case(path, raw, content_type, frozenset({200, 400}), None)
    if roll < 0.1:  # JSON, but not an object
        body: Any = rng.choice([[1, 2], "text", 5, None, [{"text": "Hi"}]])
    else:
        body = base_body(rng, path)
        for _ in range(rng.choice([0, 1, 2, 3, 3, 4, 4])):  # mostly refused: fast
            mutate(rng, path, body)
        body = fill(body, served, rng)
    content = json.dumps(body).encode()
    if roll > 0.99:  # past --max-message-bytes, valid or not
        body = {**body, "x_pad": "x" * max_bytes} if isinstance(body, dict) else body
        content = json.dumps(body).encode() + b" " * max_bytes
        return Case(path, content, content_type, frozenset({413}), body)
    expected = expected_statuses(path, body, limits, (served,))
    return Case(path, content, content_type, expected, body)
