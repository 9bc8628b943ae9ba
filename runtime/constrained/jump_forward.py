"""Jump-forward tokens: the text a grammar forces next, tokenized as the model would write it.

Where a grammar admits exactly one continuation (a schema's key, `": "` between fields, the
rest of an enum value), the scheduler appends that text's tokens without sampling them
(runtime/scheduler/jump_forward.py). The token-boundary problem of the SGLang paper's
compressed FSM: forced text tokenized on its own can split what the model's tokenizer would
merge with the token before it (`"` then `, "age"` where the model writes `",` then ` "age"`),
and its last token can merge with the free text after it (` ` before a number `3`, where `3`
may be written ` 3`). So:
  * the last sampled token is tokenized again together with the forced text; where that
    gives a different first token (the merge), the sampled token is replaced by it (the caller
    rolls the grammar back one token first; the sampled token has no KV yet and was not
    streamed, so nothing else changes);
  * the last forced token is held back where free text may follow (the model samples it, or
    a longer token, next step); llguidance's fast-forward tokens are already cut this way.
Every proposal spells exactly the intended bytes and is checked against the grammar.
"""

from __future__ import annotations

from collections.abc import Callable

MAX_FORCED_BYTES = 512  # one jump's text; the rest jumps after the next sampled token

Jump = tuple[int, list[int]]  # (sampled tokens to replace: 0 or 1, tokens to append)
NO_JUMP: Jump = (0, [])


def natural_jump(
    forced: bytes,
    standalone: list[int],
    last: int | None,
    spell: Callable[[list[int]], bytes],
    tokenize: Callable[[bytes], list[int] | None],
    accepts: Callable[[list[int]], bool],
    hold_back_last: bool,
) -> Jump:
    """The jump for `forced` bytes whose own tokenization is `standalone` (valid in the
    grammar, already cut where the caller cuts it). With `last` (the last sampled token), try
    tokenizing its bytes and the forced text together: a different first token replaces
    `last` if the whole sequence spells the same bytes and `accepts(tokens)` (the grammar,
    rolled back over `last`, takes them). `tokenize` returns None where it cannot say;
    `hold_back_last` cuts the merged proposal's last token as `standalone` was cut."""
    own = spell([last]) if last is not None else b""
    if own and forced:
        text = own + forced
        merged = tokenize(text)
        if merged and merged[0] != last and spell(merged) == text:
            if hold_back_last:
                merged = merged[:-1]
            if merged and accepts(merged):
                return 1, merged
    return (0, standalone) if standalone else NO_JUMP


def utf8_prefix(data: bytes) -> bytes:
    """The longest prefix of `data` that is whole UTF-8 characters (forced text may stop
    inside one; a tokenizer that takes text cannot take half a character)."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            data[:cut].decode()
            return data[:cut]
        except UnicodeDecodeError:
            continue
    return b""
