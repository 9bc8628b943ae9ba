"""RequestLimits: what one request may ask of this model and server, checked once where the
request enters (either door of the server, or the offline Engine). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from radixflow.runtime.protocol.sampling import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of this model and server. `check` is the one place where
    prompts are measured against the context and ids against the vocabulary."""

    context_len: int
    vocab_size: int
    max_new_tokens_limit: int

    def check(self, input_ids: list[int], sampling: SamplingParams | None = None) -> None:
        """Raise ValueError naming what is wrong: an empty prompt, one that fills the context,
        ids outside the vocabulary (prompt, stop_token_ids, logit_bias), max_new_tokens past
        the limit."""
        if not input_ids:
            raise ValueError("the prompt is empty")
        if len(input_ids) >= self.context_len:
            raise ValueError(
                f"the prompt has {len(input_ids)} tokens; the context length is {self.context_len}"
            )
        vocab = self.vocab_size
        if not all(0 <= t < vocab for t in input_ids):
            raise ValueError(f"input_ids must lie in [0, {vocab})")
        if sampling is None:
            return
        if not all(t < vocab for t in sampling.stop_token_ids):
            raise ValueError(f"stop_token_ids must lie in [0, {vocab})")
        if sampling.logit_bias and not all(int(t) < vocab for t in sampling.logit_bias):
            raise ValueError(f"logit_bias token ids must lie in [0, {vocab})")
        if sampling.max_new_tokens > self.max_new_tokens_limit:
            raise ValueError(
                f"max_new_tokens={sampling.max_new_tokens} exceeds the limit "
                f"{self.max_new_tokens_limit}"
            )
