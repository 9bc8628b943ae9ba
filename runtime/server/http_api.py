"""The HTTP door: SGLang's native API (same paths, fields and shapes as SGLang's server, so its
frontend, scripts and router work unchanged), the OpenAI-compatible routes
(runtime/server/openai_api.py; the Responses API in responses_api.py), Anthropic's Messages API
(runtime/server/anthropic_api.py), Ollama's (ollama_api.py), llama.cpp's /infill (infill_api.py),
embeddings (embeddings_api.py) and `/metrics`, served by aiohttp on the server's one event loop.

A handler validates its body into the same typed messages the ZeroMQ door decodes
(`Generate`, `FlushCache`, ...) and hands them to the Server with a `Sink` (sinks.py) as the
reply identity. A Sink never blocks the loop: it holds at most one pending chunk (later chunks
merge into it: text is cumulative, ids and logprobs append) and the final reply, so a slow or
stalled client costs memory bounded by its own output, and only its own handler waits on its socket.
A client that disconnects cancels its handler (aiohttp's handler_cancellation), and the
handler's exit aborts whatever it still had in flight: its KV is freed at the scheduler's next
step. Bodies are limited to `max_message_bytes` (413). With an API key every route but
`/health` wants `Authorization: Bearer <key>` or `x-api-key: <key>` (401); the one `guard`
middleware enforces it for every route the app has, and counts every answer per route in
/metrics. Browser pages of the allowed origins may call it (CORS: cors.py). While the server
drains (SIGTERM) requests it refuses get 503 with Retry-After. Errors are in OpenAI's shape
`{"error": {"message", "type", "param", "code"}}` unless the door of the path has its own
(`error_shapes`: Anthropic's under /v1/messages).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from radixflow.runtime.protocol import messages as m
from radixflow.runtime.protocol.messages import Chunk, Error, FlushCache, Generate, Result, Score
from radixflow.runtime.server import reports
from radixflow.runtime.server.anthropic_api import AnthropicRoutes
from radixflow.runtime.server.cors import Cors
from radixflow.runtime.server.embeddings_api import EmbeddingsRoutes
from radixflow.runtime.server.http_request import (
    STATUS_OF_CODE,
    HttpError,
    check_fields,
    check_generation,
    dumps,
    error_body,
    error_response,
    json_response,
    listen,
    new_rid,
    parse_generate,
    prepend,
    request_error,
    typed,
)
from radixflow.runtime.server.infill_api import InfillRoutes
from radixflow.runtime.server.lora_api import LoraRoutes
from radixflow.runtime.server.media_fetch import fetch_media
from radixflow.runtime.server.metrics import CONTENT_TYPE
from radixflow.runtime.server.ollama_api import OllamaRoutes
from radixflow.runtime.server.openai_api import OpenAiRoutes
from radixflow.runtime.server.responses_api import ResponsesRoutes
from radixflow.runtime.server.sinks import Sink

HEALTH_GENERATE_TIMEOUT_S = 20.0
# sglang-router registers a worker by probing /health before it sends any key, and load
# balancers probe it keyless; /health_generate runs the model, so it wants the key.
PUBLIC_PATHS = frozenset({"/health"})
# /generate streams with logprobs send events at least this far apart, the tokens between
# merged into one event: SGLang's client keeps only the newest event's meta_info when two
# arrive before its reader wakes, and their incremental logprob entries would be lost
LOGPROB_STREAM_GAP_S = 0.025
RETRY_AFTER_S = 1  # draining: retry soon; a router sends it elsewhere once /health says 503


def is_http2_probe(record: logging.LogRecord) -> bool:
    """sglang-router opens every new worker with an HTTP/2 (gRPC) probe; aiohttp answers it
    400 and logs a traceback. Keep the 400, drop the traceback (False filters the record)."""
    error = record.exc_info[1] if record.exc_info else None
    return not (error is not None and "PRI/Upgrade" in str(error))


# ---- the door --------------------------------------------------------------------------


class HttpDoor:
    """The aiohttp application of one Server; `start` binds it on the server's loop."""

    def __init__(self, server: Any) -> None:

        self.server = server
        self.public_paths = PUBLIC_PATHS
        # (path prefix, HttpError -> response) of doors whose errors have their own shape
        self.error_shapes: list[tuple[str, Callable[[HttpError], web.Response]]] = []
        config = server.config
        self.cors = Cors(config.allowed_origins, config.allowed_methods, config.allowed_headers)
        self.app = web.Application(
            client_max_size=config.max_message_bytes, middlewares=[self.preflight, self.guard]
        )
        self.app.on_response_prepare.append(self.cors.on_prepare)
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
        openai = OpenAiRoutes(self)
        doors = [ResponsesRoutes(self), AnthropicRoutes(self), OllamaRoutes(self, openai),
                 InfillRoutes(self, openai), LoraRoutes(self)]  # fmt: skip
        self.app.add_routes(routes + openai.routes() + [r for d in doors for r in d.routes()])
        self.app.add_routes(EmbeddingsRoutes(self).routes())
        self.runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> str:
        logging.getLogger("aiohttp.server").addFilter(is_http2_probe)
        self.runner, url = await listen(self.app, host, port)
        return url

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    # ---- plumbing ----------------------------------------------------------------------

    @web.middleware
    async def preflight(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]
    ) -> web.StreamResponse:
        """A browser's CORS preflight is answered here, for every path, before the key is
        checked (cors.py); anything else goes on to `guard`."""
        if Cors.is_preflight(request):
            return self.cors.preflight(request)
        return await handler(request)

    @web.middleware
    async def guard(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]
    ) -> web.StreamResponse:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unknown"
        response = await self.answer(request, handler)
        self.server.metrics.on_http(route, response.status)
        return response

    async def answer(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]
    ) -> web.StreamResponse:
        """The handler's answer; an error in the shape of the door its path belongs to."""
        if not self.authorized(request):
            self.server.counters[f"error_{m.ERROR_UNAUTHORIZED}"] += 1
            error = HttpError(401, "missing or wrong API key (Bearer token or x-api-key)")
            response = self.error_answer(request, error)
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        try:
            check_generation(self.server.config, request)
            return await handler(request)
        except HttpError as e:
            self.server.counters[f"http_error_{e.status}"] += 1
            response = self.error_answer(request, e)
            if e.code == m.ERROR_SHUTDOWN:
                response.headers["Retry-After"] = str(RETRY_AFTER_S)
            return response
        except web.HTTPException as e:  # aiohttp's own: 404, 405, 413 (body too large)
            if e.status < 400:
                raise
            return self.error_answer(request, HttpError(e.status, e.text or e.reason))

    def error_answer(self, request: web.Request, error: HttpError) -> web.Response:
        """OpenAI's error shape, or that of the door whose path prefix `request` has."""
        for prefix, shape in self.error_shapes:
            if request.path.startswith(prefix):
                return shape(error)
        return error_response(error)

    def authorized(self, request: web.Request) -> bool:
        """No key set, a public route (matched by its route, not by a path prefix), or the
        request carries `Authorization: Bearer <key>`."""
        key = self.server.config.api_key
        resource = request.match_info.route.resource
        if not key or (resource is not None and resource.canonical in self.public_paths):
            return True
        given = request.headers.get("Authorization", "")
        token = given[7:] if given[:7].lower() == "bearer " else ""
        token = token or request.headers.get("x-api-key", "")  # Anthropic's clients send this
        return hmac.compare_digest(token.encode(), key.encode())

    async def body(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            return json.loads(raw) if raw else {}
        except (ValueError, RecursionError) as e:  # RecursionError: nested past the parser
            raise HttpError(400, f"the body is not JSON: {type(e).__name__}: {e}") from e

    def submit(self, msgs: list[Generate]) -> list[Sink]:
        wake = asyncio.Event()
        sinks = [Sink(msg.rid, wake) for msg in msgs]
        try:
            self.server.submit_generates(list(zip(sinks, msgs)))
        except ValueError as e:  # RequestError
            raise request_error(e) from e
        return sinks

    async def ask(self, msg: Any) -> Any:
        """The final data of one request message of any kind (score, embed); an error
        reply raises as an HttpError."""
        sink = Sink(msg.rid, asyncio.Event())
        self.server.handle(sink, msg)
        (data,) = await self.finals([sink])
        return data

    async def replies(self, sinks: list[Sink], gap: float = 0.0) -> AsyncIterator[tuple[int, Any]]:
        """(index, chunk or final reply) as they arrive, rounds at least `gap` seconds apart
        (the sinks merge the chunks that arrive meanwhile). Leaving early (the client went
        away, an error) aborts the requests still in flight."""
        open_ = list(range(len(sinks)))
        loop = asyncio.get_running_loop()
        last = -gap
        try:
            while open_:
                await sinks[0].wake.wait()
                if gap:
                    await asyncio.sleep(max(0.0, last + gap - loop.time()))
                    last = loop.time()
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

    async def first_reply(self, replies: AsyncIterator[tuple[int, Any]]) -> tuple[int, Any]:
        """A stream's first (index, reply), before any byte of it is sent: an error reply
        raises as an HttpError, so a request refused before its first token gets its status."""
        first = await anext(replies)
        reply = first[1]
        if isinstance(reply, Error):
            raise HttpError(STATUS_OF_CODE.get(reply.code, 500), reply.message, code=reply.code)
        return first

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
        sinks = self.submit(await fetch_media(msgs, self.server.config))  # remote image URLs
        if msgs[0].stream:
            logprobs = any(msg.return_logprob for msg in msgs)
            return await self.generate_stream(request, sinks, batch, text_in_logprobs, logprobs)
        outs = [self.native(d, text_in_logprobs) for d in await self.finals(sinks)]
        return json_response(outs if batch else outs[0])

    async def generate_stream(
        self,
        request: web.Request,
        sinks: list[Sink],
        batch: bool,
        text_in_logprobs: bool,
        logprobs: bool = False,
    ) -> web.StreamResponse:
        """SSE: one `data: {json}` per chunk, each final result, then `data: [DONE]`. Text and
        output ids are cumulative; logprob entries are incremental (each event holds only the
        tokens it adds, `output_token_logprobs_length` counts all so far), as SGLang streams
        them, paced where they carry logprobs (LOGPROB_STREAM_GAP_S). The events start with
        the first reply: a request refused before its first token (a grammar that does not
        compile) gets its error status, as an unstreamed one does."""
        ids: list[list[int]] = [[] for _ in sinks]
        sent = [0] * len(sinks)  # logprob entries streamed so far, per request
        gap = LOGPROB_STREAM_GAP_S if logprobs else 0.0
        async with contextlib.aclosing(self.replies(sinks, gap)) as replies:
            first = await self.first_reply(replies)
            response = await self.sse(request)
            async for i, reply in prepend(first, replies):
                if isinstance(reply, Error):
                    status = STATUS_OF_CODE.get(reply.code, 500)
                    await self.event(response, error_body(status, reply.message, None, reply.code))
                    break
                if isinstance(reply, Chunk) and sinks[i].final is not None:
                    continue  # the final, next, holds it: one event, not two at once
                if isinstance(reply, Chunk):
                    ids[i] += reply.new_ids
                    meta = dict(reply.meta_info)
                    meta.setdefault("finish_reason", None)
                    data = {"text": reply.text, "output_ids": list(ids[i]), "meta_info": meta}
                else:
                    meta = dict(reply.data["meta_info"])
                    for key in ("output_token_logprobs", "output_top_logprobs"):
                        if key in meta:  # only the entries not streamed yet
                            meta[key] = meta[key][sent[i] :]
                    data = {**reply.data, "meta_info": meta}
                sent[i] += len(meta.get("output_token_logprobs") or ())
                data = self.native(data, text_in_logprobs)
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
        info = reports.model_info_data(self.server)
        return json_response(
            {
                **info,
                "model_path": info.get("model_path"),
                "tokenizer_path": info.get("model_path"),
                "served_model_name": info.get("model"),
                "is_generation": True,
                "preferred_sampling_params": info.get("sampling_defaults") or None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:

        config = dataclasses.asdict(self.server.config)
        config.pop("api_key")
        stats = reports.stats_data(self.server)
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
        data = reports.health_data(self.server)
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
        if not reports.health_data(self.server)["ok"]:
            return json_response(reports.health_data(self.server), 503)
        msg = Generate(new_rid(), input_ids=[0], sampling_params={"max_new_tokens": 1})
        work = self.finals(self.submit([msg]))
        if self.server.config.is_embedding:  # an embedding server embeds one token instead
            work = self.ask(m.Embed(new_rid(), input_ids=[[0]]))
        try:
            await asyncio.wait_for(work, HEALTH_GENERATE_TIMEOUT_S)
        except (asyncio.TimeoutError, HttpError) as e:
            raise HttpError(503, f"health generation failed: {e or 'timed out'}") from e
        return json_response(reports.health_data(self.server))

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

        body = self.server.metrics.render()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})
