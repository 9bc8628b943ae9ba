"""Constrained decoding: regex / JSON-schema / choices grammars as token bitmasks (torch-free).

`GrammarBackend` turns a `SamplingParams.grammar_key` into a compiled outlines-core `Index`
(DFA over the tokenizer's vocabulary) in a worker process (runtime/constrained/compiler.py, with a
time limit) and caches it (LRU, failures too).
Each request gets its own `Grammar`: a cursor in the shared index that writes the allowed-token
bitmask of the current state into one int32 row of `ceil(vocab_size / 32)` words (bit
`t % 32` of word `t // 32` is token `t`), and advances on every accepted token.

The vocabulary is built here from the local tokenizer, never downloaded: outlines-core wants
each token's decoded bytes, so GPT-2 style byte-level tokens go back through the byte<->unicode
table and SentencePiece tokens map `<0xNN>` to a byte and `▁` to a space.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from outlines_core import Guide, Index, Vocabulary

from radixflow.runtime.constrained.compiler import (  # noqa: F401 (re-exported)
    CompilerPool,
    GrammarError,
    GrammarKey,
    choices_regex,
    json_schema_regex,
    strip_anchors,
)
from radixflow.runtime.constrained.jump_forward import (
    MAX_FORCED_BYTES,
    NO_JUMP,
    Jump,
    natural_jump,
    utf8_prefix,
)

END_MARK = b"\x00"  # appended to every regex and spelled by no real token; see _Compiled
SPACE_MARKER = "▁"  # SentencePiece's word-boundary marker, decoded to a space
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def gpt2_unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's `bytes_to_unicode`: printable chars stand for themselves, the other
    bytes were shifted to code points 256 and up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table = {chr(b): b for b in printable}
    shifted = [b for b in range(256) if b not in set(printable)]
    table.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return table


def token_style(tokenizer: Any) -> str:
    """'byte_level' (GPT-2 style BPE) or 'sentencepiece' (`▁` marker, `<0xNN>` byte fallback).

    Read from the fast tokenizer's decoder; without one, guessed from the vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        decoder_types = _decoder_types(json.loads(backend.to_str()).get("decoder"))
        if "ByteLevel" in decoder_types:
            return "byte_level"
        if decoder_types & {"Metaspace", "ByteFallback", "Replace"}:
            return "sentencepiece"
    vocab = tokenizer.get_vocab()
    byte_level = sum(token.startswith("Ġ") for token in vocab)
    marker = sum(token.startswith(SPACE_MARKER) for token in vocab)
    return "byte_level" if byte_level > marker else "sentencepiece"


def _decoder_types(decoder: dict[str, Any] | None) -> set[str]:
    if not decoder:
        return set()
    types = {decoder.get("type", "")}
    for child in decoder.get("decoders") or ():
        types |= _decoder_types(child)
    return types


def vocabulary_bytes(
    tokenizer: Any, eos_token_ids: tuple[int, ...], vocab_size: int
) -> dict[bytes, list[int]]:
    """Map each token's decoded bytes to its ids (several ids may share bytes, e.g. `<0x41>` and
    `A`). Special tokens, EOS ids, ids outside the logits, empty tokens and tokens holding a
    NUL byte (the end mark) are left out; non-special added tokens stand for their text."""
    decode = _byte_level_decoder() if token_style(tokenizer) == "byte_level" else _sp_decode
    added = tokenizer.added_tokens_decoder
    skip = set(eos_token_ids) | set(tokenizer.all_special_ids)
    skip |= {i for i, token in added.items() if token.special}
    out: dict[bytes, list[int]] = {}
    for token, token_id in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        if token_id in skip or token_id >= vocab_size:
            continue
        data = token.encode() if token_id in added else decode(token)
        if data and END_MARK not in data:
            out.setdefault(data, []).append(token_id)
    return out


def _byte_level_decoder() -> Any:
    table = gpt2_unicode_to_byte()

    def decode(token: str) -> bytes:
        if all(char in table for char in token):
            return bytes(table[char] for char in token)
        return token.encode()  # not byte-encoded (should not happen in a byte-level vocab)

    return decode


