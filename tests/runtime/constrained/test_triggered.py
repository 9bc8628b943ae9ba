"""Triggered constraints (structural tags): free text until a trigger, a grammar from there,
free again or the end; the watch that starts after a text ("</think>"); the tokens that would
run past a trigger kept out of free text. On both grammar backends, with the byte-level tiny
tokenizer plus a few multi-byte tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from family_models import tiny_tokenizer

from radixflow.runtime.constrained.grammar import GrammarBackend, GrammarError
from radixflow.runtime.constrained.llg_backend import LlgBackend
from radixflow.runtime.constrained.triggered import TriggeredBackend, parse_spec

EOS = 256
WIDE = ["<tool_call>", '{"a', "b</think>c", "</think>"]  # multi-byte tokens
CALL = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
HERMES = {
    "type": "structural_tag",
    "structures": [{"begin": "<tool_call>\n", "schema": CALL, "end": "\n</tool_call>"}],
    "triggers": ["<tool_call>"],
}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tok = tiny_tokenizer()
    tok.add_tokens(WIDE)
    return tok


@pytest.fixture(scope="module", params=["llguidance", "outlines"])
def backend(request: pytest.FixtureRequest, tokenizer: Any) -> Iterator[TriggeredBackend]:
    size = len(tokenizer) + 4
    inner: Any = (LlgBackend if request.param == "llguidance" else GrammarBackend)(
        tokenizer, size, (EOS,)
    )
    wrapped = TriggeredBackend(inner, tokenizer, size, (EOS,))
    yield wrapped
    wrapped.shutdown()


def grammar(backend: TriggeredBackend, tag: dict[str, Any]) -> Any:
    key = ("structural_tag", json.dumps(tag))
    backend.submit(key)
    return backend.get(key, timeout=60)


def allowed(g: Any, size: int) -> np.ndarray:
    row = np.zeros(g.words, dtype=np.int32)
    g.fill_mask(row)
    return np.unpackbits(row.view(np.uint8), bitorder="little")[:size].astype(bool)


def write(g: Any, tokenizer: Any, text: str, size: int, one_byte: bool = True) -> None:
    """Feed `text` (a byte per token unless one_byte is False), each token checked allowed.
    Text a grammar forces (a canonical JSON call's `{"a`) is written as the tokenizer splits
    it: llguidance's masks hold forced text to that tokenization."""
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokenizer.tokenize(text)]
    if one_byte:
        ids = [i for c in text for i in tokenizer.encode(c, add_special_tokens=False)]
    for token in ids:
        assert allowed(g, size)[token], f"{tokenizer.decode([token])!r} masked in {text!r}"
        g.accept(token)


def test_a_call_is_constrained_between_its_tags_then_free(backend: Any, tokenizer: Any) -> None:
    size = len(tokenizer) + 4
    g = grammar(backend, HERMES)
    assert allowed(g, size).all()  # free text: anything, EOS included
    write(g, tokenizer, "Let me see. <tool_call>", size, one_byte=False)
    mask = allowed(g, size)
    assert mask.sum() == 1 and mask[tokenizer.encode("\n")[0]]  # begin's rest
    write(g, tokenizer, '\n{"a": 12}', size, one_byte=False)
    assert not allowed(g, size)[tokenizer.encode("x")[0]]  # no junk inside the call
    assert not allowed(g, size)[EOS]  # nor an end before </tool_call>
    write(g, tokenizer, "\n</tool_call>", size)
    assert allowed(g, size).all() and not g.is_terminated()  # free again: a second call may open
    write(g, tokenizer, " and <tool_call>\n", size)
    with pytest.raises(GrammarError):
        g.accept(tokenizer.encode("x")[0])  # the second call is constrained too


def test_stop_after_first_and_at_start(backend: Any, tokenizer: Any) -> None:
    size = len(tokenizer) + 4
    g = grammar(backend, {**HERMES, "stop_after_first": True})
    write(g, tokenizer, '<tool_call>\n{"a": 1}\n</tool_call>', size, one_byte=False)
    assert g.is_terminated() and allowed(g, size).sum() == 1 and allowed(g, size)[EOS]
    llama = {"structures": [{"begin": "{", "regex": '"a": [0-9]}', "end": ""}],
             "triggers": ["{"], "at_start": True, "stop_after_first": True}  # fmt: skip
    g = grammar(backend, llama)
    assert not allowed(g, size)[tokenizer.convert_tokens_to_ids('{"a')]  # would run past "{"
    write(g, tokenizer, ' {"a": 3}', size)
    assert g.is_terminated()
    g = grammar(backend, llama)
    write(g, tokenizer, "No call: {x", size)  # the reply did not open with "{": free for good
    assert allowed(g, size).all()


