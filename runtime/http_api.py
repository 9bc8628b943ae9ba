"""The HTTP door: SGLang's native API (same paths, fields and shapes as SGLang's server, so its
frontend, scripts and router work unchanged), the OpenAI-compatible routes (runtime/openai_api.py)
and `/metrics`, served by aiohttp on the server's one event loop.

A handler validates its body into the same typed messages the ZeroMQ door decodes
(`Generate`, `FlushCache`, ...) and hands them to the Server with a `Sink` as the reply
identity. A Sink never blocks the loop: it holds at most one pending chunk (later chunks merge
into it: text is cumulative, ids and logprobs append) and the final reply, so a slow or stalled
client costs memory bounded by its own output, and only its own handler waits on its socket.
A client that disconnects cancels its handler (aiohttp's handler_cancellation), and the
handler's exit aborts whatever it still had in flight: its KV is freed at the scheduler's next
step. Bodies are limited to `max_message_bytes` (413); with an API key every route but SGLang's
unauthenticated `/health` and `/health_generate` wants `Authorization: Bearer <key>` (401).
Every error is OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from radixflow.runtime import messages as m
from radixflow.runtime.messages import Chunk, Error, FlushCache, Generate, Result, Score

SHUTDOWN_GRACE_S = 5.0  # handlers get this long to write their final answers at shutdown
HEALTH_GENERATE_TIMEOUT_S = 20.0
STATUS_OF_CODE = {
    m.ERROR_BAD_MESSAGE: 400,
    m.ERROR_INVALID_REQUEST: 400,
    m.ERROR_DUPLICATE_RID: 400,
    m.ERROR_FAILED: 400,  # the scheduler refused it: a bad grammar, a prompt that cannot fit
    m.ERROR_UNAUTHORIZED: 401,
    m.ERROR_TOO_LARGE: 413,
    m.ERROR_UNAVAILABLE: 503,
    m.ERROR_SHUTDOWN: 503,
    m.ERROR_INTERNAL: 500,
}
TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}
# /generate fields SGLang's clients and its router send that change nothing here at these
# values (None or the default); any other value is refused as unsupported.
GENERATE_NOOP = {
    "model": None,
    "log_metrics": None,  # any bool: metrics are always kept
    "no_logs": None,
    "return_hidden_states": False,
    "return_routed_experts": False,
    "background": False,
    "return_bytes": False,
    "return_entropy": False,
    "return_prompt_token_ids": False,
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "input_embeds": None,
    "modalities": None,
    "session_params": None,
    "lora_path": None,
    "lora_id": None,
    "custom_logit_processor": None,
    "token_ids_logprob": None,
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
    "data_parallel_rank": None,
    "priority": None,
    "extra_key": None,
    "custom_labels": None,
    "routing_key": None,
    "conversation_id": None,
}
ANY_BOOL = ("log_metrics", "no_logs")
ANY_VALUE = ("model",)  # the router adds model=None; /generate serves the one model anyway
GENERATE_FIELDS = {
    "text",
    "input_ids",
    "sampling_params",
    "rid",
    "stream",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
}
# sampling_params names of SGLang's that are no-ops here at these values
SAMPLING_NOOP = {
    "spaces_between_special_tokens": None,  # any bool: fast tokenizers ignore it
    "stream_interval": None,  # any value: every step's tokens are streamed
    "no_stop_trim": False,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "custom_params": None,
    "logit_bias": None,
    "beam_width": None,
}
SAMPLING_ANY = ("spaces_between_special_tokens", "stream_interval")


def is_http2_probe(record: logging.LogRecord) -> bool:
    """sglang-router opens every new worker with an HTTP/2 (gRPC) probe; aiohttp answers it
    400 and logs a traceback. Keep the 400, drop the traceback (False filters the record)."""
    error = record.exc_info[1] if record.exc_info else None
    return not (error is not None and "PRI/Upgrade" in str(error))


class HttpError(Exception):
    """An HTTP error answer (status and OpenAI's error fields)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: Any = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def request_error(e: Exception) -> HttpError:
    """A server RequestError (or error reply) as an HttpError."""
    code = getattr(e, "code", m.ERROR_INVALID_REQUEST)
    return HttpError(STATUS_OF_CODE.get(code, 400), str(e), code=code)


def error_body(status: int, message: str, param: str | None = None, code: Any = None) -> dict:
    kind = TYPE_OF_STATUS.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code or status}}


