"""What a request may ask of the loaded model, checked at the edge (either door): text that
can fit the context (refused before tokenizing when it cannot), ids in the vocabulary,
lengths within the context and --max-new-tokens-limit, sampling parameters by SGLang's names.
Each failure is a RequestError with its protocol error code."""

from __future__ import annotations

from typing import Any

from radixflow.runtime.config import ServerConfig
from radixflow.runtime.protocol.limits import RequestLimits
from radixflow.runtime.protocol.messages import (
    EMBEDDING_ONLY,
    ERROR_INVALID_REQUEST,
    POOLINGS,
    Embed,
    Generate,
    ImageItem,
)
from radixflow.runtime.protocol.sampling import SamplingParams, with_defaults
from radixflow.runtime.server.images import ImageError, ImageRules

MAX_CHARS_PER_TOKEN = 64  # text longer than this times the context cannot fit it
MAX_TOP_LOGPROBS = 64
MAX_RID_LEN = 256
MAX_EMBED_INPUTS = 2048  # inputs of one embed request (OpenAI's own limit)
MAX_JOBS_IN_FLIGHT = 4096
# what --is-embedding refuses over HTTP: every route that generates, scores or caches
GENERATION_ROUTES = (
    "/generate", "/concate_and_append_request", "/radixflow/score", "/v1/completions",
    "/v1/chat/completions", "/v1/responses", "/v1/messages", "/api/generate", "/api/chat",
)  # fmt: skip  # more waiting requests than this: refuse new ones (overloaded)


class RequestError(ValueError):
    """A request that is answered with an error reply; `code` is an ERROR_* name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class RequestRules:
    """The checks for one loaded model (`model_info`: its context_length and vocab_size)."""

    def __init__(self, config: ServerConfig, model_info: dict[str, Any], tokenizer: Any) -> None:
        self.config, self.model_info, self.tokenizer = config, model_info, tokenizer
        self.images = ImageRules(
            model_info.get("vision"), config.max_image_bytes, config.max_request_image_bytes,
            config.max_image_pixels, config.allow_local_media,
        )  # fmt: skip

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; text that cannot fit the context is refused untokenized (a
        huge text would stall this loop in the tokenizer)."""
        if len(text) > MAX_CHARS_PER_TOKEN * self.model_info["context_length"]:
            raise RequestError(ERROR_INVALID_REQUEST, f"text of {len(text)} chars is too long")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def embed_encode(self, text: str) -> list[int]:
        """An embed input's ids: with the special tokens for an encoder ([CLS] ... [SEP], as
        sentence-transformers tokenizes), without them for a decoder (as `encode`)."""
        if not self.model_info.get("is_encoder"):
            return self.encode(text)
        if len(text) > MAX_CHARS_PER_TOKEN * self.model_info["context_length"]:
            raise RequestError(ERROR_INVALID_REQUEST, f"text of {len(text)} chars is too long")
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def check_generation(self) -> None:
        """Refuse a generation (generate, score, cache_prefix) on an --is-embedding server."""
        if self.config.is_embedding:
            raise RequestError(ERROR_INVALID_REQUEST, EMBEDDING_ONLY)

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

    def generate(
        self, msg: Generate
    ) -> tuple[list[int], SamplingParams, dict[str, Any], tuple[list[int], list[ImageItem]]]:
        """(prompt ids, sampling with the model's defaults for what it leaves unset, those
        defaults, (the scheduler's prompt, its images)) of a generate request, every field
        checked. With images the prompt's placeholders are expanded (server/images.py)."""
        self.check_generation()
        ids = self.prompt_ids(msg.text, msg.input_ids)
        ids, keyed, images = self.prompt_images(msg, ids)
        params, defaults = with_defaults(msg.sampling_params, self.model_info)
        sampling = self.sampling(params)
        self.check_limits(ids, sampling)
        if not -1 <= msg.logprob_start_len < len(ids):
            raise RequestError(
                ERROR_INVALID_REQUEST, f"logprob_start_len must be in [-1, {len(ids)})"
            )
        if msg.priority and not self.config.enable_priority_scheduling:
            raise RequestError(
                ERROR_INVALID_REQUEST, "priority needs the server's --enable-priority-scheduling"
            )
        loaded = self.model_info.get("lora_adapters", {})
        if msg.lora_path is not None and msg.lora_path not in loaded:
            raise RequestError(
                ERROR_INVALID_REQUEST,
                f"no LoRA adapter named {msg.lora_path!r} is loaded (loaded: {sorted(loaded)})",
            )
        if not 0 <= msg.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise RequestError(
                ERROR_INVALID_REQUEST, f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}]"
            )
        return ids, sampling, defaults, (keyed, images)

    def prompt_images(
        self, msg: Generate, ids: list[int]
    ) -> tuple[list[int], list[int], list[ImageItem]]:
        """(the prompt with each image's placeholder expanded; the scheduler's copy, with the
        images' keys there; the images), or (ids, ids, []) without images. Raises
        RequestError (invalid_request) for a refused image."""
        if not msg.image_data:
            return ids, ids, []
        vocab = self.model_info["vocab_size"]
        try:
            if self.config.speculative_algorithm:
                raise ImageError("images are not served with --speculative-algorithm")
            if msg.return_logprob and msg.logprob_start_len >= 0:
                raise ImageError("input logprobs are not available for a prompt with images")
            shown, keyed, images = self.images.items(msg.image_data, ids, vocab)
        except ImageError as e:
            raise RequestError(ERROR_INVALID_REQUEST, str(e)) from e
        context = self.model_info["context_length"]
        if len(keyed) >= context:
            raise RequestError(
                ERROR_INVALID_REQUEST,
                f"too many images for the context: with its {len(images)} image(s) "
                f"({sum(i.num_tokens for i in images)} tokens) the prompt has {len(keyed)} "
                f"tokens; the context length is {context}",
            )
        return shown, keyed, images

    def embed_inputs(self, msg: Embed) -> list[list[int]]:
        """The ids of an embed request's inputs, each checked against the context exactly as
        a generate prompt is."""
        if msg.pooling and msg.pooling not in POOLINGS:
            raise RequestError(ERROR_INVALID_REQUEST, f"pooling must be one of {POOLINGS}")
        if (msg.text is None) == (msg.input_ids is None):
            raise RequestError(ERROR_INVALID_REQUEST, "give exactly one of text and input_ids")
        inputs = msg.text if msg.text is not None else msg.input_ids
        if not inputs or len(inputs) > MAX_EMBED_INPUTS:
            message = f"give 1 to {MAX_EMBED_INPUTS} inputs, got {len(inputs)}"
            raise RequestError(ERROR_INVALID_REQUEST, message)
        id_lists = [self.embed_encode(t) for t in msg.text] if msg.text is not None else inputs
        for ids in id_lists:
            self.check_limits(ids, None)
        return id_lists
