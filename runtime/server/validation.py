"""What a request may ask of the loaded model, checked at the edge (either door): text that
can fit the context (refused before tokenizing when it cannot), ids in the vocabulary,
lengths within the context and --max-new-tokens-limit, sampling parameters by SGLang's names.
Each failure is a RequestError with its protocol error code."""

from __future__ import annotations

from typing import Any

from radixflow.runtime.config import ServerConfig
from radixflow.runtime.protocol.limits import RequestLimits
from radixflow.runtime.protocol.messages import ERROR_INVALID_REQUEST
from radixflow.runtime.protocol.sampling import SamplingParams

MAX_CHARS_PER_TOKEN = 64  # text longer than this times the context cannot fit it
MAX_TOP_LOGPROBS = 64
MAX_RID_LEN = 256
MAX_EMBED_INPUTS = 2048  # inputs of one embed request (OpenAI's own limit)
MAX_JOBS_IN_FLIGHT = 4096  # more waiting requests than this: refuse new ones (overloaded)


class RequestError(ValueError):
    """A request that is answered with an error reply; `code` is an ERROR_* name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class RequestRules:
    """The checks for one loaded model (`model_info`: its context_length and vocab_size)."""

    def __init__(self, config: ServerConfig, model_info: dict[str, Any], tokenizer: Any) -> None:
        self.config, self.model_info, self.tokenizer = config, model_info, tokenizer

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; text that cannot fit the context is refused untokenized (a
        huge text would stall this loop in the tokenizer)."""
        if len(text) > MAX_CHARS_PER_TOKEN * self.model_info["context_length"]:
            raise RequestError(ERROR_INVALID_REQUEST, f"text of {len(text)} chars is too long")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, text: str | None, input_ids: list[int] | None) -> list[int]:
        if (text is None) == (input_ids is None):
            raise RequestError(ERROR_INVALID_REQUEST, "give exactly one of text and input_ids")
        ids = self.encode(text) if text is not None else input_ids
        self.check_limits(ids, None)
        return ids

    def sampling(self, params: dict[str, Any]) -> SamplingParams:
        try:
            sampling = SamplingParams.from_dict(params)
        except (ValueError, TypeError) as e:
            raise RequestError(ERROR_INVALID_REQUEST, str(e)) from e
        if sampling.n != 1:
            raise RequestError(ERROR_INVALID_REQUEST, "n must be 1 here; send n requests")
        return sampling

    def check_limits(self, ids: list[int], sampling: SamplingParams | None) -> None:
        limits = RequestLimits(
            self.model_info["context_length"],
            self.model_info["vocab_size"],
            self.config.max_new_tokens_limit,
        )
        try:
            limits.check(ids, sampling)
        except ValueError as e:
            raise RequestError(ERROR_INVALID_REQUEST, str(e)) from e
