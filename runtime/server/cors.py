"""CORS for the HTTP door: which browser pages may call the API (`--allowed-origins`,
`--allowed-methods`, `--allowed-headers`).

By default only pages served from a loopback origin (localhost, 127.x.x.x, [::1], any port)
may call it, as Ollama's default: a page on some web site the user visits cannot drive the
local model. A preflight (OPTIONS with Access-Control-Request-Method) is answered for every
path before the API key is checked (browsers send no credentials on a preflight); the real
request still needs the key. A foreign origin gets no Access-Control-Allow-Origin, so the
browser blocks the page from reading the answer. The allow headers are set on the response
just before its head is sent (`on_prepare`), so streamed answers carry them too.
"""

from __future__ import annotations

import re

from aiohttp import web

LOOPBACK_ORIGIN = re.compile(
    r"https?://(localhost|127\.\d{1,3}\.\d{1,3}\.\d{1,3}|\[::1\])(:\d{1,5})?", re.IGNORECASE
)
MAX_AGE_S = 600  # how long a browser may cache a preflight's answer
EXPOSED = "Retry-After, WWW-Authenticate, Content-Type"


class Cors:
    def __init__(self, origins: str, methods: str, headers: str) -> None:
        names = [o.strip().rstrip("/") for o in origins.split(",") if o.strip()]
        self.any_origin = "*" in names
        self.origins = {o.lower() for o in names if o != "*"}
        self.loopback_only = not names
        self.methods = ", ".join(m.strip().upper() for m in methods.split(",") if m.strip())
        self.headers = headers.strip()

    def allows(self, origin: str) -> bool:
        if self.any_origin:
            return True
        if self.loopback_only:
            return LOOPBACK_ORIGIN.fullmatch(origin) is not None
        return origin.lower().rstrip("/") in self.origins

    @staticmethod
    def is_preflight(request: web.Request) -> bool:
        return (
            request.method == "OPTIONS"
            and "Origin" in request.headers
            and "Access-Control-Request-Method" in request.headers
        )

    def preflight(self, request: web.Request) -> web.Response:
        """204; with the allow headers only for an allowed origin (the browser then blocks
        the real request of any other)."""
        response = web.Response(status=204)
        origin = request.headers["Origin"]
        if self.allows(origin):
            asked = request.headers.get("Access-Control-Request-Headers", "")
            headers = asked if self.headers == "*" else self.headers
            response.headers.update(
                {
                    "Access-Control-Allow-Origin": origin,
                    "Access-Control-Allow-Methods": self.methods,
                    "Access-Control-Max-Age": str(MAX_AGE_S),
                }
            )
            if headers:
                response.headers["Access-Control-Allow-Headers"] = headers
        response.headers["Vary"] = "Origin"
        return response

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """aiohttp's on_response_prepare signal: every answer to an allowed origin says so."""
        origin = request.headers.get("Origin")
        if origin is None or "Access-Control-Allow-Origin" in response.headers:
            return
        if self.allows(origin):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = EXPOSED
        response.headers.add("Vary", "Origin")
