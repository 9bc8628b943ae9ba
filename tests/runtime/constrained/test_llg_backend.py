"""The llguidance backend (runtime/constrained/llg_backend.py) on SmolLM2's tokenizer: masks
admit exactly the tokens of valid documents, EOS only where the grammar may end, EBNF and
nested JSON objects compile, numeric bounds hold, and bad grammars fail with GrammarError."""

from __future__ import annotations

import json

import numpy as np
import pytest

from radixflow.runtime.constrained.compiler import GrammarError
from radixflow.runtime.constrained.grammar import GrammarBackend
from radixflow.runtime.constrained.llg_backend import LlgBackend
from radixflow.runtime.models.loader import resolve_model_dir
from radixflow.runtime.tokenizer import load_tokenizer

ARITHMETIC = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+ | "(" expr ")"'


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_dir("smollm2", None))


@pytest.fixture(scope="module")
def backend(tokenizer) -> LlgBackend:
    return LlgBackend(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))


def allowed(grammar, words: int) -> np.ndarray:
    row = np.zeros(words, dtype=np.int32)
    grammar.fill_mask(row)
    return np.unpackbits(row.view(np.uint8), bitorder="little").astype(bool)


def walk(backend, tokenizer, key, text: str) -> bool:
    """Whether `text` is accepted token by token and may end there."""
    grammar = backend.get(key)
    eos = tokenizer.eos_token_id
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not allowed(grammar, backend.words)[token]:
            return False
        grammar.accept(token)
    return bool(allowed(grammar, backend.words)[eos])


def test_ebnf_documents_and_non_documents(backend, tokenizer) -> None:
    key = ("ebnf", ARITHMETIC)
    assert walk(backend, tokenizer, key, "12+(3-4)+5")
    assert not walk(backend, tokenizer, key, "12+")  # may not end after an operator
    assert not walk(backend, tokenizer, key, "12*3")


def test_nested_json_object_and_bounds(backend, tokenizer) -> None:
    any_object = ("json", '{"type": "object"}')
    assert walk(backend, tokenizer, any_object, json.dumps({"a": [1, {"b": None}], "c": "d"}))
    assert not walk(backend, tokenizer, any_object, "[1, 2]")
    schema = {"type": "object", "properties": {"d": {"type": "integer", "maximum": 7}}}
    bounded = ("json", json.dumps({**schema, "required": ["d"]}))
    assert walk(backend, tokenizer, bounded, '{"d": 7}')
    assert not walk(backend, tokenizer, bounded, '{"d": 8}')


def test_same_documents_as_outlines(backend, tokenizer) -> None:
    """On the grammars both take, both backends accept and refuse the same texts."""
    outlines = GrammarBackend(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    try:
        cases = [
            (("regex", r"\d{4}-\d{2}-\d{2}"), ["2026-12-03", "2026-1-03", "2026-12-033"]),
            (("choices", '["yes", "no"]'), ["yes", "no", "maybe", "ye"]),
        ]  # JSON: test_constrained_engine holds llguidance's outputs to the schemas
        for key, texts in cases:
            for text in texts:
                ours = walk(backend, tokenizer, key, text)
                assert ours == walk(outlines, tokenizer, key, text), (key, text)
    finally:
        outlines.shutdown()


def test_both_backends_lay_json_out_as_json_dumps(backend, tokenizer) -> None:
    """With no whitespace pattern (the default) both backends accept JSON exactly as
    `json.dumps` lays it out (random schemas: nested objects, arrays, optional properties, any
    object) and refuse the same document compact, padded inside its braces or indented."""
    import random
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
    from test_tool_calls import random_instance, random_schema

    rng = random.Random(7)
    cases = [({"type": "object"}, {"a": [1, {"b": None}], "c": {}, "d": [], "e": "f"})]
    cases += [(schema, random_instance(schema, rng)) for schema in map(random_schema, [rng] * 12)]
    outlines = GrammarBackend(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    try:
        for schema, doc in cases:
            key = ("json", json.dumps(schema))
            texts = [(json.dumps(doc), True)]
            if doc:
                texts.append((json.dumps(doc, separators=(",", ":")), False))
                texts.append((json.dumps(doc, indent=1), False))
                texts.append(("{ " + json.dumps(doc)[1:-1] + " }", False))
            for text, valid in texts:
                assert walk(backend, tokenizer, key, text) == valid, (schema, text)
                assert walk(outlines, tokenizer, key, text) == valid, (schema, text)
    finally:
        outlines.shutdown()


def test_eos_ends_and_forbidden_tokens_raise(backend, tokenizer) -> None:
    grammar = backend.get(("choices", '["yes"]'))
    eos = tokenizer.eos_token_id
    assert not allowed(grammar, backend.words)[eos]
    with pytest.raises(GrammarError):
        grammar.accept(tokenizer.encode("no", add_special_tokens=False)[0])
    # a refused token leaves the grammar where it was (speculative drafts rely on it)
    for token in tokenizer.encode("yes", add_special_tokens=False):
        grammar.accept(token)
    assert grammar.is_terminated() and allowed(grammar, backend.words)[eos]


@pytest.mark.parametrize(
    "key", [("ebnf", "root ::= ("), ("json", "{not json"), ("regex", "a)("), ("choices", "[]")]
)
def test_bad_grammars_fail_clearly(backend, key) -> None:
    with pytest.raises(GrammarError):
        backend.get(key)
    assert isinstance(backend.poll(key), GrammarError)  # cached: the same answer again


def test_plain_added_tokens_are_text_to_the_grammar() -> None:
    """Qwen's <tool_call> and <think> are added tokens its tokenizer marks not special: a
    grammar that spells the tag must allow them and accept them (llguidance alone counts
    every added token special, allowed them in masks, then refused them in accept)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2]))
    from chat_templates import chat_tokenizer

    qwen = chat_tokenizer("qwen3")
    backend = LlgBackend(qwen, len(qwen), (qwen.eos_token_id,))
    key = (
        "ebnf",
        'root ::= "<think>\\n" [a-z ]+ "\\n</think>\\n<tool_call>\\n" [a-z]+ "\\n</tool_call>"',
    )
    text = "<think>\nlet me see\n</think>\n<tool_call>\nweather\n</tool_call>"
    ids = qwen.encode(text, add_special_tokens=False)
    assert {qwen.convert_tokens_to_ids(t) for t in ("<think>", "<tool_call>")} <= set(ids)
    assert walk(backend, qwen, key, text)
    # the special tokens stay special: the grammar's text never matches <|im_end|>
    im_end = qwen.convert_tokens_to_ids("<|im_end|>")
    assert not allowed(backend.get(("ebnf", "root ::= [a-z<|>_]+")), backend.words)[im_end]


def test_prepare_builds_the_vocabulary_view_before_the_first_grammar(tokenizer) -> None:
    """The engine calls `prepare` at load, so the first constrained request does not pay the
    view's build (0.4 s on SmolLM2): built with no grammar asked for, then reused."""
    from radixflow.runtime.constrained import llg_backend

    llg_backend._llg_tokenizer.cache_clear()
    backend = LlgBackend(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    thread = backend.prepare()
    thread.join(timeout=60)
    assert not thread.is_alive()
    info = llg_backend._llg_tokenizer.cache_info()
    assert (info.currsize, info.misses) == (1, 1)
    backend.get(("json", '{"type": "object"}')).fill_mask(np.zeros(backend.words, np.int32))
    assert llg_backend._llg_tokenizer.cache_info().misses == 1
