"""The HTTP transport (`RuntimeEndpoint("http://host:port")`): SGLang's native API, so it also
drives an SGLang server or sglang-router. No torch.

Generation is `POST /generate` (streaming: server-sent events); prefix caching is a generate
with `max_new_tokens: 0`, as in SGLang. score uses radixflow's `POST /radixflow/score` (the
ZeroMQ `score` message, so both doors give select the same decision). Where that route is
missing (sglang-router forwards SGLang's routes only; an SGLang server) score goes through
`/generate` with input logprobs, one prompt per request. One httpx client (thread-safe,
pooled) is shared by every program thread.

Without a timeout a generation waits as long as its connection stays open: a server that dies
closes it and the call fails at once. A call waiting longer than `Liveness.log_after_s` is
logged with the server's load (`/get_load`: queued and running requests) by a watcher thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from radixflow.media import data_url
from radixflow.runtime.protocol.messages import (
    ERROR_DISCONNECTED,
    ERROR_INVALID_REQUEST,
    ERROR_TIMEOUT,
    ERROR_UNAUTHORIZED,
    ERROR_UNAVAILABLE,
)
from radixflow.transport import (
    DEFAULT_LIVENESS,
    GenerateRequest,
    Liveness,
    RuntimeEndpointError,
)

log = logging.getLogger("radixflow")
CONNECT_TIMEOUT_S = 10.0  # longest wait to connect, even for a call without a timeout
CODE_OF_STATUS = {400: ERROR_INVALID_REQUEST, 401: ERROR_UNAUTHORIZED, 503: ERROR_UNAVAILABLE}


class HttpTransport:
    """`Transport` over one pooled httpx client (see `Transport` for what blocks and raises)."""

    def __init__(
        self,
        address: str,
        api_key: str,
        liveness: Liveness = DEFAULT_LIVENESS,
        model: str | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.address = address.rstrip("/")
        self.model = model  # one model of a server of several: named on every call
        params = {"model": model} if model is not None else None
        self.client = httpx.Client(
            base_url=self.address, headers=headers, timeout=None, params=params
        )
        self.score_route = True  # until a 404 says the server has no /radixflow/score
        self.watcher = Watcher(self, liveness)

    # ---- the Transport methods ------------------------------------------------------------

    def generate(
        self, request: GenerateRequest, timeout: float
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """SGLang's /generate answers a list for sampling n > 1."""
        with self.watcher.waiting(request.rid or "generate"):
            return self._json("POST", "/generate", self._body(request), timeout)

    def _body(self, request: GenerateRequest) -> dict[str, Any]:
        body = _generate_body(request)
        return body if self.model is None else {**body, "model": self.model}

    def generate_stream(self, request: GenerateRequest, timeout: float) -> Iterator[dict[str, Any]]:
        body, seen = {**self._body(request), "stream": True}, 0
        with self.watcher.waiting(request.rid or "generate (streamed)") as call:
            for event in self._events("/generate", body, timeout):
                meta, seen = _new_logprobs(dict(event.get("meta_info") or {}), seen)
                call.tokens = len(event.get("output_ids", []))
                yield {
                    "text": event.get("text", ""),
                    "output_ids": event.get("output_ids", []),
                    "meta_info": meta,
                    "finished": meta.get("finish_reason") is not None,
                }

    def score(
        self, prefix: str, continuations: list[str], unconditional: bool, timeout: float
    ) -> list[dict[str, Any]]:
        body = {"prefix": prefix, "continuations": continuations, "unconditional": unconditional}
        if self.score_route:
            with self.watcher.waiting("score"):
                response = self._call("POST", "/radixflow/score", body, timeout)
            if response.status_code != 404:
                self._check(response)
                return response.json()["choices"]
            self.score_route = False  # sglang-router forwards SGLang's routes only
        return self._score_by_generate(prefix, continuations, unconditional, timeout)

    def _score_by_generate(
        self, prefix: str, continuations: list[str], unconditional: bool, timeout: float
    ) -> list[dict[str, Any]]:
        """score through SGLang's /generate (what a router forwards, one prompt per request,
        so cache_aware routes each by its text): prefill the prefix to learn its length P,
        then read each `prefix + continuation`'s input logprobs from position P. Equal to
        /radixflow/score when the prefix's tokens do not merge with the continuation's."""
        num_prefix = self.cache_prefix(prefix, timeout)["prompt_tokens"]
        asks = [(prefix + c, num_prefix) for c in continuations]
        asks += [(c, 0) for c in continuations] if unconditional else []
        with ThreadPoolExecutor(len(asks)) as pool:  # together: one step on the server
            entries = list(pool.map(lambda ask: self._input_logprobs(*ask, timeout), asks))
        num = len(continuations)
        return [
            {
                "text": continuation,
                "token_ids": [e[1] for e in entries[i]],
                "logprobs": _values(entries[i]),
                "unconditional_logprobs": _values(entries[num + i]) if unconditional else None,
            }
            for i, continuation in enumerate(continuations)
        ]

    def _input_logprobs(self, text: str, start: int, timeout: float) -> list[Any]:
        params = {"max_new_tokens": 0}
        request = GenerateRequest(text, None, params, return_logprob=True, logprob_start_len=start)
        return self.generate(request, timeout)["meta_info"]["input_token_logprobs"]

    def cache_prefix(self, text: str, timeout: float) -> dict[str, Any]:
        """SGLang's way: a generate with max_new_tokens=0."""
        body = {"text": text, "sampling_params": {"max_new_tokens": 0}}
        with self.watcher.waiting("cache_prefix"):
            return self._json("POST", "/generate", body, timeout)["meta_info"]

    def concatenate_and_append(self, src_rids: list[str], dst_rid: str, timeout: float) -> None:
        body = {"src_rids": src_rids, "dst_rid": dst_rid}
        self._json("POST", "/concate_and_append_request", body, timeout)

    def abort(self, rid: str, timeout: float) -> bool:
        return rid in self._json("POST", "/abort_request", {"rid": rid}, timeout)["aborted"]

    def flush_cache(self, timeout: float) -> bool:
        response = self._call("POST", "/flush_cache", None, timeout)
        if response.status_code == 400 and "not flushed" in response.text:
            return False
        self._check(response)
        return True

    def model_info(self, timeout: float) -> dict[str, Any]:
        return self._json("GET", "/get_model_info", None, timeout)

    def stats(self, timeout: float) -> dict[str, Any]:
        return self.server_info(timeout)["internal_states"][0]

    def health(self, timeout: float) -> dict[str, Any]:
        response = self._call("GET", "/health", None, timeout)
        if response.status_code not in (200, 503):
            self._check(response)
        return response.json()

    def server_info(self, timeout: float) -> dict[str, Any]:
        """SGLang's /server_info: the server's configuration and internal_states."""
        return self._json("GET", "/server_info", None, timeout)

    def close(self) -> None:
        self.watcher.stop()
        self.client.close()

    # ---- requests and their errors --------------------------------------------------------

    def _call(self, method: str, path: str, body: Any, timeout: float) -> httpx.Response:
        """The response (any status); raises on a transport failure."""
        try:
            return self.client.request(method, path, json=body, timeout=_timeout(timeout))
        except httpx.TimeoutException as e:
            raise RuntimeEndpointError(
                f"no reply from {self.address}{path} in time", ERROR_TIMEOUT
            ) from e
        except httpx.TransportError as e:
            raise RuntimeEndpointError(
                f"cannot reach {self.address}: {e}", ERROR_DISCONNECTED
            ) from e

    def _json(self, method: str, path: str, body: Any, timeout: float) -> Any:
        response = self._call(method, path, body, timeout)
        self._check(response)
        return response.json()

    def _check(self, response: httpx.Response) -> None:
        """Raise RuntimeEndpointError for an error status, with the server's code if any."""
        if response.status_code < 400:
            return
        try:
            error = response.json()["error"]
            message, code = error["message"], error.get("code")
        except (ValueError, KeyError, TypeError):
            message, code = response.text, None
        if not isinstance(code, str):
            code = CODE_OF_STATUS.get(response.status_code, "http_error")
        raise RuntimeEndpointError(f"[{code}] HTTP {response.status_code}: {message}", code)

    def _events(self, path: str, body: Any, timeout: float) -> Iterator[dict[str, Any]]:
        """The JSON events of a server-sent-event stream, until `data: [DONE]`. Closing the
        iterator early closes the connection, which aborts the request on the server."""
        try:
            with self.client.stream("POST", path, json=body, timeout=_timeout(timeout)) as response:
                if response.status_code >= 400:
                    response.read()
                    self._check(response)
                yield from _sse_events(response)
        except httpx.TimeoutException as e:
            raise RuntimeEndpointError(
                f"no reply from {self.address}{path} in time", ERROR_TIMEOUT
            ) from e
        except httpx.TransportError as e:
            raise RuntimeEndpointError(f"lost {self.address}: {e}", ERROR_DISCONNECTED) from e


