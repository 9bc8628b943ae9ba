"""RuntimeEndpoint over HTTP (`RuntimeEndpoint("http://host:port")`): the same methods as the
ZeroMQ endpoint, spoken as SGLang's native API, so it also drives an SGLang server. No torch.

Generation is `POST /generate` (streaming: server-sent events); fork's prefix caching is a
generate with `max_new_tokens: 0`, as in SGLang. select uses radixflow's `POST /radixflow/score`
(the ZeroMQ `score` message, so both doors give the same decision). Where that route is missing
(sglang-router forwards SGLang's routes only; an SGLang server) select scores through
`/generate` with input logprobs, one prompt per request. One httpx client (thread-safe, pooled)
is shared by every program thread.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from radixflow.runtime.protocol.messages import (
    ERROR_DISCONNECTED,
    ERROR_INVALID_REQUEST,
    ERROR_TIMEOUT,
    ERROR_UNAUTHORIZED,
    ERROR_UNAVAILABLE,
)

CODE_OF_STATUS = {400: ERROR_INVALID_REQUEST, 401: ERROR_UNAUTHORIZED, 503: ERROR_UNAVAILABLE}


class HttpTransport:
    """Requests to one server, errors as RuntimeEndpointError (passed in: no import cycle)."""

    def __init__(self, address: str, api_key: str, timeout: float, error: type) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.address, self.error = address.rstrip("/"), error
        self.client = httpx.Client(base_url=self.address, headers=headers, timeout=None)
        self.default_timeout = timeout

    def timeout(self, timeout: float | None) -> httpx.Timeout:
        seconds = self.default_timeout if timeout is None else timeout
        return httpx.Timeout(None if math.isinf(seconds) else seconds)

    def call(
        self, method: str, path: str, body: Any = None, timeout: float | None = None
    ) -> httpx.Response:
        """The response (any status); raises on a transport failure."""
        try:
            return self.client.request(method, path, json=body, timeout=self.timeout(timeout))
        except httpx.TimeoutException as e:
            raise self.error(f"no reply from {self.address}{path} in time", ERROR_TIMEOUT) from e
        except httpx.TransportError as e:
            raise self.error(f"cannot reach {self.address}: {e}", ERROR_DISCONNECTED) from e

    def json(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> Any:
        response = self.call(method, path, body, timeout)
        self.check(response)
        return response.json()

    def check(self, response: httpx.Response) -> None:
        if response.status_code < 400:
            return
        try:
            error = response.json()["error"]
            message, code = error["message"], error.get("code")
        except (ValueError, KeyError, TypeError):
            message, code = response.text, None
        if not isinstance(code, str):
            code = CODE_OF_STATUS.get(response.status_code, "http_error")
        raise self.error(f"[{code}] HTTP {response.status_code}: {message}", code)

    def events(self, path: str, body: Any, timeout: float | None) -> Iterator[dict[str, Any]]:
        """The JSON events of a server-sent-event stream, until `data: [DONE]`. Closing the
        iterator early closes the connection, which aborts the request on the server."""
        try:
            with self.client.stream(
                "POST", path, json=body, timeout=self.timeout(timeout)
            ) as response:
                if response.status_code >= 400:
                    response.read()
                    self.check(response)
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        error = event["error"]
                        raise self.error(
                            f"[{error.get('code')}] {error['message']}", str(error.get("code"))
                        )
                    yield event
        except httpx.TimeoutException as e:
            raise self.error(f"no reply from {self.address}{path} in time", ERROR_TIMEOUT) from e
        except httpx.TransportError as e:
            raise self.error(f"lost {self.address}: {e}", ERROR_DISCONNECTED) from e

    def close(self) -> None:
        self.client.close()


class HttpEndpointMethods:
    """The RuntimeEndpoint methods over HTTP; mixed into `HttpRuntimeEndpoint` in backend."""

    http: HttpTransport
    _model_info: dict[str, Any] | None

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
    ) -> dict[str, Any]:
        """-> {"text", "output_ids", "meta_info"} once the request finished."""
        body = _generate_body(
            text,
            sampling_params,
            input_ids,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            rid,
        )
        return self.http.json("POST", "/generate", body, timeout)

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
    ) -> Iterator[dict[str, Any]]:
        """Like the ZeroMQ endpoint's: cumulative text and ids, logprobs of the new tokens only,
        `finished` on the last item. Closing it early aborts the request."""
        body = _generate_body(
            text,
            sampling_params,
            input_ids,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            rid,
        )
        body["stream"] = True
        return self._stream(body, timeout)

    def _stream(self, body: dict[str, Any], timeout: float | None) -> Iterator[dict[str, Any]]:
        seen = 0
        for event in self.http.events("/generate", body, timeout):
            meta = dict(event.get("meta_info") or {})
            if "output_token_logprobs" in meta:  # the server's are cumulative
                meta["output_token_logprobs"] = meta["output_token_logprobs"][seen:]
                seen += len(meta["output_token_logprobs"])
            finished = meta.get("finish_reason") is not None
            yield {
                "text": event.get("text", ""),
                "output_ids": event.get("output_ids", []),
                "meta_info": meta,
                "finished": finished,
            }

    def score(
        self, prefix: str, continuations: list[str], unconditional: bool = False
    ) -> list[dict[str, Any]]:
        """Logprobs of each continuation's tokens after `prefix` (one batch on the server)."""
        body = {"prefix": prefix, "continuations": list(continuations)}
        body["unconditional"] = unconditional
        if getattr(self, "_score_route", True):
            response = self.http.call("POST", "/radixflow/score", body)
            if response.status_code != 404:
                self.http.check(response)
                return response.json()["choices"]
            self._score_route = False  # sglang-router forwards SGLang's routes only
        return self._score_by_generate(prefix, list(continuations), unconditional)

    def _score_by_generate(
        self, prefix: str, continuations: list[str], unconditional: bool
    ) -> list[dict[str, Any]]:
        """score through SGLang's /generate (what a router forwards, one prompt per request,
        so cache_aware routes each by its text): prefill the prefix to learn its length P,
        then read each `prefix + continuation`'s input logprobs from position P. Equal to
        /radixflow/score when the prefix's tokens do not merge with the continuation's."""
        num_prefix = self.cache_prefix(prefix)["prompt_tokens"]
        asks = [(prefix + c, num_prefix) for c in continuations]
        asks += [(c, 0) for c in continuations] if unconditional else []
        with ThreadPoolExecutor(len(asks)) as pool:  # together: one step on the server
            entries = list(pool.map(lambda ask: self._input_logprobs(*ask), asks))
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

    def _input_logprobs(self, text: str, start: int) -> list[Any]:
        body = _generate_body(text, {"max_new_tokens": 0}, None, True, start, 0, None)
        return self.http.json("POST", "/generate", body)["meta_info"]["input_token_logprobs"]

    def cache_prefix(self, text: str) -> dict[str, Any]:
        """Prefill `text` into the radix cache (SGLang's max_new_tokens=0); its meta_info."""
        body = {"text": text, "sampling_params": {"max_new_tokens": 0}}
        return self.http.json("POST", "/generate", body)["meta_info"]

    def concatenate_and_append(self, src_rids: list[str], dst_rid: str) -> None:
        self.http.json(
            "POST", "/concate_and_append_request", {"src_rids": src_rids, "dst_rid": dst_rid}
        )

    def abort(self, rid: str) -> bool:
        """Abort request `rid` (idempotent); True when it was still in flight."""
        return rid in self.http.json("POST", "/abort_request", {"rid": rid})["aborted"]

    def flush_cache(self) -> bool:
        """Drop the radix cache; False while requests run (nothing is dropped then)."""
        response = self.http.call("POST", "/flush_cache")
        if response.status_code == 400 and "not flushed" in response.text:
            return False
        self.http.check(response)
        return True

    def model_info(self) -> dict[str, Any]:
        if self._model_info is None:
            self._model_info = self.http.json("GET", "/get_model_info")
        return dict(self._model_info)

    def stats(self) -> dict[str, Any]:
        return self.http.json("GET", "/server_info")["internal_states"][0]

    def health(self) -> dict[str, Any]:
        response = self.http.call("GET", "/health")
        if response.status_code not in (200, 503):
            self.http.check(response)
        return response.json()

    def get_server_info(self) -> dict[str, Any]:
        """SGLang's /server_info: the server's configuration and internal_states."""
        return self.http.json("GET", "/server_info")

    def close(self) -> None:
        self.http.close()


def _values(entries: list[Any]) -> list[float]:
    """The logprobs of [logprob, id, text] entries; a token without context counts 0.0."""
    return [0.0 if e[0] is None else e[0] for e in entries]


def _generate_body(
    text: str | None,
    sampling_params: dict[str, Any] | None,
    input_ids: list[int] | None,
    return_logprob: bool,
    logprob_start_len: int,
    top_logprobs_num: int,
    rid: str | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"sampling_params": dict(sampling_params or {})}
    body["text" if input_ids is None else "input_ids"] = text if input_ids is None else input_ids
    if return_logprob or top_logprobs_num:
        body.update(
            return_logprob=True,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
        )
    if rid is not None:
        body["rid"] = rid
    return body
