"""Triggered (lazy) constraints: free text until a trigger, then a grammar (torch-free).

One mechanism serves three features:
  * `tool_choice: "auto"` with a template format: the reply is free until it writes the
    format's start tag (`<tool_call>`, `[TOOL_CALLS]`, a reply opening with `{`); the rest of
    the call is generated under the tools' grammar through its end tag, then it is free again
    (or must end, `stop_after_first`).
  * reasoning: with a reasoning parser, a request's constraint starts after `</think>`.
  * SGLang's `structural_tag` (sampling parameter, or OpenAI's response_format).

The grammar key is ("structural_tag", JSON text): SGLang's structural tag,
    {"type": "structural_tag", "triggers": ["<function="],
     "structures": [{"begin": "<function=f>", "schema": {...}, "end": "</function>"}, ...]}
(each begin starts with a trigger; once a trigger is written, the structures whose begin
starts with it constrain what follows: the rest of the begin, the JSON, the end), and
or xgrammar's newer form, {"type": "structural_tag", "format": {"type": "triggered_tags",
"triggers": [...], "tags": [{"begin", "content": {"type": "json_schema", ...}, "end"}]}}
(`from_format` translates it), and radixflow's additions:
    structure "regex" / "ebnf"   instead of "schema" (ebnf only where begin is the trigger and
                                 end is empty: the body's own grammar, no text around it)
    "after": text                nothing is watched until the output contains it ("</think>")
    "at_start": bool             a trigger counts only at the start (after whitespace; after
                                 `after`): llama3's reply is a call only if it opens with "{"
    "stop_after_first": bool     once a structure is complete only EOS may follow (xgrammar's
                                 name)
    trigger ""                   fires at once (at the start, or right after `after`)
A structure ends when its grammar admits nothing more (an end tag); one that may always go on
(a number with no end text) holds until EOS, which its grammar allows where it may end.

Why a runtime trigger rather than one grammar with a free-text region (llguidance's Lark could
say "any text, then <tool_call> JSON"): it works with every backend (outlines-core compiles
"any text without <tool_call>" into a DFA over the whole vocabulary: slow, and large for each
tool set); free text costs no grammar work per token (an all-ones mask row less a precomputed
ban list); and the grammar after a trigger is the same key `tool_choice: "required"` uses, so
it is compiled and cached once. The output is watched as bytes (the token table below). A
token that would run past a trigger (`{"` when the trigger is `{`, or `>\\n` completing
`<tool_call>`) is masked out of free text, so a grammar always starts at a token boundary and
never has to take half a token. A request holds no worker or process of its own: its inner
grammars are plain objects, dropped with the request (abort included).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from radixflow.runtime.constrained.compiler import (
    GrammarError,
    GrammarKey,
    json_schema_regex,
    strip_anchors,
)
from radixflow.runtime.constrained.grammar import vocabulary_bytes

KIND = "structural_tag"  # the grammar key's kind, SGLang's sampling parameter name
WHITESPACE = b" \t\r\n"
BODIES = ("schema", "regex", "ebnf")


@dataclass(frozen=True)
class TriggerSpec:
    triggers: tuple[tuple[str, GrammarKey], ...]  # (trigger text, what follows it)
    after: str = ""
    at_start: bool = False
    stop_after_first: bool = False


def parse_spec(text: str, whitespace: str | None = None) -> TriggerSpec:
    """A structural tag's JSON text as triggers and their grammar keys; GrammarError naming
    what is wrong."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"invalid structural_tag: not valid JSON ({e})") from e
    if not isinstance(spec, dict) or spec.get("type", KIND) != KIND:
        raise GrammarError('structural_tag must be {"type": "structural_tag", ...}')
    if "format" in spec:  # xgrammar's newer form, as SGLang passes it through
        spec = {**from_format(spec["format"]), "after": spec.get("after", "")}
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(structures, list) or not structures or not _strings(triggers):
        raise GrammarError("structural_tag needs a non-empty list of structures and triggers")
    flags = {name: spec.get(name, False) for name in ("at_start", "stop_after_first")}
    after = spec.get("after", "")
    if not isinstance(after, str) or not all(isinstance(v, bool) for v in flags.values()):
        raise GrammarError("structural_tag: after is text, at_start and stop_after_first booleans")
    for i, s in enumerate(structures):
        ok = isinstance(s, dict) and _strings([s.get("begin"), s.get("end", "")])
        if not ok or sum(k in s for k in BODIES) != 1:
            raise GrammarError(
                f"structural_tag.structures[{i}] needs begin, end and one of {BODIES}"
            )
        if not any(s["begin"].startswith(t) for t in triggers):
            raise GrammarError(f"structural_tag.structures[{i}].begin starts with no trigger")
    keyed = []
    for trigger in dict.fromkeys(triggers):  # in order, once each
        # a structure belongs to its longest trigger ("<f" and "<f=a" both prefix "<f=a>")
        mine = [s for s in structures if _longest(s["begin"], triggers) == trigger]
        if mine:
            keyed.append((trigger, _key(trigger, mine, whitespace)))
    return TriggerSpec(tuple(keyed), after, **flags)


