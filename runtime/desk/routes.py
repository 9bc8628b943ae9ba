"""The desk's HTTP front door (aiohttp): the routes that describe every model (/v1/models,
/api/tags, /api/ps, /metrics, /health) are answered here; every other request goes to the
model its JSON body's `model` names (or the `?model=` query, else the first model: SGLang's
/generate, /get_model_info), which is loaded first if it is not, and its answer (SSE and
Ollama's NDJSON streams included) is passed through chunk by chunk. An unknown name gets the
404 of the door its path belongs to, in that door's error shape, as the child would answer.
The API key is checked here and passed on: each child checks it too.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from radixflow.runtime.config import ServerConfig
from radixflow.runtime.desk.catalog import DeskConfigError, parse_duration
from radixflow.runtime.desk.desk import UNSET, Desk, Slot
from radixflow.runtime.desk.listing import metrics_text, ollama_entry, openai_card, ps_entry
from radixflow.runtime.protocol.messages import ERROR_SHUTDOWN
from radixflow.runtime.server.anthropic_api import anthropic_error
from radixflow.runtime.server.cors import Cors
from radixflow.runtime.server.http_request import (
    HttpError,
    error_response,
    json_response,
    listen,
)
from radixflow.runtime.server.infill_api import infill_error
from radixflow.runtime.server.metrics import CONTENT_TYPE
from radixflow.runtime.server.ollama_api import OLLAMA_VERSION, ollama_error, rfc3339

log = logging.getLogger("radixflow.desk")
PUBLIC_PATHS = frozenset({"/health"})
SHAPES = (("/v1/messages", anthropic_error), ("/api/", ollama_error), ("/infill", infill_error))
# not passed on: hop-by-hop, recomputed, or the desk's own (CORS)
DROPPED_IN = {"host", "content-length", "connection", "transfer-encoding", "accept-encoding",
              "origin", "keep-alive", "upgrade"}  # fmt: skip
DROPPED_OUT = {"content-length", "connection", "transfer-encoding", "content-encoding", "date",
               "server", "keep-alive", "vary"}  # fmt: skip


def not_found(path: str, name: str) -> HttpError:
    """Each door's own 404 for a model it does not serve."""
    if path.startswith("/api/"):
        return HttpError(404, f"model '{name}' not found", "model")
    return HttpError(404, f"The model '{name}' does not exist", "model", "model_not_found")


