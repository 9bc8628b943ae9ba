"""The llguidance grammar backend (`--grammar-backend llguidance`), torch-free.

llguidance (a Rust library, no dependencies of its own) parses lazily: a grammar "compiles" in
about a millisecond (outlines-core builds a DFA over the whole vocabulary first: seconds, tens
of seconds for nested JSON), and each mask is computed as the request advances, in tens of
microseconds. It takes the same grammar keys as the outlines-core backend and more:
  ("regex", pattern)      ("json", schema JSON text; numeric bounds honoured, any nesting;
                           objects that list their properties are closed, as outlines-core's;
                           integers without bounds get JSON's safe range)
  ("choices", JSON list)  ("ebnf", GBNF text, SGLang's `ebnf`; Lark syntax is taken too)
Same interface as `grammar.GrammarBackend`: submit / poll / get / shutdown, per-request
grammars with words / fill_mask / accept / is_terminated / copy, and forced_tokens / rollback
for jump-forward (llguidance's fast-forward tokens).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from radixflow.runtime.constrained.compiler import GrammarError, GrammarKey
from radixflow.runtime.constrained.jump_forward import NO_JUMP, Jump, natural_jump
from radixflow.runtime.constrained.schema_regex import closed, safe_integers

log = logging.getLogger(__name__)
# The canonical JSON layout (no whitespace pattern given): `json.dumps`'s separators and no
# other whitespace, the layout outlines-core's regexes get (schema_regex.canonical_layout).
CANONICAL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_spec(key: GrammarKey, whitespace: str | None) -> str:
    """llguidance's grammar text for a key; GrammarError naming what is wrong."""
    kind, text = key
    matcher = llguidance.LLMatcher
    if kind == "regex":
        return matcher.grammar_from_regex(text)
    if kind == "choices":
        options = _choices(text)
        return matcher.grammar_from_regex("|".join(re.escape(o) for o in options))
    if kind == "json":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise GrammarError(f"invalid JSON schema: not valid JSON ({e})") from e
        defaults = CANONICAL_JSON if whitespace is None else {"whitespace_pattern": whitespace}
        return matcher.grammar_from_json_schema(safe_integers(closed(schema)), defaults=defaults)
    if kind == "ebnf":
        try:
            return matcher.grammar_from_lark(any_to_lark(text))
        except GbnfToLarkError as e:
            raise GrammarError(f"invalid EBNF grammar: {e}") from e
    raise GrammarError(f"unknown grammar kind {kind!r} (expected regex, json, choices or ebnf)")


def _choices(text: str) -> list[str]:
    try:
        options = json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"invalid choices: not valid JSON ({e})") from e
    if not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options):
        raise GrammarError("choices must be a non-empty list of strings")
    return options


class LlgGrammar:
    """One request's matcher; never shared. Mutates: `accept` advances it; `fill_mask` writes
    only the row it is given. Raises GrammarError for a token the grammar forbids."""

    def __init__(self, backend: LlgBackend, spec: str) -> None:
        self._backend, self._spec = backend, spec
        self._matcher = llguidance.LLMatcher(backend.tokenizer, spec, log_level=0)

    @property
    def words(self) -> int:
        return self._backend.words

    def fill_mask(self, row: np.ndarray) -> None:
        assert row.dtype == np.int32 and row.shape == (self.words,), f"{row.dtype=} {row.shape=}"
        assert row.flags.c_contiguous, "mask row must be contiguous"
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def accept(self, token_id: int) -> None:
        if self._matcher.is_stopped() and token_id not in self._backend.eos_token_ids:
            raise GrammarError(f"token {token_id} after the grammar ended")
        # try_consume leaves the matcher as it was on a refusal (consume_token would put it in
        # an error state for good): a refused speculative draft must not end the grammar
        if self._matcher.try_consume_tokens([token_id]) != 1:
            raise GrammarError(f"token {token_id} is not allowed by the grammar here")

    def is_terminated(self) -> bool:
        """True once EOS was accepted or when nothing but EOS may follow."""
        return self._matcher.is_stopped()

    def forced_tokens(self, last: int | None) -> Jump:
        """The jump at this state (runtime/constrained/jump_forward.py): llguidance's
        fast-forward tokens (forced bytes tokenized, the last token held back where the text
        after it is free), with `last` (the last accepted token) tokenized again in front of
        them. Leaves the state as it was."""
        matcher, view = self._matcher, self._backend.tokenizer
        if matcher.is_stopped():
            return NO_JUMP
        standalone = matcher.compute_ff_tokens()
        if not standalone:
            return NO_JUMP

        def accepts(tokens: list[int]) -> bool:
            matcher.rollback(1)
            taken = matcher.try_consume_tokens(tokens)
            matcher.rollback(taken)
            assert matcher.try_consume_tokens([last]) == 1, "could not restore the matcher"
            return taken == len(tokens)

        return natural_jump(
            view.decode_bytes(standalone),
            standalone,
            last,
            view.decode_bytes,
            view.tokenize_bytes,
            accepts,
            hold_back_last=False,  # the merged text ends where llguidance's cut ended
        )

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        assert self._matcher.rollback(num_tokens), f"cannot roll back {num_tokens} tokens"

    def copy(self) -> LlgGrammar:
        """A fresh grammar at the start."""
        return LlgGrammar(self._backend, self._spec)


