"""Tests for runtime/constrained/grammar.py: vocabulary conversion, masks, walks, caching,
threading."""

from __future__ import annotations

import functools
import json
import random
import re
import time
from collections import deque
from typing import Any

import numpy as np
import psutil
import pytest
from outlines_core import Index, Vocabulary
from outlines_core.json_schema import build_regex_from_schema
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from radixflow.runtime.constrained import grammar as constraints
from radixflow.runtime.constrained.grammar import (
    Grammar,
    GrammarBackend,
    GrammarError,
    token_style,
    vocabulary_bytes,
)
from radixflow.runtime.constrained.schema_regex import canonical_layout

EOS_IDS = (0, 2)  # SmolLM2's <|endoftext|> and <|im_end|>
PADDING = 100  # logits wider than the tokenizer, as in padded checkpoints


@pytest.fixture(scope="module")
def smollm2() -> Any:
    from radixflow.runtime.models.loader import resolve_model_dir
    from radixflow.runtime.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_dir("smollm2"))


@pytest.fixture(scope="module")
def backend(smollm2: Any) -> Any:
    backend = GrammarBackend(smollm2, len(smollm2) + PADDING, EOS_IDS, max_workers=2)
    yield backend
    backend.shutdown()


def sp_tokenizer(specials: bool = True) -> PreTrainedTokenizerFast:
    """A tiny Llama-style SentencePiece tokenizer: `▁` metaspace, `<0xNN>` byte fallback.
    Without `specials`, EOS is the only special token and no token holds a NUL byte."""
    pieces = ["<unk>", "<s>", "</s>", "<pad>"] if specials else ["</s>"]
    pieces += [f"<0x{b:02X}>" for b in range(0 if specials else 1, 256)]
    pieces += ["▁", "▁a", "▁ab", "a", "b", "c", "ab", "abc", "A", "1", "2", "12", "▁1", "\n"]
    unk_id = 0 if specials else None
    model = models.Unigram([(piece, -1.0) for piece in pieces], unk_id, byte_fallback=True)
    inner = Tokenizer(model)
    inner.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    inner.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    if not specials:
        return PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="</s>")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=inner, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.add_special_tokens({"pad_token": "<pad>"})
    tokenizer.add_tokens(["<tool>"])  # a non-special added token: stands for its text
    return tokenizer


@pytest.fixture(scope="module")
def sp() -> PreTrainedTokenizerFast:
    return sp_tokenizer()


def sp_backend(sp: PreTrainedTokenizerFast, **kwargs: Any) -> GrammarBackend:
    return GrammarBackend(sp, len(sp) + 7, (sp.eos_token_id,), **kwargs)


def allowed_ids(grammar: Grammar) -> np.ndarray:
    row = np.full(grammar.words, -1, dtype=np.int32)  # fill_mask must overwrite every word
    grammar.fill_mask(row)
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


# ---- vocabulary conversion ---------------------------------------------------------------------


def test_byte_level_vocabulary(smollm2: Any) -> None:
    assert token_style(smollm2) == "byte_level"
    table = vocabulary_bytes(smollm2, EOS_IDS, len(smollm2))
    ids = [i for id_list in table.values() for i in id_list]
    vocab = smollm2.get_vocab()
    assert len(ids) == len(set(ids)) == len(smollm2) - 18  # ids 0..16 are special
    assert min(ids) == 17 and vocab["Ā"] not in ids  # "Ā" is byte 0, the end mark
    assert table[b"\n"] == [vocab["Ċ"]]
    assert vocab["Ġthe"] in table[b" the"]
    assert vocab["âĢĻ"] in table["\u2019".encode()]  # a multi-byte char through the table
    by_id = {i: data for data, id_list in table.items() for i in id_list}
    for token_id in random.Random(0).sample(sorted(by_id), 3000):
        data = by_id[token_id]
        text = smollm2.decode([token_id], clean_up_tokenization_spaces=False)
        if "\ufffd" not in text:  # a token ending mid-character decodes lossily
            assert data == text.encode(), token_id