def test_the_watch_starts_after_the_reasoning(backend: Any, tokenizer: Any) -> None:
    size = len(tokenizer) + 4
    tag = {"structures": [{"begin": "", "schema": CALL, "end": ""}], "triggers": [""],
           "after": "</think>", "stop_after_first": True}  # fmt: skip
    g = grammar(backend, tag)
    assert not allowed(g, size)[tokenizer.convert_tokens_to_ids("b</think>c")]  # runs past
    write(g, tokenizer, "<think>hmm {x</think", size)  # the reasoning is free
    assert allowed(g, size).sum() == size - 1  # all but the token running past </think>
    write(g, tokenizer, ">", size)
    assert not allowed(g, size)[tokenizer.encode("x")[0]]  # the constraint starts here
    write(g, tokenizer, '{"a": 5}', size, one_byte=False)
    assert allowed(g, size)[EOS]
    copy = g.copy()  # a fresh one, at the start
    assert allowed(copy, size)[tokenizer.encode("x")[0]]


def test_bad_structural_tags_are_named() -> None:
    bad = [
        "not json",
        {"structures": [], "triggers": ["<a>"]},
        {"structures": [{"begin": "<b>", "schema": {}, "end": ""}], "triggers": ["<a>"]},
        {"structures": [{"begin": "<a>", "end": ""}], "triggers": ["<a>"]},
        {"structures": [{"begin": "<a>x", "ebnf": 'root ::= "y"', "end": ""}], "triggers": ["<a>"]},
    ]
    for tag in bad:
        with pytest.raises(GrammarError, match="structural_tag|JSON"):
            parse_spec(tag if isinstance(tag, str) else json.dumps(tag))
    many = {"structures": [{"begin": "<f=a>", "regex": "1", "end": "</f>"},
                           {"begin": "<f=b>", "regex": "2", "end": "</f>"}],
            "triggers": ["<f="]}  # fmt: skip
    ((trigger, (kind, regex)),) = parse_spec(json.dumps(many)).triggers
    assert trigger == "<f=" and kind == "regex" and "a>" in regex and "b>" in regex


def xgrammar_hermes(**flags: Any) -> dict[str, Any]:
    """HERMES in xgrammar's newer form (structural_tag.format), as SGLang passes it on."""
    tag = {"type": "tag", "begin": "<tool_call>\n", "end": "\n</tool_call>",
           "content": {"type": "json_schema", "json_schema": CALL}}  # fmt: skip
    fmt = {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [tag], **flags}
    return {"type": "structural_tag", "format": fmt}


def test_xgrammar_formats_mean_the_same_constraints() -> None:
    assert parse_spec(json.dumps(xgrammar_hermes())) == parse_spec(json.dumps(HERMES))
    first = parse_spec(json.dumps(xgrammar_hermes(stop_after_first=True)))
    assert first == parse_spec(json.dumps({**HERMES, "stop_after_first": True}))
    regex = {"type": "structural_tag", "format": {"type": "regex", "pattern": "[0-9]+"}}
    assert parse_spec(json.dumps(regex)).triggers == (("", ("regex", "[0-9]+")),)
    const = {"type": "tag", "begin": "<a>", "end": "</a>",
             "content": {"type": "const_string", "value": "x.y"}}  # fmt: skip
    ((trigger, (kind, body)),) = parse_spec(json.dumps({"format": const})).triggers
    assert trigger == "" and kind == "regex" and "x\\.y" in body
    bad = [{"type": "sequence", "elements": []}, {"type": "triggered_tags", "triggers": ["<a>"]},
           {"type": "tag", "begin": "<a>", "end": "", "content": {"type": "any_text"}},
           {"type": "triggered_tags", "triggers": ["<a>"], "tags": [{"begin": "<a>"}]}]  # fmt: skip
    for fmt in bad:
        with pytest.raises(GrammarError, match=r"structural_tag\.format"):
            parse_spec(json.dumps({"type": "structural_tag", "format": fmt}))


def test_xgrammar_at_least_one_opens_with_a_tag(backend: Any, tokenizer: Any) -> None:
    size = len(tokenizer) + 4
    g = grammar(backend, xgrammar_hermes(at_least_one=True, stop_after_first=True))
    mask = allowed(g, size)
    assert not mask[tokenizer.encode("x")[0]] and not mask[EOS]  # no free text first
    write(g, tokenizer, "<tool_call>", size, one_byte=False)  # llguidance: the one token
    write(g, tokenizer, '\n{"a": 7}\n</tool_call>', size, one_byte=False)
    assert g.is_terminated()
    g = grammar(backend, {"type": "structural_tag",
                          "format": {"type": "json_schema", "json_schema": CALL}})  # fmt: skip
    write(g, tokenizer, '{"a": 2}', size, one_byte=False)
    assert allowed(g, size)[EOS] and not allowed(g, size)[tokenizer.encode("x")[0]]