class Call:
    """One call a Watcher follows."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.since = self.logged = time.monotonic()
        self.tokens: int | None = None  # streamed tokens so far


class Watcher:
    """Logs why calls wait long: a daemon thread, started with the first call, that reads the
    server's `/get_load` for calls waiting past `log_after_s` (every `log_after_s`)."""

    def __init__(self, transport: HttpTransport, liveness: Liveness) -> None:
        self.transport, self.liveness = transport, liveness
        self.calls: set[Call] = set()
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None

    @contextlib.contextmanager
    def waiting(self, name: str) -> Iterator[Call]:
        call = Call(name)
        with self.lock:
            self.calls.add(call)
            if self.thread is None and not self.stopped.is_set():
                self.thread = threading.Thread(target=self._run, name="radixflow-http-watch")
                self.thread.daemon = True
                self.thread.start()
        try:
            yield call
        finally:
            with self.lock:
                self.calls.discard(call)

    def stop(self) -> None:
        self.stopped.set()

    def _run(self) -> None:
        while not self.stopped.wait(min(self.liveness.interval_s, self.liveness.log_after_s)):
            now = time.monotonic()
            with self.lock:
                due = [c for c in self.calls if now - c.logged >= self.liveness.log_after_s]
            if due:
                load = self._load()
                for call in due:
                    call.logged = now
                    log.info("%s", self._line(call, now, load))

    def _load(self) -> str:
        try:
            response = self.transport.client.get("/get_load", timeout=self.liveness.interval_s)
            load = response.json()[0]
            return f"{load['num_waiting_reqs']} queued of {load['num_reqs']} requests"
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
            return f"no load report ({type(e).__name__})"

    def _line(self, call: Call, now: float, load: str) -> str:
        progress = "" if call.tokens is None else f", {call.tokens} tokens so far"
        return (
            f"waiting for request {call.name} for {now - call.since:.0f}s{progress}; the server"
            f" at {self.transport.address} holds the connection open: {load}"
        )