def error_response(e: HttpError) -> web.Response:
    return web.json_response(error_body(e.status, str(e), e.param, e.code), status=e.status)


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def json_response(value: Any, status: int = 200) -> web.Response:
    return web.json_response(value, status=status, dumps=dumps)


# ---- sinks: where a request's replies wait for their handler ----------------------------


class Sink:
    """The reply identity of one request from an HTTP handler (see the module docstring)."""

    def __init__(self, rid: str, wake: asyncio.Event) -> None:
        self.rid = rid
        self.wake = wake  # shared by the sinks of one handler
        self.chunk: Chunk | None = None
        self.final: Any = None

    def deliver(self, reply: Any) -> None:
        if isinstance(reply, Chunk):
            self.chunk = reply if self.chunk is None else merge_chunks(self.chunk, reply)
        elif self.final is None:
            self.final = reply
        self.wake.set()

    def take_chunk(self) -> Chunk | None:
        chunk, self.chunk = self.chunk, None
        return chunk


def merge_chunks(old: Chunk, new: Chunk) -> Chunk:
    """Two consecutive chunks as one: the newer text and meta, the ids and logprobs of both."""
    meta = dict(new.meta_info)
    for key in ("output_token_logprobs", "output_top_logprobs"):
        if key in meta:
            meta[key] = list(old.meta_info.get(key, [])) + list(meta[key])
    return Chunk(new.rid, new.text, old.new_ids + new.new_ids, meta)


def new_rid() -> str:
    return uuid.uuid4().hex


# ---- body validation -------------------------------------------------------------------


def check_fields(body: dict, honored: set[str], noop: dict, any_value: tuple, where: str) -> None:
    """Refuse unknown names, and SGLang's known ones at values this server cannot honour."""
    for name, value in body.items():
        if name in honored:
            continue
        if name not in noop:
            raise HttpError(400, f"unknown field {where}{name!r}", param=name)
        if name in any_value or value is None or value == noop[name]:
            continue
        if name in ANY_BOOL and isinstance(value, bool):
            continue
        raise HttpError(400, f"{where}{name}={value!r} is not supported by radixflow", name)


def typed(body: dict, name: str, kind: type | tuple, default: Any = None) -> Any:
    """body[name] if it has type `kind` (a bool is not an int), else 400; None -> default."""
    value = body.get(name)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        names = "/".join(k.__name__ for k in kinds)
        raise HttpError(400, f"{name} must be {names}, got {type(value).__name__}", name)
    return value


def is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(type(v) is int for v in value)


