"""The API key on every HTTP route: each route the app registers (read from the aiohttp app
itself, so a new route is covered without touching this file) answers 401 without the key and
with a wrong one, and not 401 with the right one; only `/health` is keyless. The same walk
reports a route that skips the key."""

from __future__ import annotations

import asyncio
import queue
import re
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from types import SimpleNamespace

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from radixflow.runtime.config import ServerConfig
from radixflow.runtime.server.http_api import HttpDoor
from radixflow.runtime.server.metrics import Metrics

API_KEY = "route-secret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
WRONG = {"Authorization": f"Bearer {API_KEY}x"}
KEYLESS = {"/health"}  # the spec: SGLang's router and load balancers probe it without a key
READY = re.compile(r"^radixflow ready on (http://\S+) \(HTTP\) and (tcp://\S+) \(ZeroMQ\)")
# Minimal bodies, so a keyed call does real work where it can; any other POST gets {}.
ONE_TOKEN = {"max_new_tokens": 1, "temperature": 0}
BODIES = {
    "/generate": {"text": "Hi", "sampling_params": ONE_TOKEN},
    "/v1/completions": {"model": "default", "prompt": "Hi", "max_tokens": 1},
    "/v1/chat/completions": {
        "model": "default",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1,
    },
    "/v1/messages": {
        "model": "default",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "Hi"}],
    },
    "/v1/messages/count_tokens": {
        "model": "default",
        "messages": [{"role": "user", "content": "Hi"}],
    },
    "/v1/responses": {"model": "default", "input": "Hi", "max_output_tokens": 1},
    "/radixflow/score": {"prefix": "Yes or no:", "continuations": [" yes", " no"]},
    "/api/chat": {
        "model": "default",
        "messages": [{"role": "user", "content": "Hi"}],
        "stream": False,
        "options": {"num_predict": 1},
    },
    "/api/generate": {"model": "default", "prompt": "Hi", "options": {"num_predict": 1}},
    "/api/show": {"model": "default"},
    # SmolLM2 has no FIM tokens: a 400 after the key check (the FIM tests serve a FIM model)
    "/infill": {"input_prefix": "def f(", "input_suffix": ")", "n_predict": 1},
    "/abort_request": {"rid": "no-such-request"},
    "/concate_and_append_request": {"src_rids": ["a"], "dst_rid": "b"},
    "/v1/embeddings": {"model": "default", "input": "Hi"},
    "/api/embed": {"model": "default", "input": "Hi"},
    "/api/embeddings": {"model": "default", "prompt": "Hi"},
    "/tokenize": {"prompt": "Hi"},
    "/detokenize": {"tokens": [1, 2]},
    # no adapter of that name: a 400 after the key check (test_lora.py loads real ones)
    "/load_lora_adapter": {"lora_name": "x", "lora_path": "/no/such/adapter"},
    "/unload_lora_adapter": {"lora_name": "x"},
}
Call = Callable[[str, str, dict[str, str]], Awaitable[int]]


def start_server(*flags: str) -> tuple[subprocess.Popen[str], str]:
    """`radixflow serve` on free loopback ports; returns the process and its HTTP url."""
    cmd = [sys.executable, "-m", "radixflow.runtime", "serve", "--model-path", "smollm2"]
    cmd += ["--port", "0", "--num-threads", "1", "--log-level", "warning", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=read_lines, args=(proc, lines), daemon=True).start()
    try:
        while True:
            found = READY.match(lines.get(timeout=120))
            if found:
                return proc, found.group(1)
    except queue.Empty:
        proc.kill()
        raise AssertionError("the server printed no ready line in 120 s") from None


def read_lines(proc: subprocess.Popen[str], lines: queue.Queue[str]) -> None:
    for line in proc.stdout or ():
        lines.put(line)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    proc, http_url = start_server("--api-key", API_KEY, "--max-total-tokens", "4096")
    yield http_url
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