CONTENTS = {"json_schema": ("schema", "json_schema"), "regex": ("regex", "pattern"),
            "grammar": ("ebnf", "grammar")}  # fmt: skip
FORMATS = ("triggered_tags", "tag", "json_schema", "regex", "grammar", "const_string")


def from_format(fmt: Any) -> dict[str, Any]:
    """xgrammar's structural-tag `format` (the form SGLang and xgrammar document) as the
    structures-and-triggers form above:
      triggered_tags {triggers, tags: [tag], at_least_one, stop_after_first}
          -> the same triggers; at_least_one: the reply opens with a tag (trigger ""), and
             text after it is free unless stop_after_first
      tag {begin, content, end}  -> exactly that tag
      json_schema / regex / grammar / const_string -> exactly that content
    A tag's content is json_schema {json_schema}, regex {pattern}, grammar {grammar} (EBNF)
    or const_string {value}. Other format types (sequence, or, any_text, tags_with_separator)
    are refused by name."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in FORMATS:
        raise GrammarError(
            f"structural_tag.format.type {kind!r} is not supported; supported: {FORMATS}"
        )
    if kind == "triggered_tags":
        tags, triggers = fmt.get("tags"), fmt.get("triggers")
        if not isinstance(tags, list) or not tags or not _strings(triggers) or not triggers:
            raise GrammarError("structural_tag.format: triggered_tags needs triggers and tags")
        flags = {k: fmt.get(k, False) for k in ("at_least_one", "stop_after_first")}
        if not all(isinstance(v, bool) for v in flags.values()):
            raise GrammarError("structural_tag.format: at_least_one, stop_after_first booleans")
        structures = [_tag(t, f"tags[{i}]") for i, t in enumerate(tags)]
        return {"structures": structures, "triggers": [""] if flags["at_least_one"] else triggers,
                "stop_after_first": flags["stop_after_first"]}  # fmt: skip
    whole = fmt if kind == "tag" else {"begin": "", "content": fmt, "end": ""}
    return {"structures": [_tag(whole, "format")], "triggers": [""], "stop_after_first": True}


def _tag(tag: Any, where: str) -> dict[str, Any]:
    """One xgrammar tag {begin, content, end} as a structure."""
    ok = isinstance(tag, dict) and _strings([tag.get("begin"), tag.get("end", "")])
    content = tag.get("content") if ok else None
    kind = content.get("type") if isinstance(content, dict) else None
    end = tag.get("end", "") if ok else ""
    if kind == "const_string" and isinstance(content.get("value"), str):
        return {"begin": tag["begin"], "regex": re.escape(content["value"]), "end": end}
    if not ok or kind not in CONTENTS or CONTENTS[kind][1] not in content:
        raise GrammarError(
            f"structural_tag.format.{where} needs begin, end and a content of type "
            "json_schema, regex, grammar or const_string"
        )
    body, field = CONTENTS[kind]
    return {"begin": tag["begin"], body: content[field], "end": end}


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _longest(begin: str, triggers: list[str]) -> str:
    return max((t for t in triggers if begin.startswith(t)), key=len)


def _key(trigger: str, structures: list[dict], whitespace: str | None) -> GrammarKey:
    """What follows `trigger`: the body's own key when nothing surrounds it, else one regex."""
    first = structures[0]
    if len(structures) == 1 and first["begin"] == trigger and not first.get("end"):
        if "schema" in first:
            return ("json", json.dumps(first["schema"]))
        return ("ebnf", first["ebnf"]) if "ebnf" in first else ("regex", first["regex"])
    parts = []
    for s in structures:
        if "ebnf" in s:
            raise GrammarError("structural_tag: an ebnf structure takes no text around it")
        body = strip_anchors(s["regex"]) if "regex" in s else None
        if "schema" in s:
            body = json_schema_regex(json.dumps(s["schema"]), whitespace)
        rest, end = re.escape(s["begin"][len(trigger) :]), re.escape(s.get("end", ""))
        parts.append(f"{rest}(?:{body}){end}")
    return ("regex", "|".join(f"(?:{p})" for p in parts))


