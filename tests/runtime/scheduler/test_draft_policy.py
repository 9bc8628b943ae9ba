"""Where speculative drafts come from and how many are made (runtime/scheduler/speculative.py,
runtime/scheduler/schema_drafts.py): kinds of match that do not pay are passed over, and a
JSON-schema request drafts its schema's skeleton before any output holds it."""

from __future__ import annotations

import json

from test_scheduler import make_req

from conftest import chat
from radixflow.bench.workloads import PERSON_SCHEMA
from radixflow.runtime.config import ServerConfig
from radixflow.runtime.scheduler import speculative
from radixflow.runtime.scheduler.schema_drafts import skeleton_segments
from radixflow.runtime.scheduler.speculative import (
    PROBE_DRAFTS,
    PROBE_EVERY,
    DraftState,
    Rate,
    Speculator,
)

PERSON = PERSON_SCHEMA  # json_decode's schema: name, age, city


# ---- skeletons --------------------------------------------------------------------------------


def test_skeleton_is_the_fixed_text_between_free_values_in_both_layouts() -> None:
    assert skeleton_segments(PERSON) == [
        '{"name": "', '", "age": ', ', "city": "', '"}',
        '{ "name": "', '", "age": ', ', "city": "', '" }',
    ]  # fmt: skip


def test_skeleton_follows_refs_arrays_enums_and_unions() -> None:
    schema = {
        "$defs": {"Pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}}},
        "type": "object",
        "properties": {
            "pets": {"type": "array", "items": {"$ref": "#/$defs/Pet"}},
            "id": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "ok": {"type": "boolean"},
            "tag": {"const": "v1"},
            "none": {"type": "null"},
        },
    }
    compact = skeleton_segments(json.dumps(schema))[:3]
    assert compact == [
        '{"pets": [{"kind": "cat"}], "id": ',
        ', "ok": ',
        ', "tag": "v1", "none": null}',
    ]


def test_no_skeleton_for_what_it_cannot_render() -> None:
    assert skeleton_segments("not json") == []
    assert skeleton_segments('{"type": "string"}') == []  # not an object
    assert skeleton_segments('{"type": "object", "properties": {"a": {"$ref": "#/nope"}}}') == []
    loop = {"$defs": {"N": {"type": "object", "properties": {"n": {"$ref": "#/$defs/N"}}}}}
    assert skeleton_segments(json.dumps({**loop, "$ref": "#/$defs/N"})) == []  # endless nesting


# ---- kinds of draft ---------------------------------------------------------------------------


def drafting(rates: dict) -> tuple[Speculator, object]:
    """A speculator whose request matches in its own context at order 4 (5 6 7 8 -> 9 ...)
    and in the tree's text at order 2 only (7 8 -> 30 31 ...), with the given rates by kind."""
    spec = Speculator(ServerConfig(speculative_algorithm="ngram"), (0,))
    spec.tree.add_sequence([1, 2, 7, 8, 30, 31, 32, 33, 34])
    spec.rates.update(rates)
    req = make_req("r", [5, 6, 7, 8, 9, 10, 11, 4, 5, 6, 7, 8], 50)
    req.spec = DraftState()
    return spec, req


def test_the_longest_match_drafts_when_its_kind_pays() -> None:
    spec, req = drafting({("own", 4): Rate(9.0, 10.0), ("tree", 2): Rate(9.0, 10.0)})
    drafts = spec._draft(req, 8, 1)
    assert drafts[:3] == [9, 10, 11] and len(drafts) >= 6
    assert req.spec.kind == ("own", 4)


def test_a_kind_that_does_not_pay_is_passed_over() -> None:
    # matches in the own context have been failing: the tree's order-2 match drafts
    failing = {("own", n): Rate(0.0, 20.0) for n in speculative.ORDERS}
    spec, req = drafting({**failing, ("tree", 2): Rate(9.0, 10.0)})
    assert spec._draft(req, 8, 1)[:3] == [30, 31, 32]
    assert req.spec.kind == ("tree", 2)
    # failing for this request alone also passes them over, whatever every request's rate
    spec, req = drafting({("tree", 2): Rate(9.0, 10.0)})
    req.spec.rates.update({kind: Rate(0.0, 40.0) for kind in failing})
    assert spec._draft(req, 8, 1)[:3] == [30, 31, 32]


def test_kinds_that_do_not_pay_draft_only_a_short_probe_now_and_then() -> None:
    bad = Rate(0.0, 20.0)
    kinds = [(s, n) for n in speculative.ORDERS for s in speculative.SOURCES]
    spec, req = drafting(dict.fromkeys(kinds, bad))
    drafts = [spec._draft(req, 8, 1) for _ in range(PROBE_EVERY)]
    assert drafts[:-1] == [[]] * (PROBE_EVERY - 1)
    assert drafts[-1] == [9, 10][:PROBE_DRAFTS] and req.spec.kind == ("own", 4)


def test_a_schema_request_drafts_the_fixed_text_up_to_the_next_value() -> None:
    """With characters as tokens: after `", "` the schema's segment `", "age": ` drafts its
    rest and stops where the age goes, though the request's own text would continue it."""
    spec = Speculator(
        ServerConfig(speculative_algorithm="ngram"), (0,), encode=lambda t: [ord(c) for c in t]
    )
    text = 'JSON: "age": 7 { "name": "Ada", "'
    req = make_req("r", [ord(c) for c in text], 50, json_schema=PERSON)
    req.spec = DraftState()
    spec.rates[("schema", 4)] = Rate(19.0, 20.0)  # it pays to draft all 8
    drafts = spec._draft(req, 16, 1)
    assert "".join(map(chr, drafts)) == 'age": ' and req.spec.kind == ("schema", 4)


# ---- SmolLM2 ----------------------------------------------------------------------------------


def test_a_cold_json_request_drafts_its_schema_skeleton(engine, make_engine) -> None:
    """No earlier output holds this schema's text: the keys and separators are drafted from
    its skeleton, and the output is the one without speculation."""
    prompt = chat("Describe Maya, who is 82 and lives in Pune, as JSON.")
    params = {"json_schema": PERSON, "max_new_tokens": 40, "temperature": 0}
    ref = engine.generate(prompt, params)
    # jump-forward off: with it on, the canonical layout's keys and separators are forced
    # and appended by the jump, leaving the skeleton's drafts nothing to propose
    spec = make_engine(speculative_algorithm="ngram", disable_jump_forward=True)
    got = spec.generate(prompt, params)
    assert got["output_ids"] == ref["output_ids"]
    assert json.loads(got["text"]).keys() == {"name", "age", "city"}
    stats = spec.stats()
    assert stats["spec_accepted"] >= 8, stats
    spec.check_idle()