class DeskDoor:
    def __init__(self, desk: Desk, config: ServerConfig) -> None:
        self.desk, self.config = desk, config
        self.cors = Cors(config.allowed_origins, config.allowed_methods, config.allowed_headers)
        self.app = web.Application(
            client_max_size=config.max_message_bytes, middlewares=[self.guard]
        )
        self.app.on_response_prepare.append(self.cors.on_prepare)
        get = web.get
        self.app.add_routes([
            get("/health", self.health),
            get("/metrics", self.metrics),
            get("/v1/models", self.models),
            get("/v1/models/{model}", self.model),
            get("/api/tags", self.tags),
            get("/api/ps", self.ps),
            get("/api/version", self.version),
            get("/", self.root),
            web.route("*", "/{tail:.*}", self.forward),
        ])  # fmt: skip
        self.runner: web.AppRunner | None = None
        self.session: aiohttp.ClientSession | None = None

    async def start(self, host: str, port: int) -> str:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
        self.session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)
        self.runner, url = await listen(self.app, host, port)
        return url

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.session is not None:
            await self.session.close()

    # ---- plumbing --------------------------------------------------------------------------

    @web.middleware
    async def guard(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]
    ) -> web.StreamResponse:
        """CORS preflights, the API key, and errors in the shape of the path's door."""
        if Cors.is_preflight(request):
            return self.cors.preflight(request)
        if not self.authorized(request):
            error = HttpError(401, "missing or wrong API key (Bearer token or x-api-key)")
            response = self.error_answer(request.path, error)
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        try:
            return await handler(request)
        except HttpError as e:
            response = self.error_answer(request.path, e)
            if e.code == ERROR_SHUTDOWN or e.status == 503:
                response.headers["Retry-After"] = "1"
            return response

    def error_answer(self, path: str, error: HttpError) -> web.Response:
        for prefix, shape in SHAPES:
            if path.startswith(prefix):
                return shape(error)
        return error_response(error)

    def authorized(self, request: web.Request) -> bool:
        key = self.config.api_key
        if not key or request.path in PUBLIC_PATHS:
            return True
        given = request.headers.get("Authorization", "")
        token = given[7:] if given[:7].lower() == "bearer " else ""
        token = token or request.headers.get("x-api-key", "")
        return hmac.compare_digest(token.encode(), key.encode())

    # ---- the desk's own answers ------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """Whether the desk serves (503 while it drains), and each model's state."""
        states = {name: slot.state for name, slot in self.desk.slots.items()}
        ok = not self.desk.draining
        return json_response({"ok": ok, "models": states}, 200 if ok else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=metrics_text(self.desk).encode(), content_type=None,
                            headers={"Content-Type": CONTENT_TYPE})  # fmt: skip

    async def models(self, request: web.Request) -> web.Response:
        cards = [openai_card(s) for s in self.desk.slots.values()]
        return json_response({"object": "list", "data": cards})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        slot = self.desk.find(name)
        if slot is None:
            raise not_found(request.path, name)
        return json_response(openai_card(slot))

    async def tags(self, request: web.Request) -> web.Response:
        return json_response({"models": [ollama_entry(s) for s in self.desk.slots.values()]})

    async def ps(self, request: web.Request) -> web.Response:
        loaded = [s for s in self.desk.slots.values() if s.state == "loaded"]
        return json_response({"models": [ps_entry(self.desk, s) for s in loaded]})

    async def version(self, request: web.Request) -> web.Response:
        return json_response({"version": OLLAMA_VERSION})

    async def root(self, request: web.Request) -> web.Response:
        return web.Response(text="Ollama is running")

    # ---- requests for a model --------------------------------------------------------------

    async def forward(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body: Any = None
        if raw:
            with contextlib.suppress(ValueError, RecursionError):  # the child answers the 400
                body = json.loads(raw)
        name = body.get("model") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name:
            name = request.query.get("model")
        ollama = request.path.startswith("/api/")
        if ollama and request.method == "POST" and not name:
            raise HttpError(400, "model is required", "model")
        slot = self.desk.find(name)
        if slot is None:
            raise not_found(request.path, str(name))
        keep = UNSET
        if ollama and isinstance(body, dict) and body.get("keep_alive") is not None:
            try:
                keep = parse_duration(body["keep_alive"])
            except DeskConfigError as e:
                raise HttpError(400, str(e), "keep_alive") from e
        if ollama and isinstance(body, dict) and is_load_request(request.path, body):
            return await self.load_request(request.path, slot, keep)
        child = await self.desk.acquire(slot)
        try:
            return await self.relay(request, raw, child.url)
        finally:
            self.desk.release(slot, keep)

    async def relay(self, request: web.Request, raw: bytes, base: str) -> web.StreamResponse:
        """The child's answer, passed through as it comes."""
        assert self.session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in DROPPED_IN}
        target = base + request.path_qs
        try:
            upstream = await self.session.request(
                request.method, target, data=raw or None, headers=headers
            )
        except aiohttp.ClientError as e:
            raise HttpError(502, f"the model's server did not answer: {e}") from e
        async with upstream:
            kept = {k: v for k, v in upstream.headers.items() if k.lower() not in DROPPED_OUT}
            response = web.StreamResponse(status=upstream.status, headers=kept)
            await response.prepare(request)
            with contextlib.suppress(aiohttp.ClientPayloadError):  # the child went away
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            await response.write_eof()
            return response

    async def load_request(self, path: str, slot: Slot, keep: Any) -> web.Response:
        """Ollama's load and unload calls: /api/generate without a prompt, /api/chat without
        messages; keep_alive 0 unloads the model, anything else loads it."""
        if keep == 0:
            if slot.active == 0:
                await self.desk.unload(slot, "keep_alive 0")
            reason = "unload"
        else:
            await self.desk.acquire(slot)
            self.desk.release(slot, keep)
            reason = "load"
        answer: dict[str, Any] = {"model": slot.name, "created_at": rfc3339(), "done": True,
                                  "done_reason": reason}  # fmt: skip
        if path == "/api/chat":
            answer["message"] = {"role": "assistant", "content": ""}
        else:
            answer["response"] = ""
        return json_response(answer)


def is_load_request(path: str, body: dict[str, Any]) -> bool:
    if path == "/api/generate":
        return not body.get("prompt") and not body.get("images") and not body.get("suffix")
    if path == "/api/chat":
        return not body.get("messages")
    return False
