"""Constrained decoding through Engine.generate on the real model: every output is valid."""

from __future__ import annotations

import json
import re

import pytest

from conftest import chat

STR = {"type": "string", "maxLength": 10}
INT = {"type": "integer", "maxDigits": 4}  # bounded, so sampled outputs finish
REGEXES = [
    r"[0-9]{1,4}",
    r"-?[0-9]{1,3}\.[0-9]{1,2}",
    r"\d{4}-\d{2}-\d{2}",
    r"(25[0-5]|2[0-4]\d|1?\d?\d)(\.(25[0-5]|2[0-4]\d|1?\d?\d)){3}",
    r"(yes|no|maybe)",
    r"(red|green|blue), (red|green|blue)",
    r'"[a-z ]{1,12}"',
    r"[A-Z][a-z]{1,8} [A-Z][a-z]{1,8}",
    r"\(\d{3}\) \d{3}-\d{4}",
    r"[a-z]{2,8}@[a-z]{2,8}\.(com|org)",
    r"(True|False)",
    r"#[0-9a-f]{6}",
    r"[01]{8}",
    r"(Mon|Tue|Wed|Thu|Fri|Sat|Sun)day?",
    r"v[0-9]\.[0-9]{1,2}\.[0-9]{1,2}",
]
SCHEMAS = [
    {"type": "object", "properties": {"name": STR, "age": INT}, "required": ["name", "age"]},
    {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}},
        "required": ["city"],
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": INT},
        "required": ["ok", "n"],
    },
    {"type": "array", "items": INT, "minItems": 1, "maxItems": 4},
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": INT, "name": STR},
                "required": ["id", "name"],
            }
        },
        "required": ["user"],
    },
    {"type": "object", "properties": {"x": INT, "y": INT}, "required": ["x", "y"]},
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green"]}, "count": INT},
        "required": ["color", "count"],
    },
    {
        "type": "object",
        "properties": {"title": STR, "year": INT, "genre": {"enum": ["drama", "comedy"]}},
        "required": ["title", "year", "genre"],
    },
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {"type": "object", "properties": {"c": INT}, "required": ["c"]}
                },
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {"sku": STR, "qty": INT},
                    "required": ["sku", "qty"],
                },
            }
        },
        "required": ["items"],
    },
    {
        "type": "object",
        "properties": {"status": {"enum": ["active", "inactive"]}, "score": INT, "note": STR},
        "required": ["status", "score"],
    },
    {
        "type": "object",
        "properties": {"lat": INT, "lon": INT, "label": STR},
        "required": ["lat", "lon", "label"],
    },
    {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]},
    {
        "type": "object",
        "properties": {
            "first": STR,
            "last": STR,
            "langs": {"type": "array", "items": STR, "maxItems": 2},
        },
        "required": ["first", "last", "langs"],
    },
]


def validate(value, schema) -> None:
    """A small JSON-schema check covering what SCHEMAS use."""
    if "enum" in schema:
        assert value in schema["enum"], (value, schema)
        return
    kind = schema["type"]
    if kind == "object":
        assert isinstance(value, dict)
        for key in schema.get("required", []):
            assert key in value, (key, value)
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                validate(value[key], sub)
    elif kind == "array":
        assert isinstance(value, list)
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 10**9)
        for item in value:
            validate(item, schema["items"])
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", 10**9)
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
    elif kind == "number":
        assert isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind == "boolean":
        assert isinstance(value, bool)


def requests(extra: dict) -> tuple[list[str], list[dict]]:
    prompts, params = [], []
    for regex in REGEXES:
        prompts.append(chat(f"Give an example matching {regex}"))
        params.append({"max_new_tokens": 48, "regex": regex, **extra})
    for schema in SCHEMAS:
        prompts.append(chat("Reply with a JSON object describing something."))
        params.append({"max_new_tokens": 96, "json_schema": json.dumps(schema), **extra})
    return prompts, params


def check_all(outputs: list[dict]) -> None:
    for regex, out in zip(REGEXES, outputs):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert re.fullmatch(regex, out["text"]), (regex, out["text"])
    for schema, out in zip(SCHEMAS, outputs[len(REGEXES) :]):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        validate(json.loads(out["text"]), schema)


@pytest.mark.parametrize(
    "extra", [{"temperature": 0}, {"temperature": 1.0, "seed": 11}], ids=["greedy", "sampled"]
)
def test_thirty_grammars_always_valid(engine, extra):
    prompts, params = requests(extra)
    assert len(prompts) >= 30
    check_all(engine.generate(prompts, params))
    engine.check_idle()


def test_invalid_grammars_error_while_others_proceed(engine):
    prompt = chat("Count to five.")
    plain = {"max_new_tokens": 12, "temperature": 0}
    outs = engine.generate(
        [prompt, prompt, prompt],
        [{**plain, "regex": "(ab"}, {**plain, "json_schema": '{"type": "nope"'}, plain],
    )
    assert "invalid regex" in outs[0]["error"]
    assert outs[0]["meta_info"]["finish_reason"]["type"] == "error"
    assert "schema" in outs[1]["error"].lower() or "json" in outs[1]["error"].lower()
    assert outs[2].get("error") is None
    assert outs[2]["output_ids"] == engine.generate(prompt, plain)["output_ids"]
    engine.check_idle()


def test_constrained_neighbour_leaves_others_unchanged(engine):
    prompts = [chat("Tell me about cats."), chat("Tell me about dogs."), chat("A number?")]
    plain = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    alone = [engine.generate(p, plain)["output_ids"] for p in prompts[:2]]
    mixed = engine.generate(
        prompts, [plain, plain, {"max_new_tokens": 16, "temperature": 0, "regex": r"[0-9]{1,3}"}]
    )
    assert [o["output_ids"] for o in mixed[:2]] == alone
    assert re.fullmatch(r"[0-9]{1,3}", mixed[2]["text"])


def test_choices_and_length_cutoff(engine):
    prompt = chat("Is the sky blue?")
    out = engine.generate(prompt, {"max_new_tokens": 8, "temperature": 0, "choices": ["yes", "no"]})
    assert out["text"] in ("yes", "no")
    cut = engine.generate(prompt, {"max_new_tokens": 3, "temperature": 0, "regex": r"[a-z]{20}"})
    # max_new_tokens mid-grammar finishes with reason length (documented behaviour)
    assert cut["meta_info"]["finish_reason"]["type"] == "length"
    assert re.fullmatch(r"[a-z]*", cut["text"])


def test_grammar_survives_preemption(engine, make_engine):
    """Long forced outputs in a tiny pool: requests are preempted and recomputed mid-grammar;
    the guide state survives and the outputs equal an unpressured run."""
    prompts = [chat(f"Write a long number, number {i}.") for i in range(3)]
    params = {"max_new_tokens": 40, "temperature": 0, "regex": r"[0-9]{32}"}
    eng = make_engine(max_total_tokens=110, schedule_conservativeness=0.02)
    outs = eng.generate(prompts, params)
    assert eng.stats()["preemptions"] > 0
    expected = engine.generate(prompts, params)
    for out, ref in zip(outs, expected):
        assert re.fullmatch(r"[0-9]{32}", out["text"]), out["text"]
        assert out["output_ids"] == ref["output_ids"]
    eng.check_idle()
