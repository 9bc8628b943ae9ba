"""Jump-forward on the real model (Engine.generate, SmolLM2): outputs under schemas with many
fixed keys, regexes with literal runs and a tool call stay valid, take fewer forward steps
than sampling every token, and (llguidance, greedy) give the same text as with jump-forward
off; logprobs stay aligned with the output ids; preemption and streaming see ordinary tokens.

What "the same text" rests on: a jump appends the grammar's forced text tokenized as the
tokenizer writes it (with the sampled token before it), so where the model's own greedy
choices under the mask were that tokenization the model sees the same tokens and decodes the
same text. That holds for these prompts with llguidance, whose masks already steer towards
canonical tokens; with outlines-core (any tokenization of forced text is allowed) the model
may pick a split that jump-forward replaces, and later choices may then differ, so there only
validity and the step count are asserted.
"""

from __future__ import annotations

import json
import math
import re

import pytest
from jsonschema import validate

from conftest import chat
from radixflow.runtime.server.tool_calls import Hermes, Tool

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "temperature_unit": {"enum": ["celsius", "fahrenheit"]},
        "city_of_residence": {"type": "string", "maxLength": 12},
        "favourite_programming_language": {"enum": ["python", "rust", "haskell"]},
        "age": {"type": "integer", "maximum": 120, "minimum": 0},
    },
    "required": [
        "name",
        "temperature_unit",
        "city_of_residence",
        "favourite_programming_language",
        "age",
    ],
}
LITERAL = r'\{"name": "[a-z]{1,10}", "age": [0-9]{1,2}, "occupation": "[a-z ]{1,12}"\}'
WEATHER = Tool(
    "get_current_weather",
    "Current weather of a city",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": PERSON["properties"]["temperature_unit"],
        },
        "required": ["city", "unit"],
    },
)
TOOL_REGEX = Hermes().grammar([WEATHER], parallel=False)["regex"]


def batch() -> tuple[list[str], list[dict]]:
    base = {"max_new_tokens": 90, "temperature": 0}
    prompts = [
        chat("Describe a person as JSON."),
        chat("Describe a person as JSON."),
        chat("What is the weather in Paris? Call the tool."),
    ]
    params = [
        {**base, "json_schema": json.dumps(PERSON)},
        {**base, "regex": LITERAL},
        {**base, "regex": TOOL_REGEX},
    ]
    return prompts, params


def check(outputs: list[dict]) -> None:
    person, literal, call = outputs
    for out in outputs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    validate(json.loads(person["text"]), PERSON)
    assert re.fullmatch(LITERAL, literal["text"]), literal["text"]
    assert re.fullmatch(TOOL_REGEX, call["text"]), call["text"]
    body = call["text"].removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")
    assert json.loads(body)["name"] == WEATHER.name
    validate(json.loads(body)["arguments"], WEATHER.parameters)


def steps(engine, prompts: list[str], params: list[dict], **options) -> tuple[list[dict], int]:
    before = engine.stats()["forward_steps"]
    outputs = engine.generate(prompts, params, **options)
    return outputs, engine.stats()["forward_steps"] - before


def test_jumps_keep_outputs_valid_and_equal_in_fewer_steps(engine, make_engine) -> None:
    prompts, params = batch()
    jumped_before = engine.stats()["jump_forward_tokens"]
    on, on_steps = steps(engine, prompts, params)
    off_engine = make_engine(disable_jump_forward=True)
    off, off_steps = steps(off_engine, prompts, params)
    check(on)
    check(off)
    assert [o["text"] for o in on] == [o["text"] for o in off]
    for out in on:
        assert out["meta_info"]["jump_forward_tokens"] > 0
    assert all(o["meta_info"]["jump_forward_tokens"] == 0 for o in off)
    jumped = sum(o["meta_info"]["jump_forward_tokens"] for o in on)
    assert engine.stats()["jump_forward_tokens"] - jumped_before == jumped
    # each request samples only where the grammar leaves a choice: the longest of the three
    # (in sampled tokens) sets the batch's steps
    assert on_steps < off_steps
    assert (
        on_steps
        <= max(len(o["output_ids"]) - o["meta_info"]["jump_forward_tokens"] for o in on) + 1
    )
    for eng in (engine, off_engine):
        eng.check_idle()
        assert eng.flush_cache()
        stats = eng.stats()
        assert stats["free_slots"] == stats["total_slots"], "KV slots leaked"