def test_sentencepiece_vocabulary(sp: PreTrainedTokenizerFast) -> None:
    assert token_style(sp) == "sentencepiece"
    vocab = sp.get_vocab()
    table = vocabulary_bytes(sp, (sp.eos_token_id,), len(sp))
    assert table[b"\n"] == sorted([vocab["<0x0A>"], vocab["\n"]])  # duplicates stay distinct
    assert table[b"A"] == sorted([vocab["<0x41>"], vocab["A"]])
    assert table[b" ab"] == [vocab["▁ab"]]
    assert table[b" "] == sorted([vocab["<0x20>"], vocab["▁"]])
    assert table[b"\xe2"] == [vocab["<0xE2>"]]  # a lone byte of a multi-byte char
    assert table[b"<tool>"] == [vocab["<tool>"]]
    ids = {i for id_list in table.values() for i in id_list}
    for special in ("<unk>", "<s>", "</s>", "<pad>", "<0x00>"):  # and the end mark's byte
        assert vocab[special] not in ids
    assert len(ids) == len(sp) - 5


def test_full_vocabulary_mask(sp: PreTrainedTokenizerFast) -> None:
    """Every id under a 256-wide logits row is a token but EOS: outlines-core then wants one
    word more than the row has (256 tokens + EOS + end mark), so the row goes via scratch."""
    tokenizer = sp_tokenizer(specials=False)
    backend = GrammarBackend(tokenizer, 256, (tokenizer.eos_token_id,))
    try:
        grammar = backend.get(("regex", "[a-c]+"))
        assert grammar.words == 8
        vocab = tokenizer.get_vocab()
        expected = {vocab[f"<0x{b:02X}>"] for b in b"abc"}
        assert set(allowed_ids(grammar).tolist()) == expected
    finally:
        backend.shutdown()


def test_vocabulary_drops_ids_beyond_logits(sp: PreTrainedTokenizerFast) -> None:
    table = vocabulary_bytes(sp, (sp.eos_token_id,), 100)
    assert max(i for id_list in table.values() for i in id_list) == 99


# ---- masks -------------------------------------------------------------------------------------