def _sp_decode(token: str) -> bytes:
    match = _BYTE_TOKEN.fullmatch(token)
    if match:
        return bytes([int(match.group(1), 16)])
    return token.replace(SPACE_MARKER, " ").encode()


@dataclass
class _Tokens:
    """What jump-forward needs of the vocabulary: each id's bytes, its first byte (-1: none),
    the one-byte tokens, and the tokenizer (bytes -> ids, None where it cannot say)."""

    spelling: list[bytes]
    first_byte: np.ndarray  # (end_token + 1,) int16
    byte_token: dict[int, int]
    tokenize: Any

    @classmethod
    def build(cls, token_ids: dict[bytes, list[int]], size: int, tokenizer: Any) -> _Tokens:
        spelling = [b""] * size
        byte_token: dict[int, int] = {}
        for data, ids in token_ids.items():
            for token_id in ids:
                if token_id < size:
                    spelling[token_id] = data
            if len(data) == 1 and data != END_MARK:
                byte_token[data[0]] = min(ids)
        first = np.array([data[0] if data else -1 for data in spelling], dtype=np.int16)

        def tokenize(data: bytes) -> list[int] | None:
            try:
                return tokenizer.encode(data.decode(), add_special_tokens=False)
            except UnicodeDecodeError:
                return None

        return cls(spelling, first, byte_token, tokenize)

    def spell(self, tokens: list[int]) -> bytes:
        return b"".join(self.spelling[t] if 0 <= t < len(self.spelling) else b"" for t in tokens)


@dataclass
class _Compiled:
    """One compiled grammar shared by every request using it (read-only apart from the memos).

    The index is built for `(?:regex)\\x00`: the NUL byte is the end mark, a token
    (`end_token`) just past the mask row, and real tokens holding a NUL byte are left out of
    the vocabulary. The regex can end in a state exactly when the mark leads to a final state.
    Why: alone, outlines-core 0.2.14 drops every token whose text up to its last byte already
    completes the regex ("." after "12" for `[0-9]+(\\.[0-9]+)?`, "a" after "ab" for `(ab)+`)
    and, matching leftmost-first, prunes longer alternatives once a shorter one matched
    (`a b|a b c`). With the mark no real text completes the pattern, so nothing is dropped; the
    price is that no constrained output contains a NUL byte."""

    index: Index
    words: int
    eos_token_ids: tuple[int, ...]
    end_token: int
    write_words: int  # outlines-core wants ceil(len(vocabulary) / 32) words, at times one more
    tokens: _Tokens | None = None  # None: no jump-forward
    can_end_memo: dict[int, bool] = field(default_factory=dict)
    terminal_memo: dict[int, bool] = field(default_factory=dict)
    forced_memo: dict[int, tuple[int, int] | None] = field(default_factory=dict)

    def can_end(self, state: int) -> bool:
        result = self.can_end_memo.get(state)
        if result is None:
            after_mark = self.index.get_next_state(state, self.end_token)  # R may hold NUL
            result = after_mark is not None and self.index.is_final_state(after_mark)
            self.can_end_memo[state] = result
        return result

    def is_terminal(self, state: int) -> bool:
        """The regex is complete and no token but EOS may follow."""
        result = self.terminal_memo.get(state)
        if result is None:
            result = self.can_end(state)  # listing a state's tokens costs up to ~1 ms
            result = result and self.index.get_allowed_tokens(state) == [self.end_token]
            self.terminal_memo[state] = result
        return result

    def forced_byte(self, state: int) -> tuple[int, int] | None:
        """(byte, state after it) where every token allowed at `state` starts with the same
        byte and the regex may not end there; else None. Memoised: listing a state's tokens
        costs up to ~1 ms."""
        if state in self.forced_memo:
            return self.forced_memo[state]
        result = None
        if self.tokens is not None and not self.can_end(state):
            allowed = np.asarray(self.index.get_allowed_tokens(state), dtype=np.int64)
            firsts = np.unique(self.tokens.first_byte[allowed[allowed < self.end_token]])
            token = self.tokens.byte_token.get(int(firsts[0])) if len(firsts) == 1 else None
            after = None if token is None else self.index.get_next_state(state, token)
            if firsts[0] >= 0 and after is not None:
                result = (int(firsts[0]), after)
        self.forced_memo[state] = result
        return result


