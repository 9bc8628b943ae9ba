"""Tool calls and reasoning, without a model (runtime/server/tool_calls.py, reasoning.py): each
format parses what its models write; the grammar of a required call admits every valid call of
random tool schemas (nested objects, arrays, enums, bounded numbers, optional fields) and no
invalid one; reasoning splits from content, also while streaming."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import jsonschema
import pytest

from radixflow.runtime.constrained.triggered import parse_spec
from radixflow.runtime.server.reasoning import ReasoningParser
from radixflow.runtime.server.tool_calls import (
    Tool,
    ToolChoice,
    ToolError,
    get_format,
    infer_format,
    parse_tool_choice,
    parse_tools,
)


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A tool's parameters: an object of typed fields, some optional, some nested."""
    kinds = ["string", "integer", "number", "boolean", "enum", "array"]
    if depth < 2:
        kinds.append("object")
    properties, required = {}, []
    for i in range(rng.randint(1, 4)):
        kind = rng.choice(kinds)
        name = f"f{i}_{kind}"
        if kind == "string":
            prop = {"type": "string", "maxLength": 30}
        elif kind == "integer":
            lo = rng.randint(-50, 50)
            prop = {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 200)}
        elif kind == "number":
            prop = {"type": "number", "minimum": rng.randint(-5, 0), "maximum": rng.randint(1, 9)}
        elif kind == "enum":
            prop = {"type": "string", "enum": rng.sample(["red", "green", "blue", "cyan"], 2)}
        elif kind == "array":
            item = {"type": "integer", "minimum": 0, "maximum": 9}
            prop = {"type": "array", "items": item, "maxItems": 5}
        elif kind == "object":
            prop = random_schema(rng, depth + 1)
        else:
            prop = {"type": kind}
        properties[name] = prop
        if rng.random() < 0.6:
            required.append(name)
    return {"type": "object", "properties": properties, "required": required}


def random_instance(schema: dict[str, Any], rng: random.Random) -> Any:
    kind = schema.get("type")
    if "enum" in schema:
        return rng.choice(schema["enum"])
    if kind == "object":
        props = schema["properties"]
        return {
            k: random_instance(v, rng)
            for k, v in props.items()
            if k in schema.get("required", []) or rng.random() < 0.5
        }
    if kind == "integer":
        return rng.randint(schema["minimum"], schema["maximum"])
    if kind == "number":
        return round(rng.uniform(schema["minimum"], schema["maximum"] - 0.01), 2)
    if kind == "array":
        return [random_instance(schema["items"], rng) for _ in range(rng.randint(0, 3))]
    if kind == "boolean":
        return rng.random() < 0.5
    return rng.choice(["Paris", "a b", 'say "hi"', ""])


def random_tools(rng: random.Random, n: int) -> list[Tool]:
    return [Tool(f"tool_{i}", f"does thing {i}", random_schema(rng)) for i in range(n)]


def test_random_schemas_required_call_grammars_admit_valid_calls_only() -> None:
    rng = random.Random(0)
    for _ in range(40):
        tools = random_tools(rng, rng.randint(1, 3))
        hermes = re.compile(get_format("hermes").grammar(tools, parallel=True)["regex"])
        generic = re.compile(get_format("generic").grammar(tools, parallel=False)["regex"])
        for _ in range(5):
            tool = rng.choice(tools)
            args = random_instance(tool.parameters, rng)
            jsonschema.validate(args, tool.parameters)  # the generator's own check
            call = json.dumps({"name": tool.name, "arguments": args})
            assert hermes.fullmatch(f"<tool_call>\n{call}\n</tool_call>"), call
            assert generic.fullmatch(json.dumps({"tool_calls": [json.loads(call)]})), call
        bad = {"name": "not_a_tool", "arguments": {}}
        assert not hermes.fullmatch(f"<tool_call>\n{json.dumps(bad)}\n</tool_call>")


def test_bounds_enums_and_required_fields_are_in_the_grammar() -> None:
    params = {
        "type": "object",
        "properties": {
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "unit": {"type": "string", "enum": ["c", "f"]},
            "scale": {"type": "number", "exclusiveMinimum": 0, "maximum": 2},
        },
        "required": ["days", "unit"],
    }
    regex = re.compile(get_format("llama3").grammar([Tool("w", "", params)], False)["regex"])

    def ok(args: dict[str, Any]) -> bool:
        return bool(regex.fullmatch(json.dumps({"name": "w", "parameters": args})))

    assert ok({"days": 7, "unit": "c"}) and ok({"days": 1, "unit": "f", "scale": 1.5})
    assert not ok({"days": 8, "unit": "c"}) and not ok({"days": 0, "unit": "c"})
    assert not ok({"days": 3, "unit": "k"}) and not ok({"unit": "c"})
    assert not ok({"days": 3, "unit": "c", "scale": 2.5}) and not ok(
        {"days": 3, "unit": "c", "scale": 0}
    )  # noqa: E501


