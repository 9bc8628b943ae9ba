"""Draft text for JSON-schema requests: the schema's skeleton (torch-free).

A request constrained by a JSON schema spends most of its tokens on text the schema fixes:
braces, quotes, the property names in order, the separators. The n-gram drafts
(runtime/scheduler/speculative.py) find that text only once some earlier output holds it; a request
whose schema nobody has used yet has nothing to draft from. `skeleton_segments` renders one
instance of the schema, in the two layouts models write (`{"a": 1}` and `{ "a": 1 }`), and
cuts it where the free values go (strings, numbers, booleans; enums and consts are text the
schema fixes and stay in): `{ "name": "`, `", "age": `, `, "city": "`, `" }`. Each segment is
a sequence of its own in the drafting table, so a draft runs to the next value and stops
there instead of guessing it.

A skeleton only proposes drafts; every draft is checked by the grammar and verified by the
model, so a skeleton that does not match what the model writes costs speed, never output.
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 8  # nesting (and $ref hops) rendered; deeper schemas get no skeleton
FREE, FREE_STRING = object(), object()  # values the model chooses
PLACEHOLDERS = {
    "string": FREE_STRING,
    "integer": FREE,
    "number": FREE,
    "boolean": FREE,
    "null": None,
}


class _NoSkeleton(Exception):
    pass


def skeleton_segments(schema: str) -> list[str]:
    """The schema's fixed text between its free values, in the compact and the spaced
    layout; [] when the schema is not an object schema this can render (the drafts then come
    from the n-gram tables alone)."""
    try:
        root = json.loads(schema)
        value = _instance(root, root, 0)
    except (ValueError, TypeError, RecursionError, _NoSkeleton):
        return []
    if not isinstance(value, dict):
        return []
    texts = (_render(value, spaced=False), _render(value, spaced=True))
    return [part for text in texts for part in text.split(_MARK) if part]


def _instance(schema: Any, root: dict, depth: int) -> Any:
    """One placeholder instance of `schema` (properties in declared order)."""
    if depth > MAX_DEPTH or not isinstance(schema, dict):
        raise _NoSkeleton
    if "$ref" in schema:
        return _instance(_resolve(schema["$ref"], root), root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            return _instance(schema[key][0], root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = kind[0] if kind else None
    if kind == "object" or (kind is None and "properties" in schema):
        props = schema.get("properties") or {}
        return {name: _instance(sub, root, depth + 1) for name, sub in props.items()}
    if kind == "array":
        items = schema.get("items")
        return [_instance(items, root, depth + 1)] if isinstance(items, dict) else []
    if kind in PLACEHOLDERS:
        return PLACEHOLDERS[kind]
    raise _NoSkeleton


def _resolve(ref: Any, root: dict) -> Any:
    """A local reference ("#/$defs/Name", "#/definitions/Name", "#")."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise _NoSkeleton
    node: Any = root
    for part in filter(None, ref[1:].split("/")):
        if not isinstance(node, dict) or part not in node:
            raise _NoSkeleton
        node = node[part]
    return node


_MARK = "\x00"  # where a free value goes (no JSON text holds a raw NUL)


def _render(value: Any, spaced: bool) -> str:
    """JSON with ", " and ": " separators, free values as _MARK (inside the quotes of a
    string); `spaced` also pads the inside of braces."""
    if value is FREE:
        return _MARK
    if value is FREE_STRING:
        return f'"{_MARK}"'
    if isinstance(value, dict):
        if not value:
            return "{}"
        body = ", ".join(f"{json.dumps(k)}: {_render(v, spaced)}" for k, v in value.items())
        return f"{{ {body} }}" if spaced else f"{{{body}}}"
    if isinstance(value, list):
        return "[" + ", ".join(_render(v, spaced) for v in value) + "]"
    return json.dumps(value)
