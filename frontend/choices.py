"""How `select` picks a choice from per-token logprobs (SGLang's three methods).

Each method is called with keyword arguments: `choices`, `normalized_prompt_logprobs` (one
mean per choice), `input_token_logprobs` (per choice, entries `[logprob, token_id, text]` for
exactly the choice's own tokens), `output_token_logprobs` and `unconditional_token_logprobs`
(same layout, or None). radixflow's `score` returns logprobs of the continuation tokens only,
so unlike SGLang no prompt token leaks into the means.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Entries = list[list[Any]]  # [[logprob, token_id, token_text], ...]


@dataclass(frozen=True)
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


def _logprobs(entries: Entries) -> list[float]:
    return [float(e[0]) for e in entries if e[0] is not None]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _argmax(scores: list[float]) -> int:
    """Index of the largest score; the first wins ties."""
    return max(range(len(scores)), key=lambda i: (scores[i], -i))


class ChoicesSamplingMethod:
    """Base: `requires_unconditional_logprobs` tells select to ask the runtime for them."""

    requires_unconditional_logprobs = False

    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[Entries],
        output_token_logprobs: list[Entries],
        unconditional_token_logprobs: list[Entries] | None = None,
    ) -> ChoicesDecision:
        raise NotImplementedError


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean token logprob (the default)."""

    def __call__(self, **kw: Any) -> ChoicesDecision:
        best = _argmax(kw["normalized_prompt_logprobs"])
        return ChoicesDecision(kw["choices"][best], _base_meta(kw))


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Compare choices token by token; at each position keep those with the best logprob.
    Shorter choices are padded with their own mean logprob."""

    def __call__(self, **kw: Any) -> ChoicesDecision:
        rows = [_logprobs(entries) for entries in kw["input_token_logprobs"]]
        width = max(len(row) for row in rows)
        matrix = [row + [_mean(row)] * (width - len(row)) for row in rows]
        alive = list(range(len(rows)))
        for j in range(width):
            if len(alive) == 1:
                break
            top = max(matrix[i][j] for i in alive)
            alive = [i for i in alive if matrix[i][j] == top]
        meta = {**_base_meta(kw), "greedy_logprob_matrix": matrix}
        return ChoicesDecision(kw["choices"][alive[0]], meta)


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The choice whose tokens gain most from the prompt: mean(conditional - unconditional)."""

    requires_unconditional_logprobs = True

    def __call__(self, **kw: Any) -> ChoicesDecision:
        unconditional = kw.get("unconditional_token_logprobs")
        if unconditional is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional logprobs")
        scores = []
        for cond, uncond in zip(kw["input_token_logprobs"], unconditional):
            # The first token has no context without the prompt: its logprob may be None.
            base = [0.0 if e[0] is None else float(e[0]) for e in uncond]
            scores.append(_mean([float(c[0]) - u for c, u in zip(cond, base)]))
        meta = {
            **_base_meta(kw),
            "unconditional_token_logprobs": unconditional,
            "normalized_unconditional_prompt_logprobs": scores,
        }
        return ChoicesDecision(kw["choices"][_argmax(scores)], meta)


def _base_meta(kw: dict[str, Any]) -> dict[str, Any]:
    keys = ("normalized_prompt_logprobs", "input_token_logprobs", "output_token_logprobs")
    return {k: kw.get(k) for k in keys}


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