def stub_server() -> SimpleNamespace:
    """Just enough of a Server to build its HTTP app (handlers that need more fail with 500,
    which is still not 401)."""
    return SimpleNamespace(
        config=ServerConfig(api_key=API_KEY), counters=Counter(), metrics=Metrics(dict)
    )


def route_table(app: web.Application) -> list[tuple[str, str]]:
    """(method, path) of every route of `app`; a path parameter gets a sample value and an
    any-method route is called with GET and POST."""
    out = set()
    for route in app.router.routes():
        path = re.sub(r"\{[^}]*\}", "x", route.resource.canonical)
        for method in ("GET", "POST") if route.method == "*" else (route.method,):
            out.add((method, path))
    return sorted(out)


async def unguarded(routes: list[tuple[str, str]], call: Call) -> list[str]:
    """Each route that breaks the rule, with its statuses (no key, wrong key, right key):
    (401, 401, not 401), or no 401 at all for a KEYLESS path."""
    bad = []
    for method, path in routes:
        got = tuple([await call(method, path, headers) for headers in ({}, WRONG, AUTH)])
        keyless_ok = path in KEYLESS and 401 not in got
        keyed_ok = path not in KEYLESS and got[:2] == (401, 401) and got[2] != 401
        if not (keyless_ok or keyed_ok):
            bad.append(f"{method} {path} {got}")
    return bad


def body_of(method: str, path: str) -> dict | None:
    return BODIES.get(path, {}) if method in ("POST", "PUT", "PATCH") else None


async def walk_live(url: str, routes: list[tuple[str, str]]) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def call(method: str, path: str, headers: dict[str, str]) -> int:
            response = await client.request(
                method, path, json=body_of(method, path), headers=headers
            )
            return response.status_code

        return await unguarded(routes, call)


async def walk_in_process(app: web.Application) -> list[str]:
    async with TestClient(TestServer(app)) as client:

        async def call(method: str, path: str, headers: dict[str, str]) -> int:
            async with client.request(
                method, path, json=body_of(method, path), headers=headers
            ) as response:
                return response.status

        return await unguarded(route_table(app), call)


def test_every_route_wants_the_key_but_health(url: str) -> None:
    routes = route_table(HttpDoor(stub_server()).app)
    paths = {path for _, path in routes}
    # the table is the app's: SGLang's, OpenAI's and our own routes are all in it
    assert {"/generate", "/health", "/health_generate", "/metrics"} <= paths
    assert {"/v1/chat/completions", "/v1/models/x", "/radixflow/score"} <= paths
    assert {"/v1/messages", "/v1/messages/count_tokens"} <= paths
    assert asyncio.run(walk_live(url, routes)) == []


def test_health_generate_runs_the_model_with_the_key(url: str) -> None:
    assert httpx.get(f"{url}/health_generate", timeout=60).status_code == 401
    health = httpx.get(f"{url}/health_generate", headers=AUTH, timeout=60)
    assert health.status_code == 200 and health.json()["ok"] is True
    assert httpx.get(f"{url}/health", timeout=60).json()["ok"] is True
    unknown = httpx.get(f"{url}/no_such_route", timeout=60)
    assert unknown.status_code == 401  # no key: even a miss tells nothing about the routes


def test_the_walk_reports_a_route_that_skips_the_key() -> None:
    door = HttpDoor(stub_server())
    assert asyncio.run(walk_in_process(door.app)) == []

    async def leak(request: web.Request) -> web.Response:
        return web.json_response({"secret": "model weights"})

    door = HttpDoor(stub_server())
    door.app.router.add_get("/debug/leak", leak)
    door.public_paths = door.public_paths | {"/debug/leak"}  # the mistake: skips the key
    assert asyncio.run(walk_in_process(door.app)) == [
        "GET /debug/leak (200, 200, 200)",
        "HEAD /debug/leak (200, 200, 200)",
    ]