class LlgBackend:
    """Grammar keys to per-request matchers. A key's grammar is built and validated once and
    cached (LRU, failures too); building takes about a millisecond, so it happens in the
    caller's thread and `poll` never returns None."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        whitespace_pattern: str | None = None,
        cache_size: int = 256,
    ) -> None:
        assert eos_token_ids, "a grammar needs at least one EOS id"
        self.vocab_size, self.words = vocab_size, -(-vocab_size // 32)
        self.eos_token_ids = tuple(eos_token_ids)
        self.whitespace = whitespace_pattern
        self._hf_tokenizer = tokenizer
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarKey, str | GrammarError] = OrderedDict()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary: built once (0.4 s for SmolLM2's 49k tokens),
        shared by the backends of one tokenizer (engines made by `with_config` share theirs).
        A caller arriving while `prepare`'s thread builds it waits for that build."""
        with _VIEW_LOCK:
            return _llg_tokenizer(self._hf_tokenizer, self.vocab_size, self.eos_token_ids)

    def prepare(self) -> threading.Thread:
        """Build the vocabulary view now, in a background thread, so that the first constrained
        request does not wait for it; -> the thread."""

        def build() -> None:
            try:
                self.tokenizer  # noqa: B018 (the property builds and caches the view)
            except Exception as e:  # noqa: BLE001 (the first grammar request raises it again)
                log.warning("llguidance could not read this tokenizer's vocabulary: %s", e)

        thread = threading.Thread(target=build, name="llg-vocabulary", daemon=True)
        thread.start()
        return thread

    def submit(self, key: GrammarKey) -> None:
        self._spec(key)

    def poll(self, key: GrammarKey) -> LlgGrammar | GrammarError:
        spec = self._spec(key)
        return spec if isinstance(spec, GrammarError) else LlgGrammar(self, spec)

    def get(self, key: GrammarKey, timeout: float | None = None) -> LlgGrammar:
        result = self.poll(key)
        if isinstance(result, GrammarError):
            raise result
        return result

    def shutdown(self) -> None:
        """Nothing runs in the background."""

    def _spec(self, key: GrammarKey) -> str | GrammarError:
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            spec = grammar_spec(key, self.whitespace)
            problem = llguidance.LLMatcher.validate_grammar(spec)
            name = {"json": "JSON schema"}.get(key[0], key[0])
            result: str | GrammarError = (
                GrammarError(f"invalid {name}: {problem.strip()}") if problem else spec
            )
        except GrammarError as e:
            result = e
        except (ValueError, TypeError, RuntimeError) as e:  # llguidance's own build errors
            result = GrammarError(f"invalid {key[0]} grammar: {e}")
        with self._lock:
            self._cache[key] = result
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return result


_VIEW_LOCK = threading.Lock()  # one build of a vocabulary view at a time


@functools.lru_cache(maxsize=4)
def _llg_tokenizer(tokenizer: Any, vocab_size: int, eos: tuple[int, ...]) -> Any:
    base = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos))
    decoder = getattr(tokenizer, "added_tokens_decoder", {})
    plain = {i: t.content for i, t in decoder.items() if not t.special and i < vocab_size}
    if not plain:
        return base
    # llguidance counts every added token as special, also those the tokenizer marks plain
    # text (Qwen's <tool_call>, <think>): its masks then allow such a token where a grammar
    # spells the tag, but accepting it fails, which aborted Qwen's constrained tool calls.
    # Rebuilt from the token bytes, with only the truly special ids marked special.
    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_PlainAddedTokens(tokenizer, base, plain, vocab_size, eos)),
        n_vocab=vocab_size,
        eos_token=list(eos),
    )


class _PlainAddedTokens:
    """What llguidance's TokenizerWrapper reads: every token's bytes, the special ids, and
    the tokenizer itself (it tokenizes the text a grammar forces)."""

    def __init__(
        self, hf: Any, base: Any, plain: dict[int, str], vocab_size: int, eos: tuple[int, ...]
    ) -> None:
        self.hf = hf
        self.tokens = [
            plain[i].encode() if i in plain else base.decode_bytes([i]) for i in range(vocab_size)
        ]
        self.special_token_ids = [
            i for i in range(vocab_size) if i not in plain and base.is_special_token(i)
        ]
        self.eos_token_id, self.bos_token_id = eos[0], hf.bos_token_id

    def __call__(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)