def test_mask_width_padding_and_specials(backend: GrammarBackend, smollm2: Any) -> None:
    grammar = backend.get(("regex", ".*"))
    assert grammar.words == backend.words == -(-(len(smollm2) + PADDING) // 32)
    allowed = set(allowed_ids(grammar).tolist())
    assert max(allowed) < len(smollm2)  # padding bits stay 0
    assert set(EOS_IDS) <= allowed  # ".*" may end at once
    assert not allowed & (set(range(17)) - set(EOS_IDS))  # specials never
    assert smollm2.get_vocab()["Ċ"] not in allowed  # "." excludes newline


def test_eos_only_in_final_states(backend: GrammarBackend, smollm2: Any) -> None:
    vocab = smollm2.get_vocab()
    grammar = backend.get(("regex", "[0-9]{2}[0-9]*"))
    for digit in "12":
        assert not set(EOS_IDS) & set(allowed_ids(grammar).tolist())
        for eos in EOS_IDS:
            with pytest.raises(GrammarError, match="EOS"):
                grammar.accept(eos)
        grammar.accept(vocab[digit])
    allowed = set(allowed_ids(grammar).tolist())
    assert set(EOS_IDS) <= allowed and vocab["3"] in allowed
    assert not grammar.is_terminated()  # more digits may follow
    grammar.accept(EOS_IDS[1])
    assert grammar.is_terminated()
    assert set(allowed_ids(grammar).tolist()) == set(EOS_IDS)
    with pytest.raises(GrammarError, match="ended"):
        grammar.accept(vocab["3"])


def test_terminated_when_only_eos_may_follow(backend: GrammarBackend, smollm2: Any) -> None:
    grammar = backend.get(("regex", "[0-9]{3}"))
    for token_id in smollm2.encode("123", add_special_tokens=False):
        assert not grammar.is_terminated()
        grammar.accept(token_id)
    assert grammar.is_terminated()
    assert set(allowed_ids(grammar).tolist()) == set(EOS_IDS)


def test_disallowed_token_raises(backend: GrammarBackend, smollm2: Any) -> None:
    grammar = backend.get(("regex", "[0-9]+"))
    with pytest.raises(GrammarError, match="not allowed"):
        grammar.accept(smollm2.get_vocab()["a"])


def test_tokens_after_a_complete_match_are_kept(backend: GrammarBackend, smollm2: Any) -> None:
    """outlines-core alone drops these (the text before the token's last byte is a match)."""
    vocab = smollm2.get_vocab()
    cases = [(r"[0-9]+(\.[0-9]+)?", "12", "."), ("(ab)+", "ab", "a"), ("a( b)?", "a", "Ġ")]
    for regex, prefix, token in cases:
        grammar = backend.get(("regex", regex))
        for token_id in smollm2.encode(prefix, add_special_tokens=False):
            grammar.accept(token_id)
        allowed = set(allowed_ids(grammar).tolist())
        assert vocab[token] in allowed and set(EOS_IDS) <= allowed, (regex, prefix, token)
        assert not grammar.is_terminated()


def test_anchors_are_stripped(backend: GrammarBackend, smollm2: Any) -> None:
    for regex in ("^[0-9]{2}$", r"\A[0-9]{2}\z"):
        grammar = backend.get(("regex", regex))
        for token_id in smollm2.encode("42", add_special_tokens=False):
            grammar.accept(token_id)
        assert grammar.is_terminated()
    grammar = backend.get(("regex", r"[0-9]\$"))  # an escaped dollar is a literal
    for token_id in smollm2.encode("4$", add_special_tokens=False):
        grammar.accept(token_id)
    assert grammar.is_terminated()


def test_tokenized_strings_are_accepted(backend: GrammarBackend, smollm2: Any) -> None:
    """What the model would emit for a valid string is allowed token by token."""
    cases = [
        (r"[0-9]{4}-[0-9]{2}-[0-9]{2}", "2024-05-17"),
        (r"(Hello|Goodbye), [a-z]+!", "Hello, world!"),
        (r'\{"name": "[^"]*"\}', '{"name": "Ada Lovelace"}'),
    ]
    for regex, text in cases:
        grammar = backend.get(("regex", regex))
        for token_id in smollm2.encode(text, add_special_tokens=False):
            assert token_id in allowed_ids(grammar), (regex, text, token_id)
            grammar.accept(token_id)
        assert set(EOS_IDS) <= set(allowed_ids(grammar).tolist())


# ---- walks: follow the mask, decode with the tokenizer, check the text -------------------------


class ByteDfa:
    """The same regex over single bytes: tracks the walk and measures the way to an end.

    Built like the backend builds its index (regex + end mark), for the same reason: without
    the mark outlines-core drops bytes that leave a state where the regex is complete."""

    def __init__(self, regex: str) -> None:
        tokens = {bytes([b]): [b] for b in range(1, 256)} | {b"\x00": [256]}  # NUL: end mark
        index = Index(f"(?:{regex})\\x00", Vocabulary(257, tokens))
        self.state = index.get_initial_state()
        edges = index.get_transitions()
        self.transitions = {s: {b: t for b, t in e.items() if b < 256} for s, e in edges.items()}
        finals = index.get_final_states()
        self.distance = self._distances({s for s, e in edges.items() if e.get(256) in finals})

    def _distances(self, finals: set[int]) -> dict[int, int]:
        reverse: dict[int, list[int]] = {}
        for state, edges in self.transitions.items():
            for target in edges.values():
                reverse.setdefault(target, []).append(state)
        distance = dict.fromkeys(finals, 0)
        queue = deque(finals)
        while queue:
            state = queue.popleft()
            for previous in reverse.get(state, ()):
                if previous not in distance:
                    distance[previous] = distance[state] + 1
                    queue.append(previous)
        return distance

    def after(self, data: bytes) -> int:
        state = self.state
        for byte in data:
            state = self.transitions[state][byte]
        return state


@functools.cache
def token_table(tokenizer: Any, eos_token_ids: tuple[int, ...], vocab_size: int) -> dict:
    return vocabulary_bytes(tokenizer, eos_token_ids, vocab_size)


class Walker:
    """Follows a Grammar's masks: uniform samples first, then the shortest way to an end.

    At every step the mask is checked against the byte DFA: a single-byte token is allowed
    exactly when its byte may follow, and EOS exactly when the regex is complete."""

    def __init__(self, backend: GrammarBackend, tokenizer: Any, regex: str, seed: int) -> None:
        table = token_table(tokenizer, backend.eos_token_ids, backend.vocab_size)
        self.token_bytes = {i: data for data, id_list in table.items() for i in id_list}
        self.byte_tokens = {data[0]: ids for data, ids in table.items() if len(data) == 1}
        self.eos = set(backend.eos_token_ids)
        self.dfa = ByteDfa(regex)
        self.rng = random.Random(seed)

    def check(self, allowed: set[int]) -> None:
        may_follow = set(self.dfa.transitions[self.dfa.state])
        for byte, ids in self.byte_tokens.items():
            assert (set(ids) <= allowed) == (byte in may_follow), (byte, ids)
        assert bool(self.eos & allowed) == (self.dfa.distance.get(self.dfa.state) == 0)

    def choose(self, allowed: set[int], explore: bool) -> int:
        if explore:
            return self.rng.choice(sorted(allowed))
        if self.eos & allowed:
            return min(self.eos & allowed)
        distance = {
            ids[0]: self.dfa.distance[self.dfa.after(bytes([byte]))]
            for byte, ids in self.byte_tokens.items()
            if ids[0] in allowed
        }
        best = min(distance.values())
        return self.rng.choice([t for t, d in distance.items() if d == best])

    def advance(self, token_id: int) -> None:
        self.dfa.state = self.dfa.after(self.token_bytes[token_id])


def walk(
    backend: GrammarBackend, tokenizer: Any, key: tuple[str, str], regex: str, seed: int
) -> str:
    """Walk `key`'s grammar to its end; return the text the tokenizer decodes."""
    walker = Walker(backend, tokenizer, regex, seed)
    grammar = backend.get(key)
    ids: list[int] = []
    while not grammar.is_terminated():
        assert len(ids) < 500, f"walk did not end: {ids}"
        allowed = set(allowed_ids(grammar).tolist())
        walker.check(allowed)
        token_id = walker.choose(allowed, explore=len(ids) < 12)
        grammar.accept(token_id)
        if token_id not in walker.eos:
            ids.append(token_id)
            walker.advance(token_id)
    assert walker.dfa.distance.get(walker.dfa.state) == 0
    assert set(allowed_ids(grammar).tolist()) == walker.eos  # with or without EOS accepted
    return tokenizer.decode(ids, clean_up_tokenization_spaces=False)


REGEXES = [
    r"[0-9]+",
    r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])",
    r"(cat|dog|bird)s?",
    r'"([^"\\\n]|\\["\\n])*"',
    r"[a-z]+@[a-z]+\.(com|org)",
    r"-?(0|[1-9][0-9]*)(\.[0-9]+)?",
    r"(true|false|null)",
    r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8})?",
    r"#[0-9a-fA-F]{6}",
    r"(café|naïve|日本語)!",
    r"Answer: (yes|no)\n",
]