class Grammar:
    """One request's position in a compiled grammar; never shared between requests.

    Mutates: `accept` advances this object's state only; `fill_mask` writes only the row it is
    given; the compiled index is shared and never changed. Raises: `accept` raises GrammarError
    for a token the current state forbids (EOS before the grammar may end, anything after EOS).
    """

    def __init__(self, compiled: _Compiled) -> None:
        self._compiled = compiled
        self._guide = Guide(compiled.index)
        self._ended = False
        self._before: int | None = None  # the state before the last token advanced over

    @property
    def words(self) -> int:
        return self._compiled.words

    def fill_mask(self, row: np.ndarray) -> None:
        """Overwrite `row` (int32, `words` words) with the allowed tokens of the current state;
        EOS ids are set only where the grammar may end (and once it has ended, only they are)."""
        assert row.dtype == np.int32 and row.shape == (self.words,), f"{row.dtype=} {row.shape=}"
        assert row.flags.c_contiguous, "mask row must be contiguous"
        if self._ended:
            row.fill(0)
        elif self._compiled.write_words == self.words:
            self._guide.write_mask_into(row.ctypes.data, row.size, 4)  # skips end_token
        else:
            scratch = np.empty(self._compiled.write_words, dtype=np.int32)
            self._guide.write_mask_into(scratch.ctypes.data, scratch.size, 4)
            row[:] = scratch[: self.words]
        if self._ended or self._compiled.can_end(self._guide.get_state()):
            bits = row.view(np.uint32)
            for token_id in self._compiled.eos_token_ids:
                bits[token_id >> 5] |= np.uint32(1 << (token_id & 31))

    def accept(self, token_id: int) -> None:
        """Advance past `token_id`; EOS in a final state ends the grammar."""
        if self._ended:
            raise GrammarError(f"token {token_id} after the grammar ended")
        if not 0 <= token_id < self._compiled.end_token:
            raise GrammarError(f"token {token_id} is outside the vocabulary")
        if token_id in self._compiled.eos_token_ids:
            if not self._compiled.can_end(self._guide.get_state()):
                raise GrammarError(f"EOS token {token_id} before the grammar can end")
            self._ended = True
            return
        try:
            before = self._guide.get_state()
            self._guide.advance(token_id, return_tokens=False)
            self._before = before
        except ValueError as e:
            raise GrammarError(f"token {token_id} is not allowed by the grammar here") from e

    def is_terminated(self) -> bool:
        """True once EOS was accepted or when nothing but EOS may follow."""
        return self._ended or self._compiled.is_terminal(self._guide.get_state())

    def forced_tokens(self, last: int | None) -> Jump:
        """The jump at this state (runtime/constrained/jump_forward.py): the bytes every
        allowed token agrees on, walked through one-byte tokens, tokenized by the tokenizer
        (with `last`, the last accepted token, in front where that merges), the last token
        held back unless the regex is complete after them. Leaves the state as it was."""
        compiled, tokens = self._compiled, self._compiled.tokens
        if self._ended or tokens is None:
            return NO_JUMP
        state, forced = self._guide.get_state(), bytearray()
        while len(forced) < MAX_FORCED_BYTES and (step := compiled.forced_byte(state)):
            forced.append(step[0])
            state = step[1]
        text = utf8_prefix(bytes(forced))
        if not text:
            return NO_JUMP
        complete = len(text) == len(forced) and compiled.is_terminal(state)
        standalone = tokens.tokenize(text) or []
        if not complete:
            standalone = standalone[:-1]
        start = self._guide.get_state()
        if tokens.spell(standalone) != text[: len(tokens.spell(standalone))]:
            standalone = []  # e.g. a tokenizer that adds a leading space
        if not self._walks(start, standalone):
            standalone = []
        before = self._before

        def accepts(merged: list[int]) -> bool:
            return before is not None and self._walks(before, merged)

        return natural_jump(
            text, standalone, last, tokens.spell, tokens.tokenize, accepts, not complete
        )

    def _walks(self, state: int, tokens: list[int]) -> bool:
        index = self._compiled.index
        for token in tokens:
            state = index.get_next_state(state, token)
            if state is None:
                return False
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (never past EOS)."""
        assert not self._ended, "rollback after EOS"
        self._guide.rollback_state(num_tokens)
        self._before = None

    def copy(self) -> Grammar:
        """A fresh Grammar at the start state sharing the compiled index."""
        return Grammar(self._compiled)


class GrammarBackend:
    """Compiles grammar keys in worker processes and hands out fresh per-request Grammars.

    Keys are `("regex", pattern)`, `("json", schema JSON text)` or `("choices", JSON list of
    strings)`. Mutates: an LRU cache of `cache_size` compiled indexes or GrammarErrors (failures
    are cached so repeats fail fast) and the table of compilations in flight, both under a lock,
    so any thread may call. A compilation past `timeout_s` fails (cached like any error).
    Raises: `get` raises the key's GrammarError (TimeoutError past its own timeout); `poll`
    returns the GrammarError instead of raising it.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        whitespace_pattern: str | None = None,
        max_workers: int = 2,
        cache_size: int = 256,
        timeout_s: float = 60.0,
    ) -> None:
        assert eos_token_ids, "a grammar needs at least one EOS id"
        assert all(0 <= t < vocab_size for t in eos_token_ids), f"{eos_token_ids=} {vocab_size=}"
        assert cache_size >= 1, f"{cache_size=}"
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)
        self.eos_token_ids = tuple(eos_token_ids)
        self.cache_size = cache_size
        token_ids = vocabulary_bytes(tokenizer, self.eos_token_ids, vocab_size)
        self.end_token = 32 * self.words  # just past the mask row: never written, never sampled
        token_ids[END_MARK] = [self.end_token]
        vocabulary_len = len(Vocabulary(self.eos_token_ids[0], token_ids))
        self._write_words = max(self.words, -(-vocabulary_len // 32))
        self._tokens = _Tokens.build(token_ids, self.end_token + 1, tokenizer)
        self._pool = CompilerPool(
            token_ids, self.eos_token_ids[0], whitespace_pattern, max_workers, timeout_s
        )
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarKey, _Compiled | GrammarError] = OrderedDict()
        self._pending: dict[GrammarKey, Future[Index | GrammarError]] = {}

    def submit(self, key: GrammarKey) -> None:
        """Start compiling `key` unless it is cached or already compiling."""
        with self._lock:
            if key not in self._cache and key not in self._pending:
                self._pending[key] = self._pool.submit(key)

    def poll(self, key: GrammarKey) -> Grammar | GrammarError | None:
        """A fresh Grammar when `key` is compiled, its cached GrammarError if it failed, None
        while it compiles (submitting it first if nobody did)."""
        with self._lock:
            entry = self._lookup(key)
        if entry is None or isinstance(entry, GrammarError):
            return entry
        return Grammar(entry)

    def get(self, key: GrammarKey, timeout: float | None = None) -> Grammar:
        """Block until `key` is compiled; return a fresh Grammar or raise its GrammarError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            result = self.poll(key)
            if isinstance(result, GrammarError):
                raise result
            if result is not None:
                return result
            with self._lock:
                future = self._pending.get(key)
            if future is None:
                continue  # collected by another thread meanwhile
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                future.result(left)  # never raises a grammar problem: it is the result
            except FutureTimeoutError as e:
                raise TimeoutError(f"{key[0]} grammar not compiled within {timeout} s") from e

    def shutdown(self) -> None:
        """Stop the workers; compilations in flight or queued fail."""
        self._pool.shutdown()

    def _lookup(self, key: GrammarKey) -> _Compiled | GrammarError | None:
        future = self._pending.get(key)
        if future is not None:
            if not future.done():
                return None
            del self._pending[key]
            result = future.result()
            self._cache[key] = result if isinstance(result, GrammarError) else self._wrap(result)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        elif key not in self._cache:
            self._pending[key] = self._pool.submit(key)
            return None
        self._cache.move_to_end(key)
        return self._cache[key]

    def _wrap(self, index: Index) -> _Compiled:
        return _Compiled(
            index, self.words, self.eos_token_ids, self.end_token, self._write_words, self._tokens
        )
