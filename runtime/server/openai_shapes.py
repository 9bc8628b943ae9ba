"""OpenAI's reply pieces shared by completions and chat completions: a choice's logprobs,
the usage of a request's choices, its finish reason, and a completion's echoed prompt
logprobs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixflow.runtime.protocol.messages import Generate


def logprobs_of(
    meta: dict[str, Any],
    msg: Generate | None,
    chat: bool,
    token_texts: Callable[[list[int]], list[str]],
) -> Any:
    """OpenAI's logprobs of a choice: chat's `content` entries or completions' parallel lists."""
    if msg is None or not msg.return_logprob or "output_token_logprobs" not in meta:
        return None
    entries = meta["output_token_logprobs"]
    reason = meta.get("finish_reason") or {}
    if entries and reason.get("type") == "stop" and type(reason.get("matched")) is int:
        entries = entries[:-1]  # the stop token: not part of the choice's text
    ids = [e[1] for e in entries]
    texts = token_texts(ids)
    tops = meta.get("output_top_logprobs") or [[] for _ in entries]
    top_texts = [token_texts([t for _, t in top or ()]) for top in tops]
    if chat:
        content = []
        for (lp, _, _), text, top, names in zip(entries, texts, tops, top_texts):
            content.append(
                {
                    "token": text,
                    "logprob": lp,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {"token": s, "logprob": tlp, "bytes": list(s.encode())}
                        for (tlp, _), s in zip(top, names)
                    ],
                }
            )
        return {"content": content}
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [e[0] for e in entries],
        "top_logprobs": [
            None if top is None else {s: tlp for (tlp, _), s in zip(top, names)}
            for top, names in zip(tops, top_texts)
        ],
        "text_offset": offsets,
    }


def usage_of(metas: list[dict[str, Any]], msgs: list[Any]) -> dict[str, Any]:
    """Prompt tokens once per prompt (its n choices share it); cached tokens of a prompt
    are the least any of its choices found cached (what was there before this request)."""
    by_prompt: dict[int, list[dict[str, Any]]] = {}
    for meta, msg in zip(metas, msgs):
        key = id(msg.input_ids) if msg is not None else id(meta)
        by_prompt.setdefault(key, []).append(meta)
    prompt = sum(group[0]["prompt_tokens"] for group in by_prompt.values())
    cached = sum(min(m.get("cached_tokens", 0) for m in group) for group in by_prompt.values())
    completion = sum(m["completion_tokens"] for m in metas)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def finish(meta: dict[str, Any], tool_calls: bool = False) -> dict[str, Any]:
    reason = meta.get("finish_reason") or {}
    matched = reason.get("matched")
    kind = "tool_calls" if tool_calls else reason.get("type")
    return {"finish_reason": kind, "matched_stop": matched}


def echoed(meta: dict[str, Any]) -> dict[str, Any]:
    """A completion's meta with its prompt's logprob entries ahead of its output's (echo):
    the first prompt token has no logprob (nothing comes before it), so None and no top."""
    tops_in = meta.get("input_top_logprobs")
    tops_out = meta.get("output_top_logprobs")
    out = dict(meta)
    out["output_token_logprobs"] = meta["input_token_logprobs"] + meta["output_token_logprobs"]
    if tops_in is not None or tops_out is not None:
        tops = list(tops_in or [[]] * len(meta["input_token_logprobs"])) + list(tops_out or [])
        out["output_top_logprobs"] = [None, *tops[1:]]
    return out