class TokenTable:
    """Each token's bytes (special tokens none, as the scheduler's decode skips them), and the
    tokens that would run past a trigger, per trigger (cached)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.words = -(-vocab_size // 32)
        self.eos_token_ids = tuple(eos_token_ids)
        self.data = [b""] * vocab_size
        for data, ids in vocabulary_bytes(tokenizer, self.eos_token_ids, vocab_size).items():
            for token in ids:
                self.data[token] = data
        self._by_first: dict[int, list[int]] = {}
        for token, data in enumerate(self.data):
            if data:
                self._by_first.setdefault(data[0], []).append(token)
        self._lock = threading.Lock()
        self._bans: dict[bytes, list[tuple[np.ndarray, np.ndarray]]] = {}

    def bans(self, trigger: bytes) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per k < len(trigger): (words, cleared bits) of the tokens that, after output ending
        in trigger[:k], complete the trigger and go on past it (k = 0: hold it whole and more)."""
        with self._lock:
            if trigger not in self._bans:
                self._bans[trigger] = [self._ban(trigger, k) for k in range(len(trigger))]
            return self._bans[trigger]

    def _ban(self, trigger: bytes, k: int) -> tuple[np.ndarray, np.ndarray]:
        if k == 0:
            ids = [t for t, d in enumerate(self.data) if trigger in d and _runs_past(d, trigger)]
        else:
            rest = trigger[k:]
            ids = [t for t in self._by_first.get(rest[0], ()) if self.data[t].startswith(rest)]
            ids = [t for t in ids if len(self.data[t]) > len(rest)]
        array = np.array(ids, dtype=np.int64)
        return array >> 5, ~(np.uint32(1) << (array & 31).astype(np.uint32))


def _runs_past(data: bytes, trigger: bytes) -> bool:
    """Some occurrence of `trigger` in `data` ends before `data` does."""
    at = data.find(trigger)
    return at >= 0 and at + len(trigger) < len(data)


class TriggeredGrammar:
    """One request's triggered constraint; the Grammar interface (words, fill_mask, accept,
    is_terminated, forced_tokens, copy). Mutates: `accept` advances this object (and its
    active inner grammar) only; `fill_mask` writes only its row. Raises GrammarError for a
    token the active grammar forbids, or any token once a `stop_after_first` structure is
    complete."""

    def __init__(self, spec: TriggerSpec, grammars: dict[str, Any], table: TokenTable) -> None:
        self.spec, self._grammars, self._table = spec, grammars, table
        self._triggers = [t.encode() for t, _ in spec.triggers if t]
        self._after = spec.after.encode()
        self._tail = b""  # output bytes since the watch began (bounded)
        self._watching = not spec.after  # False: waiting for `after`
        self._dead = False  # at_start and the output began otherwise: free for good
        self._active: Any = None  # the inner grammar of a structure being written
        self._done = False
        if self._watching:
            self._begin()

    @property
    def words(self) -> int:
        return self._table.words

    def _begin(self) -> None:
        self._watching, self._tail = True, b""
        if "" in self._grammars:
            self._active = self._grammars[""].copy()

    def fill_mask(self, row: np.ndarray) -> None:
        if self._active is not None:
            self._active.fill_mask(row)
            return
        if self._done:
            row.fill(0)
            bits = row.view(np.uint32)
            for token in self._table.eos_token_ids:
                bits[token >> 5] |= np.uint32(1 << (token & 31))
            return
        row.fill(-1)
        bits = row.view(np.uint32)
        if not self._watching:
            self._ban(bits, self._after, self._tail)
        elif not self._dead:
            tail = self._tail.lstrip(WHITESPACE) if self.spec.at_start else self._tail
            for trigger in self._triggers:
                self._ban(bits, trigger, tail)

    def _ban(self, bits: np.ndarray, trigger: bytes, tail: bytes) -> None:
        for k, (words, cleared) in enumerate(self._table.bans(trigger)):
            if words.size and (k == 0 or tail.endswith(trigger[:k])):
                np.bitwise_and.at(bits, words, cleared)

    def accept(self, token: int) -> None:
        if self._done:
            raise GrammarError(f"token {token} after the structure ended")
        if self._active is not None:
            self._active.accept(token)
            if self._active.is_terminated():
                self._active, self._tail = None, b""
                self._done = self.spec.stop_after_first
                self._dead = self.spec.at_start  # a trigger only at the start: it was used
            return
        data = self._table.data[token] if 0 <= token < len(self._table.data) else b""
        if not data or self._dead:
            return
        self._tail += data
        if not self._watching:
            if self._found(self._after):
                self._begin()
            else:
                self._tail = self._tail[-len(self._after) :]
        elif self.spec.at_start:
            body = self._tail.lstrip(WHITESPACE)
            fired = next((t for t in self._triggers if body == t), None)
            if fired is not None:
                self._fire(fired)
            elif body and not any(t.startswith(body) for t in self._triggers):
                self._dead = True
        else:
            fired = next((t for t in self._triggers if self._found(t)), None)
            if fired is not None:
                self._fire(fired)
            else:
                self._tail = self._tail[-max(map(len, self._triggers), default=1) :]

    def _found(self, trigger: bytes) -> bool:
        at = self._tail.find(trigger)
        if at >= 0 and at + len(trigger) != len(self._tail):  # fill_mask bans such tokens
            raise GrammarError(f"a token ran past the trigger {trigger.decode(errors='replace')}")
        return at >= 0

    def _fire(self, trigger: bytes) -> None:
        self._active, self._tail = self._grammars[trigger.decode()].copy(), b""

    def is_terminated(self) -> bool:
        return self._done

    def forced_tokens(self, last: int | None) -> tuple[int, list[int]]:
        """Inside a structure, its grammar's forced tokens; never a replacement of `last`
        (the trigger watch has seen it), so `rollback` is never asked for."""
        if self._active is None:
            return 0, []
        return 0, self._active.forced_tokens(None)[1]

    def copy(self) -> TriggeredGrammar:
        """A fresh grammar at the start."""
        return TriggeredGrammar(self.spec, self._grammars, self._table)


