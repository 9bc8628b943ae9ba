"""RuntimeEndpoint (a client of a radixflow server) and Runtime (launches one). No torch here.

    runtime = Runtime(model_path="smollm2")          # starts `radixflow serve --port 0`
    out = runtime.endpoint.generate("Hello", {"max_new_tokens": 8, "temperature": 0})
    runtime.url                                      # http://127.0.0.1:P (SGLang, OpenAI /v1)
    runtime.shutdown()

One RuntimeEndpoint class over a transport chosen by the address: `RuntimeEndpoint("tcp://...")`
speaks radixflow's ZeroMQ protocol (`radixflow.zmq_transport`), `RuntimeEndpoint("http://...")`
SGLang's HTTP API (`radixflow.http_transport`), so a program runs against either door, or
against an SGLang server, with the same methods and errors.
"""

from __future__ import annotations

import atexit
import math
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

from radixflow.chat_template import ChatTemplate, template_for_model
from radixflow.http_transport import HttpTransport
from radixflow.runtime.config import config_from_kwargs
from radixflow.transport import (
    DEFAULT_LIVENESS,
    GenerateRequest,
    Liveness,
    RuntimeEndpointError,
    Transport,
)
from radixflow.zmq_transport import ZmqTransport

READY_PREFIX = "radixflow ready on "
FAILED_PREFIX = "radixflow failed to start: "  # the server's reason, raised as RuntimeError
READY_ADDRESSES = re.compile(r"(https?://\S+)(?:.*?(tcp://\S+))?")  # --dp-size: HTTP only


CONTROL_TIMEOUT_S = 60.0  # model info, stats, health, abort when the endpoint sets no timeout


def open_transport(
    address: str, api_key: str, liveness: Liveness = DEFAULT_LIVENESS, model: str | None = None
) -> Transport:
    """HTTP for http:// and https:// addresses, ZeroMQ (tcp://, ipc://) for the others. A
    `model` name is for a server of several models."""
    if address.startswith(("http://", "https://")):
        return HttpTransport(address, api_key, liveness, model)
    return ZmqTransport(address, api_key, liveness, model)


