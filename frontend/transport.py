"""The transport under RuntimeEndpoint: one connection to a server, and the error it raises.

Two implementations satisfy `Transport`: `ZmqTransport` (tcp://, radixflow's own protocol,
`radixflow.zmq_transport`) and `HttpTransport` (http://, SGLang's native API, which also
drives an SGLang server or sglang-router, `radixflow.http_transport`). RuntimeEndpoint picks
one from the address and owns everything the two share (defaults, the model-info cache,
SGLang's helper methods), so both doors give a program the same methods and the same errors.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


class RuntimeEndpointError(RuntimeError):
    """A request failed: the server's error reply (`code` is its ERROR_* name), a timeout, an
    unreachable server or a dropped connection."""

    def __init__(self, message: str, code: str = "client") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class GenerateRequest:
    """One generate call as a program makes it (SGLang's /generate fields). `rid` None: the
    transport names the request itself."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = field(default_factory=dict)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    rid: str | None = None
    lora_path: str | None = None  # a LoRA adapter loaded on the server, by name
    image_data: list[bytes] | None = None  # a vision model's images (encoded files)


@dataclass(frozen=True)
class Liveness:
    """How a transport watches the requests it waits on, so a call without a timeout waits
    exactly as long as the server reports its request alive (as SGLang's client does). Every
    `interval_s` it asks the server where the requests waited on longer than that stand: one
    the server no longer knows fails at once, and no answer for `silence_s` fails them all (a
    dead server fails sooner: its dropped connection fails every call). A call waiting longer
    than `log_after_s` logs the server's answer (queue, tokens so far) every `log_after_s`."""

    interval_s: float = 5.0
    log_after_s: float = 30.0
    silence_s: float = 120.0


DEFAULT_LIVENESS = Liveness()


@runtime_checkable
class Transport(Protocol):
    """One server connection shared by every program thread: each method is thread-safe and
    blocks until its reply. Every method raises RuntimeEndpointError on an error reply (its
    `code` the server's ERROR_* name), when `timeout` seconds pass without the reply (the
    whole call, or each chunk of a stream; `math.inf` waits while the server reports the
    request alive, see `Liveness`; a timed-out generation is aborted on the server), or at
    once when the server is unreachable or goes away."""

    def generate(
        self, request: GenerateRequest, timeout: float
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """-> {"text", "output_ids", "meta_info"} once the request finished; a list of n of
        them for sampling_params n > 1 (n samples of the prompt, which is prefilled once)."""
        ...

    def generate_stream(self, request: GenerateRequest, timeout: float) -> Iterator[dict[str, Any]]:
        """Yields {"text" (cumulative), "output_ids" (cumulative), "meta_info" (logprobs only
        for the new tokens), "finished"}; the last item has finished=True and the final text.
        Sends nothing before the first next(); closing the iterator early aborts the request."""
        ...

    def score(
        self, prefix: str, continuations: list[str], unconditional: bool, timeout: float
    ) -> list[dict[str, Any]]:
        """Logprobs of each continuation's tokens after `prefix`: [{"text", "token_ids",
        "logprobs", "unconditional_logprobs" (or None)}]."""
        ...

    def cache_prefix(self, text: str, timeout: float) -> dict[str, Any]:
        """Prefill `text` into the radix cache; its meta_info."""
        ...

    def concatenate_and_append(self, src_rids: list[str], dst_rid: str, timeout: float) -> None:
        """SGLang's fork join."""
        ...

    def abort(self, rid: str, timeout: float) -> bool:
        """Abort request `rid` (idempotent); True when it was still in flight."""
        ...

    def flush_cache(self, timeout: float) -> bool:
        """Drop the radix cache; False while requests run (nothing is dropped then)."""
        ...

    def model_info(self, timeout: float) -> dict[str, Any]:
        """The served model: model_path, chat_template, special tokens, context length..."""
        ...

    def stats(self, timeout: float) -> dict[str, Any]:
        """The scheduler's stats (slots, running and waiting requests, cache hit rate...)."""
        ...

    def health(self, timeout: float) -> dict[str, Any]:
        """{"ok": bool, "status": ...}; an unhealthy server answers too."""
        ...

    def server_info(self, timeout: float) -> dict[str, Any]:
        """What the door calls server info (SGLang's /server_info over HTTP)."""
        ...

    def close(self) -> None:
        """Fail every waiting call and release the connection; idempotent."""
        ...