def _sse_events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            error = event["error"]
            code = str(error.get("code"))
            raise RuntimeEndpointError(f"[{error.get('code')}] {error['message']}", code)
        yield event


def _new_logprobs(meta: dict[str, Any], seen: int) -> tuple[dict[str, Any], int]:
    """A streamed event's meta with only the logprobs of its new tokens, and the count seen
    so far. SGLang's /generate streams cumulative lists (incremental ones under its
    incremental_streaming_output; `output_token_logprobs_length`, where sent, tells), and a
    final result holds them all: each case gives the new entries."""
    entries = meta.get("output_token_logprobs")
    if entries is None:
        return meta, seen
    cumulative = len(entries) == meta.get("output_token_logprobs_length", len(entries))
    new = entries[seen:] if cumulative else entries
    tops = meta.get("output_top_logprobs")
    if tops is not None and cumulative and len(tops) == len(entries):
        meta["output_top_logprobs"] = tops[seen:]
    meta["output_token_logprobs"] = new
    return meta, seen + len(new)


def _timeout(seconds: float) -> httpx.Timeout:
    """No limit on the wait for the reply when `seconds` is inf, but a bounded connect."""
    if math.isinf(seconds):
        return httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)
    return httpx.Timeout(seconds)


def _values(entries: list[Any]) -> list[float]:
    """The logprobs of [logprob, id, text] entries; a token without context counts 0.0."""
    return [0.0 if e[0] is None else e[0] for e in entries]


def _generate_body(request: GenerateRequest) -> dict[str, Any]:
    """SGLang's /generate body: logprob fields only when asked, rid only when given."""
    body: dict[str, Any] = {"sampling_params": dict(request.sampling_params)}
    if request.input_ids is None:
        body["text"] = request.text
    else:
        body["input_ids"] = request.input_ids
    if request.return_logprob or request.top_logprobs_num:
        body.update(
            return_logprob=True,
            logprob_start_len=request.logprob_start_len,
            top_logprobs_num=request.top_logprobs_num,
        )
    if request.rid is not None:
        body["rid"] = request.rid
    if request.lora_path is not None:
        body["lora_path"] = request.lora_path
    if request.image_data:
        body["image_data"] = [data_url(image) for image in request.image_data]
    return body
