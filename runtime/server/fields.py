"""Other runtimes' request fields: each is honoured (renamed onto ours) or refused by name with
what to use instead, never dropped while it would change the output.

Clients ported from vLLM send `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` or `structured_outputs`; llama.cpp's server and its web UI send `grammar`
(GBNF), `json_schema` as an object, `n_predict`, `repeat_penalty`, and their samplers' knobs
(`typical_p`, DRY, XTC, mirostat, ...) usually at the values that turn them off. A constraint
field becomes ours; a sampler radixflow does not implement is accepted at its off value and
refused at any other; the knobs that only tune an off sampler (DRY's base while DRY is off)
are accepted. docs/http.md lists this table; tests/runtime/server/test_fields.py holds the
two to each other and drives every entry.
"""

from __future__ import annotations

from typing import Any


class FieldError(ValueError):
    """A field refused (the doors answer 400 naming `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


# name -> our sampling field (SamplingParams checks the value)
RENAMED = {
    "guided_json": "json_schema",  # vLLM
    "guided_regex": "regex",
    "guided_choice": "choices",
    "guided_grammar": "ebnf",  # EBNF/GBNF or Lark: llguidance reads both
    "grammar": "ebnf",  # llama.cpp's GBNF
    "n_predict": "max_tokens",  # llama.cpp
    "repeat_penalty": "repetition_penalty",
}
# vLLM's structured_outputs / guided_decoding object: key -> our sampling field
STRUCTURED = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choices",
    "grammar": "ebnf",
    "structural_tag": "structural_tag",
}
ANY_JSON_OBJECT = '{"type": "object"}'
# samplers radixflow does not implement: name -> (values that turn it off, what to use)
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "typical_p": ((1.0,), "top_p or min_p"),
    "dry_multiplier": ((0.0,), "repetition_penalty, frequency_penalty or presence_penalty"),
    "xtc_probability": ((0.0,), "min_p or top_k"),
    "mirostat": ((0,), "temperature with top_p or min_p"),
    "tfs_z": ((1.0,), "min_p"),
    "top_n_sigma": ((-1.0, 0.0), "min_p"),
    "top_a": ((0.0,), "min_p"),
    "use_beam_search": ((False,), "n with a seed, or the DSL's fork"),
    "best_of": ((1,), "n"),
    "length_penalty": ((1.0,), "max_tokens"),
    "bad_words": (([],), "logit_bias with -100 on the words' tokens"),
    "allowed_token_ids": (([],), "logit_bias, regex or choices"),
    "n_probs": ((0,), "logprobs and top_logprobs"),
    "prompt_logprobs": ((0,), "/v1/completions with echo and logprobs"),
    "include_stop_str_in_output": ((False,), "the matched_stop field of the choice"),
    "guided_whitespace_pattern": ((), "the server's --grammar-whitespace"),
    "truncate_prompt_tokens": ((), "a shorter prompt: radixflow never cuts one silently"),
}
# knobs of a sampler that do nothing while it is off: accepted with it off, refused with it on
TUNES = {
    "dry_base": "dry_multiplier",
    "dry_allowed_length": "dry_multiplier",
    "dry_penalty_last_n": "dry_multiplier",
    "dry_sequence_breakers": "dry_multiplier",
    "xtc_threshold": "xtc_probability",
    "mirostat_tau": "mirostat",
    "mirostat_eta": "mirostat",
}
# accepted at any value: they change no output here
TOLERATED = {
    "cache_prompt": "the radix cache always reuses prefixes",
    "id_slot": "one scheduler, no slots",
    "guided_decoding_backend": "the server's --grammar-backend",
    "samplers": "radixflow's fixed order: penalties, temperature, top-k, top-p, min-p",
    "t_max_predict_ms": "not a limit here; use max_tokens",
    "n_keep": "no context shifting: a prompt past the context is refused",
}


def translate(body: dict[str, Any], penalty_key: str = "repetition_penalty") -> dict[str, Any]:
    """`body` with the fields of this table renamed onto ours (a copy; tolerated ones
    removed); FieldError naming a refused field, or one that renames onto a field the body
    already sets."""
    out = dict(body)
    for name, (off, instead) in REFUSED.items():
        value = out.pop(name, None)
        if value is not None and not any(value == o for o in off):
            raise refused(name, value, instead)
    for name, sampler in TUNES.items():
        value = out.pop(name, None)
        if value is not None and body.get(sampler) not in (None, *REFUSED[sampler][0]):
            raise refused(name, value, REFUSED[sampler][1])
    repeat = out.pop("repeat_last_n", None)
    penalty = out.get("repeat_penalty", out.get(penalty_key))
    if repeat not in (None, -1) and penalty not in (None, 1, 1.0):
        raise refused(
            "repeat_last_n", repeat, "-1: radixflow's penalty counts every token of the request"
        )
    for name in TOLERATED:
        out.pop(name, None)
    structured = out.pop("structured_outputs", None)
    if structured is None:
        structured = out.pop("guided_decoding", None)
    if structured is not None:
        out.update(structured_fields(structured, out))
    for name, ours in RENAMED.items():
        if name not in out:
            continue
        value = out.pop(name)
        if value is None:
            continue
        if out.get(ours) is not None:
            raise FieldError(f"{name} and {ours} both given: they are the same field", name)
        out[ours] = value
    return out


def structured_fields(value: Any, body: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise FieldError("structured_outputs must be an object", "structured_outputs")
    out: dict[str, Any] = {}
    for key, item in value.items():
        if item is None or item is False:
            continue
        if key == "json_object":
            out["json_schema"] = ANY_JSON_OBJECT
        elif key in STRUCTURED:
            out[STRUCTURED[key]] = item
        elif key == "whitespace_pattern":
            raise refused("structured_outputs.whitespace_pattern", item, "--grammar-whitespace")
        elif key not in ("backend", "disable_fallback", "disable_any_whitespace"):
            raise FieldError(
                f"structured_outputs.{key} is not supported by radixflow", "structured_outputs"
            )
    clash = [k for k in out if body.get(k) is not None]
    if clash:
        raise FieldError(f"structured_outputs and {clash[0]} both given", "structured_outputs")
    return out


def refused(name: str, value: Any, instead: str) -> FieldError:
    shown = repr(value)[:60]
    return FieldError(
        f"{name}={shown} is not implemented by radixflow; use {instead} instead", name
    )