class TriggeredBackend:
    """A grammar backend (outlines-core's or llguidance's) that also takes
    ("structural_tag", text) keys; every other key goes to `backend` unchanged. Same interface:
    submit / poll / get / shutdown. Mutates: an LRU of parsed specs (failures too) and, on the
    first structural tag, the token table (a pass over the vocabulary), both under a lock."""

    def __init__(
        self,
        backend: Any,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        whitespace_pattern: str | None = None,
        cache_size: int = 256,
    ) -> None:
        self.backend = backend
        self._table_args = (tokenizer, vocab_size, tuple(eos_token_ids))
        self._table: TokenTable | None = None
        self.whitespace, self.cache_size = whitespace_pattern, cache_size
        self._lock = threading.Lock()
        self._specs: OrderedDict[str, TriggerSpec | GrammarError] = OrderedDict()

    @property
    def table(self) -> TokenTable:
        with self._lock:
            if self._table is None:
                self._table = TokenTable(*self._table_args)
            return self._table

    def submit(self, key: GrammarKey) -> None:
        if key[0] != KIND:
            self.backend.submit(key)
            return
        spec = self._spec(key[1])
        for _, inner in () if isinstance(spec, GrammarError) else spec.triggers:
            self.backend.submit(inner)

    def poll(self, key: GrammarKey) -> Any:
        """A fresh grammar, a GrammarError, or None while an inner grammar compiles."""
        if key[0] != KIND:
            return self.backend.poll(key)
        spec = self._spec(key[1])
        if isinstance(spec, GrammarError):
            return spec
        grammars = {}
        for trigger, inner in spec.triggers:
            grammar = self.backend.poll(inner)
            if grammar is None or isinstance(grammar, Exception):
                return grammar
            grammars[trigger] = grammar
        return TriggeredGrammar(spec, grammars, self.table)

    def get(self, key: GrammarKey, timeout: float | None = None) -> Any:
        """Block until compiled; raise the key's GrammarError."""
        if key[0] != KIND:
            return self.backend.get(key, timeout)
        spec = self._spec(key[1])
        if isinstance(spec, GrammarError):
            raise spec
        for _, inner in spec.triggers:
            self.backend.get(inner, timeout)
        return self.poll(key)

    def shutdown(self) -> None:
        self.backend.shutdown()

    def _spec(self, text: str) -> TriggerSpec | GrammarError:
        with self._lock:
            if text in self._specs:
                self._specs.move_to_end(text)
                return self._specs[text]
        try:
            spec: TriggerSpec | GrammarError = parse_spec(text, self.whitespace)
        except GrammarError as e:
            spec = e
        with self._lock:
            self._specs[text] = spec
            while len(self._specs) > self.cache_size:
                self._specs.popitem(last=False)
        return spec