def test_jumped_tokens_have_logprobs_and_stream(engine) -> None:
    prompts, params = batch()
    plain = engine.generate(prompts[1], params[1])
    scored = engine.generate(prompts[1], params[1], return_logprob=True, top_logprobs_num=2)
    assert scored["meta_info"]["jump_forward_tokens"] > 0
    logprobs = scored["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in logprobs] == scored["output_ids"]
    assert all(math.isfinite(lp) and lp <= 0 for lp, _, _ in logprobs)
    assert len(scored["meta_info"]["output_top_logprobs"]) == len(scored["output_ids"])
    assert scored["text"] == plain["text"]
    chunks = list(engine.generate(prompts[1], params[1], stream=True))
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == plain["text"]
    # the first streamed chunk already holds the text forced before any sampling
    assert texts[0].startswith('{"name": ')


def test_preempted_jumping_requests_stay_valid(engine, make_engine) -> None:
    prompts, params = batch()
    # distinct prompts (no shared prefix), a decode estimate that admits too many
    prompts = [p.replace("JSON.", f"JSON, number {i}.") for i, p in enumerate(prompts * 2)]
    params = [{**p, "max_new_tokens": 64} for p in params * 2]
    tiny = make_engine(max_total_tokens=180, schedule_conservativeness=0.02)
    outs = tiny.generate(prompts, params)
    assert tiny.stats()["preemptions"] > 0
    check(outs[:3])
    check(outs[3:])
    assert sum(o["meta_info"]["jump_forward_tokens"] for o in outs) > 0
    tiny.check_idle()


@pytest.mark.slow
def test_outlines_core_jumps_keep_outputs_valid(make_engine) -> None:
    prompts, params = batch()
    on_engine = make_engine(grammar_backend="outlines")
    off_engine = make_engine(grammar_backend="outlines", disable_jump_forward=True)
    on, on_steps = steps(on_engine, prompts, params)
    off, off_steps = steps(off_engine, prompts, params)
    check(on)
    check(off)
    assert on_steps < off_steps
    assert all(o["meta_info"]["jump_forward_tokens"] > 0 for o in on)
    on_engine.check_idle()


def test_canonical_json_jumps_keys_and_separators_as_decode_rows(engine, make_engine) -> None:
    """The bench's three-key schema (json_decode): in the canonical layout every key with the
    separators around it is forced text (`{"name": `, `, "age": `, `, "city": `), all jumped,
    and the jumped tokens run as decode rows (no extend after the prompt's). With whitespace
    allowed around `,` and `:` (--grammar-any-whitespace) only the keys are forced."""
    from radixflow.bench.workloads import PERSON_SCHEMA

    prompt = chat("Ada is 41 years old and lives in Oslo. Give her name, age and city as JSON.")
    params = {"max_new_tokens": 40, "temperature": 0, "json_schema": PERSON_SCHEMA}
    encode = engine.tokenizer.encode
    keys = sum(
        len(encode(t, add_special_tokens=False)) for t in ('{"name":', ' "age":', ' "city":')
    )
    extends: list[int] = []
    runner = engine.scheduler.runner
    forward = runner.forward

    def recording(plan):
        extends.append(plan.num_extend_tokens)
        return forward(plan)

    runner.forward = recording
    try:
        out = engine.generate(prompt, params)
    finally:
        runner.forward = forward
    text, jumped = out["text"], out["meta_info"]["jump_forward_tokens"]
    validate(json.loads(text), json.loads(PERSON_SCHEMA))
    assert text == json.dumps(json.loads(text)), text  # json.dumps's layout
    assert jumped >= keys, (jumped, keys, text)
    assert len(extends) > 1 and not any(extends[1:]), extends  # jumps were decode rows
    flexible = make_engine(grammar_any_whitespace=True).generate(prompt, params)
    validate(json.loads(flexible["text"]), json.loads(PERSON_SCHEMA))
    assert flexible["meta_info"]["jump_forward_tokens"] < keys, flexible["text"]