@pytest.mark.parametrize("regex", REGEXES)
def test_regex_walks_match(backend: GrammarBackend, smollm2: Any, regex: str) -> None:
    for seed in range(3):
        text = walk(backend, smollm2, ("regex", regex), regex, seed)
        assert re.fullmatch(regex, text), (regex, seed, text)


def test_choices_walks_and_special_chars(backend: GrammarBackend, smollm2: Any) -> None:
    choices = ["a b", "c.d", "x|y", "#1", "(z)", "naïve", "a b c"]
    key = ("choices", json.dumps(choices))
    seen = {walk(backend, smollm2, key, constraints.choices_regex(key[1]), s) for s in range(12)}
    assert seen <= set(choices) and len(seen) > 1
    for choice in choices:
        grammar = backend.get(key)
        for token_id in smollm2.encode(choice, add_special_tokens=False):
            grammar.accept(token_id)
        assert set(EOS_IDS) <= set(allowed_ids(grammar).tolist())
        assert grammar.is_terminated() == (choice != "a b")  # "a b" may go on to "a b c"


def test_sentencepiece_walk(sp: PreTrainedTokenizerFast) -> None:
    backend = sp_backend(sp)
    regex = r"(ab|c)+\n[0-9]{2}é"
    try:
        for seed in range(5):
            text = walk(backend, sp, ("regex", regex), regex, seed)
            assert re.fullmatch(regex, text), (seed, text)
    finally:
        backend.shutdown()


