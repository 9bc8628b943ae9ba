"""The table of other runtimes' fields (runtime/server/fields.py), without a server: docs/http.md
lists exactly its fields, and every entry does what its row says: a renamed field arrives under
our name, a refused sampler is a 400 naming it at any value but its off ones, a tuning knob is
refused only while its sampler is on, a tolerated one is dropped. Also the plan-level effect of
reasoning_effort on a thinking template (Qwen 3's), which SmolLM2's cannot show. The live
checks through the `openai` client are in test_client_fields.py."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from chat_templates import TEMPLATES, chat_tokenizer

from radixflow.runtime.server import fields
from radixflow.runtime.server.chat import plan_chat
from radixflow.runtime.server.fields import FieldError, translate
from radixflow.runtime.server.tool_calls import ToolError

DOCS = Path(__file__).parents[3] / "docs" / "http.md"
TUNED = set(fields.TUNES)  # documented in their sampler's row


def documented() -> set[str]:
    section = DOCS.read_text().split("### Other runtimes' fields", 1)[1].split("\n### ", 1)[0]
    names = set(re.findall(r"^\| `([a-z_]+)` \|", section, re.MULTILINE))
    rows = "\n".join(line for line in section.splitlines() if line.startswith("| `"))
    return names | {n for n in TUNED if f"`{n}`" in rows}


def test_the_docs_table_is_the_codes_table() -> None:
    code = set(fields.RENAMED) | set(fields.REFUSED) | TUNED | set(fields.TOLERATED)
    code |= {"structured_outputs", "json_schema", "repeat_last_n"}
    assert documented() == code


@pytest.mark.parametrize("name", sorted(fields.RENAMED))
def test_a_renamed_field_arrives_under_our_name(name: str) -> None:
    ours = fields.RENAMED[name]
    assert translate({name: "x"}) == {ours: "x"}
    with pytest.raises(FieldError, match=name):
        translate({name: "x", ours: "y"})


@pytest.mark.parametrize("key", sorted(fields.STRUCTURED))
def test_structured_outputs_keys(key: str) -> None:
    assert translate({"structured_outputs": {key: "v"}}) == {fields.STRUCTURED[key]: "v"}
    assert translate({"guided_decoding": {key: "v"}}) == {fields.STRUCTURED[key]: "v"}
    with pytest.raises(FieldError, match="structured_outputs"):
        translate({"structured_outputs": {key: "v"}, fields.STRUCTURED[key]: "w"})
    with pytest.raises(FieldError, match="structured_outputs.nonsense"):
        translate({"structured_outputs": {"nonsense": 1}})


@pytest.mark.parametrize("name", sorted(fields.REFUSED))
def test_a_refused_sampler_is_refused_unless_off(name: str) -> None:
    off, instead = fields.REFUSED[name]
    for value in off:
        assert translate({name: value}) == {}
    with pytest.raises(FieldError, match=re.escape(name)) as caught:
        translate({name: 0.37})
    assert instead in str(caught.value) and caught.value.param == name


@pytest.mark.parametrize("name", sorted(fields.TUNES))
def test_a_tuning_knob_is_refused_only_while_its_sampler_is_on(name: str) -> None:
    sampler = fields.TUNES[name]
    off = fields.REFUSED[sampler][0][0]
    assert translate({name: 3, sampler: off}) == {}
    assert translate({name: 3}) == {}
    with pytest.raises(FieldError, match=re.escape(sampler)):
        translate({name: 3, sampler: 0.37})  # the sampler itself is refused first


@pytest.mark.parametrize("name", sorted(fields.TOLERATED))
def test_a_tolerated_field_is_dropped(name: str) -> None:
    assert translate({name: "anything", "top_k": 3}) == {"top_k": 3}


def test_repeat_last_n_needs_no_penalty_or_the_whole_request() -> None:
    assert translate({"repeat_last_n": 64, "repeat_penalty": 1.0}) == {"repetition_penalty": 1.0}
    assert translate({"repeat_last_n": -1, "repeat_penalty": 1.1}) == {"repetition_penalty": 1.1}
    with pytest.raises(FieldError, match="repeat_last_n"):
        translate({"repeat_last_n": 64, "repeat_penalty": 1.1})
    with pytest.raises(FieldError, match="repeat_last_n"):
        translate({"repeat_last_n": 64, "repetition_penalty": 1.1})


def plan(body: dict[str, Any]) -> Any:
    config = SimpleNamespace(tool_call_parser="", reasoning_parser="qwen3")
    tokenizer = chat_tokenizer("qwen3")
    tokenizer.chat_template = TEMPLATES["qwen3"]
    return plan_chat({"messages": [{"role": "user", "content": "Hi"}], **body}, tokenizer, config)


EFFORTS = [("none", False), ("minimal", False), ("low", True), ("medium", True), ("high", True)]


@pytest.mark.parametrize("effort, thinking", EFFORTS)
def test_reasoning_effort_switches_thinking(effort: str, thinking: bool) -> None:
    planned = plan({"reasoning_effort": effort})
    assert planned.thinking is thinking
    closed = planned.prompt.rstrip().endswith("</think>")  # the template closes an empty block
    assert closed is not thinking
    explicit = plan({"reasoning_effort": effort,
                     "chat_template_kwargs": {"enable_thinking": not thinking}})  # fmt: skip
    assert explicit.thinking is not thinking
    with pytest.raises(ToolError, match="reasoning_effort"):
        plan({"reasoning_effort": "max"})
