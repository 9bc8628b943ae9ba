"""JSON extraction with a schema: the runtime constrains decoding to the JSON schema, so the
output always parses and has the declared keys and types.

    python programs/json_extraction.py [--address tcp://...]
"""

from __future__ import annotations

import json
from typing import Any

import radixflow as sgl

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
TEXTS = [
    "Maria Lopez is a 34 year old engineer who lives in Madrid.",
    "Born 61 years ago, the painter Kenji Sato still works in his studio in Osaka.",
    "Our new neighbour, 27-year-old Tom Baker, just moved here from Leeds.",
]


@sgl.function
def extract_person(s: Any, text: str) -> None:
    s += sgl.user(f"Extract the person's name, age and city as JSON.\n\n{text}")
    s += sgl.assistant(sgl.gen("json", max_tokens=96, json_schema=json.dumps(SCHEMA)))


def conforms(value: Any, schema: dict[str, Any]) -> bool:
    """A small check of the schema subset used here: object keys, types and bounds."""
    kind = schema.get("type")
    if kind == "object":
        props = schema["properties"]
        return (
            isinstance(value, dict)
            and set(schema.get("required", [])) <= set(value)
            and (schema.get("additionalProperties", True) or set(value) <= set(props))
            and all(conforms(value[k], props[k]) for k in value if k in props)
        )
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "integer":
        low, high = schema.get("minimum", value), schema.get("maximum", value)
        return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
    return True


def main(backend: Any, texts: list[str] | None = None) -> list[dict[str, Any]]:
    """Extract one record per text (in parallel); each is parsed JSON."""
    texts = texts or TEXTS
    states = extract_person.run_batch([{"text": t} for t in texts], backend=backend, temperature=0)
    return [json.loads(state["json"]) for state in states]


if __name__ == "__main__":
    from common import cli

    cli(main, __doc__)