def is_type(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    types = {"string": str, "boolean": bool, "null": type(None), "object": dict, "array": list}
    return isinstance(value, types[kind])


def validate(value: Any, schema: dict[str, Any]) -> None:
    """The JSON-schema subset used here: type, enum, pattern, properties, required, items."""
    if "enum" in schema:
        assert value in schema["enum"], (value, schema)
    kinds = schema.get("type", [])
    kinds = [kinds] if isinstance(kinds, str) else kinds
    assert not kinds or any(is_type(value, kind) for kind in kinds), (value, schema)
    if isinstance(value, str) and "pattern" in schema:
        assert re.fullmatch(schema["pattern"], value), (value, schema)
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        assert set(schema.get("required", ())) <= set(value), (value, schema)
        for name, item in value.items():
            assert name in properties, (name, schema)
            validate(item, properties[name])
    if isinstance(value, list) and "items" in schema:
        for item in value:
            validate(item, schema["items"])


NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "scores": {"type": "array", "items": {"type": "integer"}},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "[0-9]{5}"},
            },
            "required": ["street", "city", "zip"],
        },
        "nickname": {"type": ["string", "null"]},
        "level": {"type": "integer", "enum": [1, 2, 3]},
    },
    "required": ["name", "age", "role", "tags", "address", "active", "level"],
}

SCHEMAS = [
    NESTED_SCHEMA,
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"}}}},
    {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}, "why": {"type": "string"}},
        "required": ["answer", "why"],
    },
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["nested", "array", "enum"])
def test_json_walks_validate(backend: GrammarBackend, smollm2: Any, schema: dict) -> None:
    text = json.dumps(schema)
    regex = canonical_layout(build_regex_from_schema, text, None)  # the default layout
    for seed in range(3):
        output = walk(backend, smollm2, ("json", text), regex, seed)
        validate(json.loads(output), schema)


def test_json_whitespace_pattern(smollm2: Any) -> None:
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    backend = GrammarBackend(smollm2, len(smollm2), EOS_IDS, whitespace_pattern=r"\n")
    try:
        output = walk(backend, smollm2, ("json", schema), build_regex_from_schema(schema, r"\n"), 0)
    finally:
        backend.shutdown()
    assert output.startswith("{\n") and output.endswith("\n}") and " " not in output
    validate(json.loads(output), json.loads(schema))


# ---- errors, caching, threads ------------------------------------------------------------------

BAD_KEYS = [
    (("regex", "(ab"), "invalid regex '\\(ab'.*missing \\)"),
    (("regex", "[z-a]"), "invalid regex"),
    (("regex", "a)(b"), "invalid regex 'a\\)\\(b'.*unbalanced parenthesis"),
    (("regex", "a\\x00"), "invalid regex"),  # NUL is the end mark: never generated
    (("json", "{not json"), "invalid JSON schema: not valid JSON"),
    (("json", '{"type": "foo"}'), "Unsupported type: foo"),
    (("choices", "[]"), "non-empty list of strings"),
    (("choices", "[1, 2]"), "non-empty list of strings"),
    (("ebnf", "root ::= x"), "ebnf grammars need --grammar-backend llguidance"),
    (("yaml", "a: 1"), "unknown grammar kind 'yaml'"),
]


@pytest.mark.parametrize(("key", "message"), BAD_KEYS, ids=[k[0] for k, _ in BAD_KEYS])
def test_invalid_grammar_is_cached(
    sp: PreTrainedTokenizerFast, key: tuple[str, str], message: str
) -> None:
    backend = sp_backend(sp)
    try:
        with pytest.raises(GrammarError, match=message):
            backend.get(key, timeout=30)
        started = time.perf_counter()
        error = backend.poll(key)
        assert time.perf_counter() - started < 0.05
        assert isinstance(error, GrammarError) and error is backend.poll(key)
        assert isinstance(error, ValueError)
    finally:
        backend.shutdown()


SLOW = ("regex", "a{0,100000}")  # minutes to compile, even over the tiny vocabulary


def compiler_children() -> set[int]:
    children = psutil.Process().children(recursive=True)
    return {c.pid for c in children if "radixflow.runtime.constrained.compiler" in c.cmdline()}