def test_each_format_parses_its_calls() -> None:
    hermes = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    content, calls = get_format("qwen25").parse("Let me check.\n" + hermes + "\n" + hermes)
    assert content == "Let me check." and [c.name for c in calls] == ["f", "f"]
    assert json.loads(calls[0].arguments) == {"a": 1} and calls[0].id != calls[1].id
    _, calls = get_format("llama3").parse('{"name": "g", "parameters": {"x": "y"}}')
    assert calls[0].name == "g" and json.loads(calls[0].arguments) == {"x": "y"}
    content, calls = get_format("mistral").parse('[TOOL_CALLS] [{"name": "h", "arguments": {}}]')
    assert content == "" and calls[0].name == "h"
    _, calls = get_format("pythonic").parse('[get_weather(city="Paris", days=2), noop()]')
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris", "days": 2}, {}]
    assert get_format("generic").parse('{"content": "hello"}') == ("hello", [])
    cut = '{"tool_calls": [{"name": "f", "arguments": {}}, {"name": "f", "arguments": {"a'
    assert [c.name for c in get_format("generic").parse(cut)[1]] == ["f"]  # max_tokens cut
    _, calls = get_format("generic").parse('{"tool_calls": [{"name": "f", "arguments": {}}]}')
    assert calls[0].name == "f"
    cut = '{"name": "g", "parameters": {}}; {"name": "g", "param'
    assert [c.name for c in get_format("llama3").parse(cut)[1]] == ["g"]  # max_tokens cut
    assert get_format("llama3").parse('{"name": "g", "param')[1] == []
    for name in ("hermes", "llama3", "mistral", "pythonic", "generic"):  # plain text stays
        assert get_format(name).parse("The answer is 4.") == ("The answer is 4.", [])


def test_streaming_holds_back_a_call_that_may_be_starting() -> None:
    hermes = get_format("hermes")
    assert hermes.holdback("Sure. <tool") == len("Sure. ")
    assert hermes.holdback("Sure. <tool_call>\n{") == len("Sure. ")
    assert hermes.holdback("Sure.") == len("Sure.")
    assert get_format("generic").holdback('{"content": "x"}') == 0


def test_tools_and_tool_choice_are_checked() -> None:
    tools = parse_tools([{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert parse_tool_choice(None, tools) == ToolChoice("auto")
    assert parse_tool_choice(None, []) == ToolChoice("none")
    named = {"type": "function", "function": {"name": "f"}}
    assert parse_tool_choice(named, tools) == ToolChoice("required", "f")
    for bad in ([{"type": "function"}], [{"function": {"name": "bad name"}}], "f"):
        with pytest.raises(ToolError):
            parse_tools(bad)
    with pytest.raises(ToolError, match="not one of the tools"):
        parse_tool_choice({"type": "function", "function": {"name": "g"}}, tools)
    with pytest.raises(ToolError):
        parse_tool_choice("required", [])
    assert parse_tool_choice("auto", []) == ToolChoice("none")  # a client's default


def test_format_inferred_from_the_template() -> None:
    assert infer_format("{% for m in messages %}{{ m.content }}{% endfor %}") == "generic"
    assert infer_format("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert infer_format("{% if tools %}[TOOL_CALLS]{% endif %}") == "mistral"
    assert infer_format("{% if tools %}<|python_tag|>{% endif %}") == "llama3"


def test_reasoning_split_finished_and_streaming() -> None:
    qwen3 = ReasoningParser("qwen3")
    assert qwen3.split("<think>\nplan\n</think>\n\nAnswer") == ("plan", "Answer")
    assert qwen3.split("Answer only") == ("", "Answer only")
    assert qwen3.split("<think>\nplan", thinking=True) == ("plan", "")
    assert qwen3.split("<think>x</think>y", thinking=False) == ("", "<think>x</think>y")
    r1 = ReasoningParser("deepseek-r1")
    assert r1.split("plan</think>Answer") == ("plan", "Answer")
    assert qwen3.visible("<thi") == ("", "") and qwen3.visible("<think>a</thi") == ("a", "")
    assert qwen3.visible("<think>\na\n</") == ("a", "")  # the newline may precede the tag
    with pytest.raises(ValueError):
        ReasoningParser("nope")


def test_auto_triggers_are_structural_tags_the_grammar_layer_takes() -> None:
    """tool_choice auto's tag per format: free text until the start tag, then the call."""
    tools = [Tool("w", "", {"type": "object", "properties": {"n": {"type": "integer"}}})]
    for name, trigger in (("hermes", "<tool_call>"), ("llama3", "{"), ("mistral", "[TOOL_CALLS]")):
        tag = get_format(name).trigger(tools, parallel=True)
        ((fired, (kind, regex)),) = parse_spec(json.dumps(tag)).triggers
        assert fired == trigger and kind == "regex", tag
        rest = {"hermes": '\n{"name": "w", "arguments": {"n": 1}}\n</tool_call>',
                "llama3": '"name": "w", "parameters": {"n": 1}}; {"name": "w", "parameters": {}}',
                "mistral": ' [{"name": "w", "arguments": {}}]'}[name]  # fmt: skip
        assert re.fullmatch(regex, rest), (name, regex)
    for name in ("pythonic", "generic"):
        assert get_format(name).trigger(tools, parallel=True) is None