class RuntimeEndpoint:
    """A thread-safe client of one radixflow (or SGLang) server. Calls block until their
    reply; they raise RuntimeEndpointError on an error reply, after `timeout` seconds without
    the reply (the whole call, or each chunk when streaming; a timed-out generation is aborted
    on the server), or at once when the server is unreachable or goes away (a dropped
    connection, a server killed). `timeout` None (the default, as SGLang's): generation,
    score and cache calls wait as long as the server reports their request alive, and log why
    when they wait long (`liveness`); the other calls wait CONTROL_TIMEOUT_S. `timeout` may be
    changed later. `model` names one model of a server of several (`radixflow serve
    --model-path NAME=PATH ...`): every call names it (over HTTP `model` in /generate bodies,
    `?model=` on the others; over ZeroMQ each message's `model`); None: the server's own, or
    its first."""

    def __init__(
        self,
        address: str = "tcp://127.0.0.1:30001",
        api_key: str | None = None,
        timeout: float | None = None,
        liveness: Liveness = DEFAULT_LIVENESS,
        model: str | None = None,
    ) -> None:
        self.address, self.api_key, self.timeout = address, api_key, timeout
        self.model = model
        self.transport = open_transport(address, api_key or "", liveness, model)
        weakref.finalize(self, self.transport.close)  # an endpoint never closed stops anyway
        self._model_info: dict[str, Any] | None = None

    # ---- generation -----------------------------------------------------------------------

    def generate(
        self,
        text: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        *,
        input_ids: list[int] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        timeout: float | None = None,
        rid: str | None = None,
        lora_path: str | None = None,
        image_data: list[bytes] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """-> {"text", "output_ids", "meta_info"} once the request finished; a list of n of
        them for sampling_params n > 1 (the n share the prompt's KV: it is prefilled once).
        `lora_path`: the name of a LoRA adapter loaded on the server (None: the base model)."""
        request = GenerateRequest(
            text,
            input_ids,
            dict(sampling_params or {}),
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            rid,
            lora_path,
            image_data,
        )
        return self.transport.generate(request, self._timeout(timeout))

    def generate_stream(
        self,
        text: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        *,
        input_ids: list[int] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        timeout: float | None = None,
        rid: str | None = None,
        lora_path: str | None = None,
        image_data: list[bytes] | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Yields {"text" (cumulative), "output_ids" (cumulative), "meta_info" (logprobs only
        for the new tokens), "finished"}; the last item has finished=True and the final text.
        Closing the iterator early aborts the request."""
        request = GenerateRequest(
            text,
            input_ids,
            dict(sampling_params or {}),
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            rid,
            lora_path,
            image_data,
        )
        return self.transport.generate_stream(request, self._timeout(timeout))

    def score(
        self, prefix: str, continuations: list[str], unconditional: bool = False
    ) -> list[dict[str, Any]]:
        """Logprobs of each continuation's tokens after `prefix` (one batch on the server):
        [{"text", "token_ids", "logprobs", "unconditional_logprobs" (or None)}]."""
        timeout = self._timeout(None)
        return self.transport.score(prefix, list(continuations), unconditional, timeout)

    def cache_prefix(self, text: str) -> dict[str, Any]:
        """Prefill `text` into the radix cache; returns its meta_info."""
        return self.transport.cache_prefix(text, self._timeout(None))

    # ---- control --------------------------------------------------------------------------

    def abort(self, rid: str) -> bool:
        """Abort request `rid` (idempotent); True when it was still in flight."""
        return self.transport.abort(rid, self._control_timeout())

    def flush_cache(self) -> bool:
        """Drop the radix cache; False while requests run (nothing is dropped then)."""
        return self.transport.flush_cache(self._control_timeout())

    def model_info(self) -> dict[str, Any]:
        """The served model (asked once, then a copy of the answer)."""
        if self._model_info is None:
            self._model_info = self.transport.model_info(self._control_timeout())
        return dict(self._model_info)

    def stats(self) -> dict[str, Any]:
        return self.transport.stats(self._control_timeout())

    def health(self) -> dict[str, Any]:
        return self.transport.health(self._control_timeout())

    def get_server_info(self) -> dict[str, Any]:
        """ZeroMQ: the model info and stats in one dict; HTTP: SGLang's /server_info."""
        return self.transport.server_info(self._control_timeout())

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> RuntimeEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- SGLang's endpoint methods --------------------------------------------------------

    def get_model_name(self) -> str:
        return self.model_info()["model_path"]

    def get_chat_template(self) -> ChatTemplate:
        return template_for_model(self.model_info())

    def concatenate_and_append(self, src_rids: list[str], dst_rid: str) -> None:
        """SGLang's fork join (the radix cache already holds every branch)."""
        self.transport.concatenate_and_append(src_rids, dst_rid, self._control_timeout())

    def start_profile(self) -> None:
        raise RuntimeEndpointError("profiling is not implemented by radixflow", "unsupported")

    stop_profile = start_profile

    def _timeout(self, timeout: float | None) -> float:
        """A call's own timeout, else the endpoint's, else none (the request is watched)."""
        if timeout is not None:
            return timeout
        return math.inf if self.timeout is None else self.timeout

    def _control_timeout(self) -> float:
        return CONTROL_TIMEOUT_S if self.timeout is None else self.timeout


class Runtime:
    """Launch `python -m radixflow.runtime serve` as a subprocess and connect to it.

    `.endpoint` is a ZeroMQ RuntimeEndpoint; `.url` the HTTP base URL (SGLang's native API,
    OpenAI's at `.url + "/v1"`), `.address` the ZeroMQ one. With `dp_size > 1` the server is
    sglang-router over replicas, which speaks HTTP only: `.address` is None and `.endpoint`
    an HTTP one on `.url`.

    `server_config_kwargs` are ServerConfig fields (max_total_tokens=8192, ...). The server is
    shut down by `shutdown()`, at interpreter exit, or as a context manager."""

    def __init__(
        self,
        model_path: str = "smollm2",
        port: int = 0,
        log_level: str = "error",
        launch_timeout: float = 300.0,
        **server_config_kwargs: Any,
    ) -> None:
        config = config_from_kwargs(model=model_path, port=port, **server_config_kwargs)
        self.stop_wait_s = config.shutdown_timeout + 30.0  # the server drains, then exits
        cmd = [sys.executable, "-m", "radixflow.runtime", "serve", "--model", model_path]
        cmd += ["--port", str(port), "--log-level", log_level]
        cmd += _flags(server_config_kwargs)
        # PYTHONSAFEPATH: `-m` would put the working directory first on sys.path, and a
        # checkout's kernels/ folder there shadows the `kernels` package transformers imports
        env = {**os.environ, "PYTHONSAFEPATH": "1"}
        self.process = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env
        )
        atexit.register(self.shutdown)
        self.url, self.address = self._wait_ready(launch_timeout)  # HTTP, ZeroMQ
        api_key = server_config_kwargs.get("api_key")
        self.endpoint = RuntimeEndpoint(self.address or self.url, api_key=api_key)

    def _wait_ready(self, launch_timeout: float) -> tuple[str, str | None]:
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=_pump_lines, args=(self.process, lines), daemon=True).start()
        deadline = time.monotonic() + launch_timeout
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            if line.startswith(FAILED_PREFIX):
                self.shutdown()
                raise RuntimeError(
                    f"the radixflow server {line.strip().removeprefix('radixflow ')}"
                )
            found = READY_ADDRESSES.search(line) if line.startswith(READY_PREFIX) else None
            if found:
                return found.group(1), found.group(2)
        self.shutdown()
        raise RuntimeError(
            f"the radixflow server did not start within {launch_timeout:.0f}s "
            f"(exit code {self.process.returncode}; see its log on stderr)"
        )

    def generate(
        self, prompt: str, sampling_params: dict[str, Any] | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        return self.endpoint.generate(prompt, sampling_params, **kwargs)

    def get_tokenizer(self) -> Any:
        from transformers import AutoTokenizer  # noqa: PLC0415 (optional: the frontend stays torch-free; only when a tokenizer is asked for)

        return AutoTokenizer.from_pretrained(self.endpoint.model_info()["model_path"])

    def shutdown(self) -> None:
        """Stop the server: SIGTERM (it finishes what is in flight, up to its
        --shutdown-timeout), SIGKILL 30 s past that; idempotent."""
        endpoint = getattr(self, "endpoint", None)
        if endpoint is not None:
            endpoint.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(self.stop_wait_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _flags(kwargs: dict[str, Any]) -> list[str]:
    flags = []
    for name, value in kwargs.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def _pump_lines(process: subprocess.Popen[bytes], lines: queue.Queue[str]) -> None:
    """Read the server's stdout for good (so it never blocks on a full pipe)."""
    assert process.stdout is not None
    for raw in process.stdout:
        lines.put(raw.decode(errors="replace"))