def clean_sampling(params: Any, where: str = "sampling_params.") -> dict[str, Any]:
    """SGLang's sampling_params with its no-op names dropped (SamplingParams checks the rest)."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise HttpError(400, "sampling_params must be an object", "sampling_params")
    known = {k for k in params if k not in SAMPLING_NOOP}
    check_fields(params, known, SAMPLING_NOOP, SAMPLING_ANY, where)
    out = {k: params[k] for k in known}
    if "sampling_seed" in out:
        out["seed"] = out.pop("sampling_seed")
    return out


def per_item(body: dict, name: str, count: int, kind: type, default: Any) -> list[Any]:
    """A /generate option given once for all prompts or as a list, one per prompt."""
    value = body.get(name)
    if isinstance(value, list):
        if len(value) != count:
            raise HttpError(400, f"{name} has {len(value)} entries for {count} prompts", name)
        return [typed({name: v}, name, kind, default) for v in value]
    return [typed(body, name, kind, default)] * count


def parse_generate(body: Any) -> tuple[bool, list[Generate]]:
    """A /generate body -> (is_batch, one Generate per prompt and sample, prompt-major)."""
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object")
    check_fields(body, GENERATE_FIELDS, GENERATE_NOOP, ANY_VALUE, "")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise HttpError(400, "give exactly one of text and input_ids", "text")
    if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
        prompts: list[Any] = [("text", t) for t in text]
    elif isinstance(text, str):
        prompts = [("text", text)]
    elif isinstance(ids, list) and ids and all(is_int_list(i) for i in ids):
        prompts = [("input_ids", i) for i in ids]
    elif is_int_list(ids):
        prompts = [("input_ids", ids)]
    else:
        raise HttpError(
            400,
            "text must be a string or a non-empty list of strings; input_ids "
            "a list of ints or a non-empty list of such lists",
            "text",
        )
    batch = isinstance(text, list) or (bool(ids) and isinstance(ids[0], list))
    count = len(prompts)
    params = body.get("sampling_params")
    if isinstance(params, list):
        if len(params) != count:
            raise HttpError(400, f"{len(params)} sampling_params for {count} prompts")
        sampling = [clean_sampling(p) for p in params]
    else:
        sampling = [clean_sampling(params)] * count
    rids = per_item(body, "rid", count, str, None)
    stream = typed(body, "stream", bool, False)
    logprob = per_item(body, "return_logprob", count, bool, False)
    start = per_item(body, "logprob_start_len", count, int, -1)
    top = per_item(body, "top_logprobs_num", count, int, 0)
    typed(body, "return_text_in_logprobs", bool, False)
    msgs = []
    for i, (kind, prompt) in enumerate(prompts):
        n = sampling[i].get("n", 1)
        if type(n) is not int or not 1 <= n <= 64:
            raise HttpError(400, f"invalid sampling parameter n={n!r}", "n")
        for j in range(n):
            params_j = {**sampling[i], "n": 1}
            if n > 1 and type(params_j.get("seed")) is int:
                params_j["seed"] += j  # n equal seeds would give n equal samples
            rid = rids[i] if n == 1 else (f"{rids[i]}-{j}" if rids[i] else None)
            msgs.append(
                Generate(
                    rid or new_rid(),
                    sampling_params=params_j,
                    stream=stream,
                    return_logprob=logprob[i] or top[i] > 0,
                    logprob_start_len=start[i],
                    top_logprobs_num=top[i],
                    **{kind: prompt},
                )
            )
    return batch or len(msgs) > 1, msgs


# ---- the door --------------------------------------------------------------------------


class HttpDoor:
    """The aiohttp application of one Server; `start` binds it on the server's loop."""

    def __init__(self, server: Any) -> None:
        from radixflow.runtime.openai_api import OpenAiRoutes

        self.server = server
        self.app = web.Application(
            client_max_size=server.config.max_message_bytes, middlewares=[self.guard]
        )
        get, post = web.get, web.post
        routes = [
            web.route("*", "/generate", self.generate),
            get("/get_model_info", self.model_info),
            get("/model_info", self.model_info),
            get("/get_server_info", self.server_info),
            get("/server_info", self.server_info),
            web.route("*", "/flush_cache", self.flush_cache),
            get("/health", self.health),
            get("/health_generate", self.health_generate),
            get("/get_load", self.get_load),
            post("/abort_request", self.abort_request),
            post("/concate_and_append_request", self.concate_and_append),
            post("/radixflow/score", self.score),
            get("/metrics", self.metrics),
        ]
        self.app.add_routes(routes + OpenAiRoutes(self).routes())
        self.runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> str:
        logging.getLogger("aiohttp.server").addFilter(is_http2_probe)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        self.runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S
        )
        await self.runner.setup()
        await web.SockSite(self.runner, sock, shutdown_timeout=SHUTDOWN_GRACE_S).start()
        literal = f"[{host}]" if ":" in host else host
        return f"http://{literal}:{sock.getsockname()[1]}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    # ---- plumbing ----------------------------------------------------------------------

    @web.middleware
    async def guard(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]
    ) -> web.StreamResponse:
        key = self.server.config.api_key
        # SGLang's rule: /health* answer without the key (sglang-router registers a worker by
        # probing /health before it sends any key; a 401 there keeps the worker out)
        if key and not request.path.startswith("/health"):
            given = request.headers.get("Authorization", "")
            token = given[7:] if given[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), key.encode()):
                self.server.counters[f"error_{m.ERROR_UNAUTHORIZED}"] += 1
                return error_response(HttpError(401, "missing or wrong API key (Bearer token)"))
        try:
            return await handler(request)
        except HttpError as e:
            self.server.counters[f"http_error_{e.status}"] += 1
            return error_response(e)
        except web.HTTPException as e:  # aiohttp's own: 404, 405, 413 (body too large)
            if e.status < 400:
                raise
            return error_response(HttpError(e.status, e.text or e.reason))

    async def body(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            return json.loads(raw) if raw else {}
        except (ValueError, UnicodeDecodeError) as e:
            raise HttpError(400, f"the body is not JSON: {e}") from e

    def submit(self, msgs: list[Generate]) -> list[Sink]:
        wake = asyncio.Event()
        sinks = [Sink(msg.rid, wake) for msg in msgs]
        try:
            self.server.submit_generates(list(zip(sinks, msgs)))
        except ValueError as e:  # RequestError
            raise request_error(e) from e
        return sinks

    async def replies(self, sinks: list[Sink]) -> AsyncIterator[tuple[int, Any]]:
        """(index, chunk or final reply) as they arrive. Leaving early (the client went away,
        an error) aborts the requests still in flight."""
        open_ = list(range(len(sinks)))
        try:
            while open_:
                await sinks[0].wake.wait()
                sinks[0].wake.clear()
                for i in list(open_):
                    chunk = sinks[i].take_chunk()
                    if chunk is not None:
                        yield i, chunk
                    if sinks[i].final is not None:
                        open_.remove(i)
                        yield i, sinks[i].final
        finally:
            for i in open_:
                self.server.abort_identity(sinks[i], "client disconnected")

    async def finals(self, sinks: list[Sink]) -> list[Any]:
        """Every request's final data; the first error reply raises as an HttpError."""
        out: list[Any] = [None] * len(sinks)
        async with contextlib.aclosing(self.replies(sinks)) as replies:
            async for i, reply in replies:
                if isinstance(reply, Error):
                    raise HttpError(
                        STATUS_OF_CODE.get(reply.code, 500), reply.message, code=reply.code
                    )
                if isinstance(reply, Result):
                    out[i] = reply.data
        return out

    async def sse(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        return response

    async def event(self, response: web.StreamResponse, data: Any) -> None:
        text = data if isinstance(data, str) else dumps(data)
        await response.write(f"data: {text}\n\n".encode())

    def token_texts(self, ids: list[int]) -> list[str]:
        return self.server.tokenizer.batch_decode([[i] for i in ids])

    # ---- SGLang's native API -----------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        if request.method not in ("POST", "PUT"):
            raise HttpError(405, f"{request.method} /generate: use POST")
        body = await self.body(request)
        batch, msgs = parse_generate(body)
        text_in_logprobs = bool(body.get("return_text_in_logprobs"))
        sinks = self.submit(msgs)
        if msgs[0].stream:
            return await self.generate_stream(request, sinks, batch, text_in_logprobs)
        outs = [self.native(d, text_in_logprobs) for d in await self.finals(sinks)]
        return json_response(outs if batch else outs[0])

    async def generate_stream(
        self, request: web.Request, sinks: list[Sink], batch: bool, text_in_logprobs: bool
    ) -> web.StreamResponse:
        """SSE: one `data: {json}` per chunk (cumulative text, ids and logprobs, as SGLang
        streams by default), each final result, then `data: [DONE]`."""
        response = await self.sse(request)
        ids: list[list[int]] = [[] for _ in sinks]
        logprobs: list[list[Any]] = [[] for _ in sinks]
        async with contextlib.aclosing(self.replies(sinks)) as replies:
            async for i, reply in replies:
                if isinstance(reply, Error):
                    status = STATUS_OF_CODE.get(reply.code, 500)
                    await self.event(response, error_body(status, reply.message, None, reply.code))
                    break
                if isinstance(reply, Chunk):
                    ids[i] += reply.new_ids
                    meta = dict(reply.meta_info)
                    if "output_token_logprobs" in meta:
                        logprobs[i] += meta["output_token_logprobs"]
                        meta["output_token_logprobs"] = list(logprobs[i])
                    data = {"text": reply.text, "output_ids": list(ids[i]), "meta_info": meta}
                    data["meta_info"].setdefault("finish_reason", None)
                    data = self.native(data, text_in_logprobs)
                else:
                    data = self.native(reply.data, text_in_logprobs)
                if batch:
                    data["index"] = i
                await self.event(response, data)
        await self.event(response, "[DONE]")
        await response.write_eof()
        return response

    def native(self, data: dict[str, Any], text_in_logprobs: bool) -> dict[str, Any]:
        """A generate result in SGLang's shape: logprob entries are [logprob, id, text|None],
        top logprobs a list per position of such entries."""
        meta = data.get("meta_info", {})
        if "output_token_logprobs" not in meta and "input_token_logprobs" not in meta:
            return data
        meta = dict(meta)
        for key in ("output_token_logprobs", "input_token_logprobs"):
            if key in meta:
                meta[key] = self.entries([(e[0], e[1]) for e in meta[key]], text_in_logprobs)
        for key in ("output_top_logprobs", "input_top_logprobs"):
            if key in meta:
                meta[key] = [self.entries(top, text_in_logprobs) for top in meta[key]]
        return {**data, "meta_info": meta}

    def entries(self, pairs: list[Any], with_text: bool) -> list[list[Any]]:
        texts = self.token_texts([t for _, t in pairs]) if with_text else [None] * len(pairs)
        return [[lp, t, s] for (lp, t), s in zip(pairs, texts)]

    async def model_info(self, request: web.Request) -> web.Response:
        info = self.server.model_info_data()
        return json_response(
            {
                **info,
                "model_path": info.get("model_path"),
                "tokenizer_path": info.get("model_path"),
                "served_model_name": info.get("model"),
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        import dataclasses

        config = dataclasses.asdict(self.server.config)
        config.pop("api_key")
        stats = self.server.stats_data()
        info = {
            **config,
            "model_path": self.server.model_info.get("model_path"),
            "internal_states": [stats],
            "version": "radixflow",
            "frontend": "python",
            "http_url": self.server.http_url,
            "zmq_address": self.server.address,
        }
        return json_response(info)

    async def flush_cache(self, request: web.Request) -> web.Response:
        rid = new_rid()
        sink = Sink(rid, asyncio.Event())
        self.server.handle(sink, FlushCache(rid))
        (reply,) = [r async for _, r in self.replies([sink])]
        if isinstance(reply, Error):
            raise HttpError(STATUS_OF_CODE.get(reply.code, 500), reply.message, code=reply.code)
        if not reply.data["flushed"]:  # SGLang's answer while requests run
            return web.Response(status=400, text="Cache not flushed: requests are running.\n")
        return web.Response(text="Cache flushed.\n")

    async def health(self, request: web.Request) -> web.Response:
        data = self.server.health_data()
        return json_response(data, 200 if data["ok"] else 503)

    async def get_load(self, request: web.Request) -> web.Response:
        """SGLang's load report, one entry per data-parallel rank (we have one): sglang-router
        reads `num_tokens` (KV held by live requests) for its power_of_two policy."""
        stats = self.server.scheduler_stats
        free = stats.get("free_slots", 0) + stats.get("evictable_tokens", 0)
        running, waiting = stats.get("running_requests", 0), stats.get("waiting_requests", 0)
        load = {
            "dp_rank": 0,
            "num_reqs": max(running + waiting, len(self.server.jobs)),
            "num_waiting_reqs": waiting,
            "num_tokens": max(stats.get("total_slots", 0) - free, 0),
        }
        return json_response([load])

    async def health_generate(self, request: web.Request) -> web.Response:
        """Generates one token (as SGLang does) so a stuck scheduler shows as 503."""
        if not self.server.health_data()["ok"]:
            return json_response(self.server.health_data(), 503)
        msg = Generate(new_rid(), input_ids=[0], sampling_params={"max_new_tokens": 1})
        try:
            await asyncio.wait_for(self.finals(self.submit([msg])), HEALTH_GENERATE_TIMEOUT_S)
        except (asyncio.TimeoutError, HttpError) as e:
            raise HttpError(503, f"health generation failed: {e or 'timed out'}") from e
        return json_response(self.server.health_data())

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        if not isinstance(body, dict):
            raise HttpError(400, "the body must be a JSON object")
        check_fields(body, {"rid", "abort_all"}, {"abort_message": None}, ("abort_message",), "")
        rid, abort_all = typed(body, "rid", str, ""), typed(body, "abort_all", bool, False)
        targets = list(self.server.jobs) if abort_all else [rid]
        aborted = [r for r in targets if self.server.abort_rid(r)]
        return json_response({"aborted": aborted})

    async def concate_and_append(self, request: web.Request) -> web.Response:
        """SGLang's fork join splices branch KV here; the radix cache already holds every
        branch's prefix, so the next /generate reuses it exactly: nothing to do."""
        await self.body(request)
        return json_response({"success": True})

    async def score(self, request: web.Request) -> web.Response:
        """radixflow's `score` message over HTTP (the DSL's select); SGLang's frontend scores
        through batch /generate with logprobs instead, which works here too."""
        body = await self.body(request)
        if not isinstance(body, dict):
            raise HttpError(400, "the body must be a JSON object")
        check_fields(body, {"prefix", "continuations", "unconditional"}, {}, (), "")
        continuations = typed(body, "continuations", list, None)
        if continuations is None or not all(isinstance(c, str) for c in continuations):
            raise HttpError(400, "continuations must be a list of strings", "continuations")
        msg = Score(
            new_rid(),
            typed(body, "prefix", str, ""),
            continuations,
            typed(body, "unconditional", bool, False),
        )
        sink = Sink(msg.rid, asyncio.Event())
        self.server.handle(sink, msg)
        (data,) = await self.finals([sink])
        return json_response(data)

    async def metrics(self, request: web.Request) -> web.Response:
        from radixflow.runtime.metrics import CONTENT_TYPE

        body = self.server.metrics.render()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})