def test_slow_grammar_holds_one_worker_then_fails_at_its_time_limit(
    sp: PreTrainedTokenizerFast,
) -> None:
    """Compilation runs in worker processes: a grammar that would take minutes occupies one
    worker while another compiles the next key, and fails (cached) at `timeout_s`; its worker
    is killed and replaced, and shutdown leaves no compiler process behind."""
    others = compiler_children()  # other backends' workers
    backend = sp_backend(sp, timeout_s=4)
    try:
        backend.submit(SLOW)
        backend.submit(SLOW)  # in flight: not compiled twice
        started = time.monotonic()
        assert isinstance(backend.get(("regex", "abc"), timeout=3), Grammar)
        assert backend.poll(SLOW) is None, "the slow grammar is still compiling"
        busy = compiler_children() - others
        assert len(busy) == 2
        with pytest.raises(TimeoutError):
            backend.get(SLOW, timeout=0.05)
        with pytest.raises(GrammarError, match="took longer than 4 s to compile"):
            backend.get(SLOW, timeout=30)
        assert 4 <= time.monotonic() - started < 15
        assert isinstance(backend.poll(SLOW), GrammarError)  # cached: no second attempt
        assert isinstance(backend.get(("regex", "a+b"), timeout=10), Grammar)
        assert len(busy - compiler_children()) == 1  # the slow one's worker was killed
    finally:
        backend.shutdown()
    assert compiler_children() - others == set()


def test_lru_eviction(sp: PreTrainedTokenizerFast) -> None:
    backend = sp_backend(sp, cache_size=2)
    first, second, third = ("regex", "a+"), ("regex", "b+"), ("regex", "(")
    try:
        backend.get(first)
        backend.get(second)
        assert isinstance(backend.poll(first), Grammar)  # touch: second is now the oldest
        with pytest.raises(GrammarError):
            backend.get(third)  # errors take cache slots too
        assert isinstance(backend.poll(first), Grammar)
        assert backend.poll(second) is None  # evicted: compiling again
        assert isinstance(backend.get(second), Grammar)
    finally:
        backend.shutdown()


def test_copy_is_independent(backend: GrammarBackend, smollm2: Any) -> None:
    vocab = smollm2.get_vocab()
    grammar = backend.get(("regex", "[0-9]+x"))
    start = allowed_ids(grammar)
    grammar.accept(vocab["7"])
    copy = grammar.copy()
    assert np.array_equal(allowed_ids(copy), start)  # the copy starts over
    assert vocab["x"] in allowed_ids(grammar)
    copy.accept(vocab["1"])
    copy.accept(vocab["x"])
    assert copy.is_terminated() and not grammar.is_terminated()
    grammar.accept(vocab["x"])
    assert grammar.is_terminated()


def test_grammar_workers_speak_msgpack_not_pickle() -> None:
    """A worker process answers msgpack frames: the vocabulary, then a key, gets back
    ["ok", <outlines-core binary>] (loadable with Index.from_binary) or ["error", message]."""
    import os
    import socket
    import subprocess
    import sys
    from multiprocessing.connection import Connection

    import msgpack

    ours, theirs = socket.socketpair()
    cmd = [sys.executable, "-m", "radixflow.runtime.constrained.compiler", str(theirs.fileno())]
    proc = subprocess.Popen([*cmd, str(os.getpid())], pass_fds=(theirs.fileno(),))
    theirs.close()
    conn = Connection(ours.detach())
    try:
        vocab = {b"a": [0], b"b": [1], b"ab": [2]}
        conn.send_bytes(msgpack.packb([vocab, 3, None], use_bin_type=True))
        conn.send_bytes(msgpack.packb(["regex", "(ab)+"], use_bin_type=True))
        assert conn.poll(60)
        status, binary = msgpack.unpackb(conn.recv_bytes(), raw=False)
        assert status == "ok" and isinstance(binary, bytes)
        index = Index.from_binary(binary)
        state = index.get_next_state(index.get_initial_state(), 2)  # "ab"
        assert state is not None and index.get_next_state(state, 1) is None  # "b" cannot follow
        conn.send_bytes(msgpack.packb(["regex", "([a-z"], use_bin_type=True))
        assert conn.poll(60)
        status, message = msgpack.unpackb(conn.recv_bytes(), raw=False)
        assert status == "error" and "invalid regex" in message
    finally:
        conn.close()
        proc.wait(30)
