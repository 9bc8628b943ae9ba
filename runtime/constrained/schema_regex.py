"""JSON schema -> regex, with the numeric bounds outlines-core leaves out (torch-free).

outlines-core turns a schema into a regex but ignores `minimum`, `maximum` and their exclusive
forms: `{"type": "integer", "maximum": 7}` admits 8. A reply that must validate (a tool call's
arguments, a strict response_format) needs them. Each bounded number is swapped for a string
constant placeholder before outlines-core sees the schema, and the placeholder's regex is then
replaced by a regex of exactly the numbers in range:
  integers  every integer in [lo, hi], no leading zeros;
  numbers   integers in range with an optional fraction of at most FRACTION_DIGITS digits,
            bounds rounded inward to integers (a subset of the valid numbers, never more).
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Callable
from typing import Any

FRACTION_DIGITS = 6
PLACEHOLDER = "__radixflow_number_{}__"
# The canonical layout (whitespace pattern None): Python's `json.dumps` separators, no other
# whitespace. outlines-core writes one whitespace pattern around every `{ } [ ] , :`; it is
# given this mark instead, and each marked place becomes its canonical text.
LAYOUT_MARK = "\x01ws\x01"
CANONICAL = (
    (f"{LAYOUT_MARK}:{LAYOUT_MARK}", ": "),
    # an object's comma: its mark after may sit past an optional property's `)?` or before
    # the next one's `(`; the space goes right after the comma
    (f"{LAYOUT_MARK},", ", "),
    (f",{LAYOUT_MARK}", ", "),  # an array's comma: outlines-core writes `,ws`
    (LAYOUT_MARK, ""),  # inside brackets, and an object comma's mark after it
)


def bounded_schema_regex(
    schema: dict[str, Any], build: Callable[[str, str | None], str], whitespace: str | None
) -> str:
    """`build(schema_json, whitespace)` (outlines-core's builder) with bounded numbers exact;
    whitespace None: the canonical layout (`canonical_layout`)."""
    ranges: list[str] = []
    patched = _patch(copy.deepcopy(schema), ranges)
    regex = canonical_layout(build, json.dumps(patched), whitespace)
    for i, number in enumerate(ranges):
        quoted = re.escape(json.dumps(PLACEHOLDER.format(i)))
        # outlines-core writes a string const as its JSON text with regex escapes
        candidates = [quoted, re.escape(PLACEHOLDER.format(i)).join(['"', '"'])]
        for text in candidates + [f'"{PLACEHOLDER.format(i)}"']:
            if text in regex:
                regex = regex.replace(text, f"({number})")
                break
        else:
            raise ValueError("a bounded number of the schema has no place in its regex")
    return regex


def canonical_layout(
    build: Callable[[str, str | None], str], schema: str, whitespace: str | None
) -> str:
    """`build(schema, whitespace)`; whitespace None: the regex of the documents laid out as
    `json.dumps` writes them (`{"a": [1, 2], "b": {}}`), which llguidance's JSON grammar with
    `whitespace_flexible` off and the same separators accepts too (llg_backend.grammar_spec):
    every separator is forced text, so jump-forward appends `", "age": ` whole."""
    if whitespace is not None:
        return build(schema, whitespace)
    regex = build(schema, LAYOUT_MARK)
    for marked, text in CANONICAL:
        regex = regex.replace(marked, text)
    return regex


def _patch(node: Any, ranges: list[str]) -> Any:
    """The schema with each bounded integer/number replaced by a placeholder constant."""
    if isinstance(node, list):
        return [_patch(x, ranges) for x in node]
    if not isinstance(node, dict):
        return node
    number = _bounded_number(node)
    if number is not None:
        ranges.append(number)
        return {"const": PLACEHOLDER.format(len(ranges) - 1)}
    return {k: (_patch(v, ranges) if k != "const" and k != "enum" else v) for k, v in node.items()}


def _bounded_number(node: dict[str, Any]) -> str | None:
    kind = node.get("type")
    keys = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
    if kind not in ("integer", "number") or not any(k in node for k in keys):
        return None
    lo, hi = _bounds(node, integer=kind == "integer")
    if lo > hi:
        raise ValueError(f"the schema's bounds leave no number: {node}")
    return integer_range(lo, hi) if kind == "integer" else number_range(lo, hi)


def _bounds(node: dict[str, Any], integer: bool) -> tuple[int, int]:
    """Integer bounds [lo, hi] inside the schema's (open ends at +-10**15); `integer` says
    whether only integers are valid (numbers' fractions are placed by number_range)."""
    lo, hi = -(10**15), 10**15
    number = (int, float)
    if isinstance(node.get("minimum"), number):
        lo = max(lo, math.ceil(node["minimum"]))
    if isinstance(node.get("exclusiveMinimum"), number):
        lo = max(lo, math.floor(node["exclusiveMinimum"]) + 1)
    if isinstance(node.get("maximum"), number):
        hi = min(hi, math.floor(node["maximum"]))
    if isinstance(node.get("exclusiveMaximum"), number):
        hi = min(hi, math.ceil(node["exclusiveMaximum"]) - 1)
    return lo, hi


def number_range(lo: int, hi: int) -> str:
    """Numbers in [lo, hi] (integer bounds): an integer in range, a fraction only where the
    value stays inside (below hi for positives, above lo for negatives)."""
    fraction = rf"(\.[0-9]{{1,{FRACTION_DIGITS}}})?"
    zeros = rf"(\.0{{1,{FRACTION_DIGITS}}})?"
    parts = []
    if hi >= 0:  # [max(lo, 0), hi]: fractions on all but hi
        start = max(lo, 0)
        if start <= hi - 1:
            parts.append(f"({_naturals(start, hi - 1)}){fraction}")
        parts.append(f"{hi}{zeros}" if start <= hi else "")
    if lo < 0:  # [lo, min(hi, -1)] written as -m: fractions on all but lo
        top, bottom = -min(hi, -1), -lo  # magnitudes [top, bottom]
        if hi >= 0:
            parts.append(rf"-0\.[0-9]{{1,{FRACTION_DIGITS}}}")  # (-1, 0)
        if top <= bottom - 1:
            parts.append(f"-({_naturals(top, bottom - 1)}){fraction}")
        parts.append(f"-{bottom}{zeros}")
    return "|".join(p for p in parts if p)


def integer_range(lo: int, hi: int) -> str:
    """The integers in [lo, hi] in JSON's notation."""
    parts = []
    if hi >= 0:
        parts.append(_naturals(max(lo, 0), hi))
    if lo < 0:
        parts.append(f"-({_naturals(max(-hi, 1), -lo)})")
    return "|".join(parts)


def _naturals(lo: int, hi: int) -> str:
    """The naturals in [lo, hi] (0 <= lo <= hi), without leading zeros."""
    assert 0 <= lo <= hi, f"{lo=} {hi=}"
    pieces = []
    while lo <= hi:  # split at powers of ten: each piece has one digit count
        top = min(hi, 10 ** len(str(lo)) - 1)
        pieces.append(_same_length(str(lo), str(top)))
        lo = top + 1
    return "|".join(pieces)


def _same_length(lo: str, hi: str) -> str:
    """Numbers from lo to hi, both of the same digit count."""
    if len(lo) == 1:
        return lo if lo == hi else f"[{lo}-{hi}]"
    if lo[0] == hi[0]:
        rest = _same_length(lo[1:], hi[1:])
        return f"{lo[0]}({rest})"
    parts = []
    nines, zeros = "9" * (len(lo) - 1), "0" * (len(lo) - 1)
    first, last = int(lo[0]), int(hi[0])
    if lo[1:] != zeros:
        parts.append(f"{lo[0]}({_same_length(lo[1:], nines)})")
        first += 1
    end = last if hi[1:] == nines else last - 1
    if first <= end:
        digit = str(first) if first == end else f"[{first}-{end}]"
        parts.append(digit + f"[0-9]{{{len(lo) - 1}}}")
    if hi[1:] != nines:
        parts.append(f"{hi[0]}({_same_length(zeros, hi[1:])})")
    return "|".join(parts)


def closed(schema: Any) -> Any:
    """The schema with `additionalProperties: false` wherever an object lists its properties
    and says nothing of others: what outlines-core and xgrammar (SGLang's default) do, and how
    OpenAI's strict mode reads a tool, so a reply holds the schema's keys, not a model's
    invented ones. Free-form objects ({"type": "object"}) stay open."""
    if isinstance(schema, list):
        return [closed(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k not in ("const", "enum", "default") else v for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


SAFE_INTEGER = 2**53 - 1  # JSON's interoperable integers (RFC 8259); llguidance takes this range


def safe_integers(schema: Any) -> Any:
    """The schema with every integer that has no bounds given JSON's safe-integer range
    (+-(2**53 - 1), what every JSON parser reads exactly): a small model no longer writes
    digits until max_tokens."""
    if isinstance(schema, list):
        return [safe_integers(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: safe_integers(v) if k not in ("const", "enum", "default") else v
           for k, v in schema.items()}  # fmt: skip
    if out.get("type") == "integer":
        out.setdefault("minimum", -SAFE_INTEGER)
        out.setdefault("maximum", SAFE_INTEGER)
    return out
