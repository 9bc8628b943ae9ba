"""CORS: browser pages of the allowed origins (by default the loopback ones) may call the API,
the key still applies, and a foreign origin gets no allow header. In process on the aiohttp
app for the headers, then from a real headless Chromium (Debian's `chromium` package, which
scripts/setup.sh installs where it can; the browser test skips only where it is missing): a
page served from a loopback origin calls /v1/chat/completions with `fetch` and reads the
reply, and the same page from a foreign origin is blocked by the browser itself."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestClient, TestServer
from test_auth_routes import API_KEY, stub_server

from radixflow.runtime.server.cors import Cors
from radixflow.runtime.server.http_api import HttpDoor

PAGE_ORIGIN = "http://localhost:5173"
FOREIGN = "https://evil.example"


def preflight_headers(origin: str, headers: str = "authorization,content-type") -> dict:
    return {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": headers,
    }


async def answers(door: HttpDoor, calls: list[tuple[str, str, dict]]) -> list[tuple[int, dict]]:
    async with TestClient(TestServer(door.app)) as client:
        out = []
        for method, path, headers in calls:
            async with client.request(method, path, headers=headers) as response:
                out.append((response.status, dict(response.headers)))
        return out


def test_preflight_allows_loopback_origins_only_by_default() -> None:
    door = HttpDoor(stub_server())
    (ok, foreign, public) = asyncio.run(
        answers(
            door,
            [
                ("OPTIONS", "/v1/chat/completions", preflight_headers(PAGE_ORIGIN)),
                ("OPTIONS", "/v1/chat/completions", preflight_headers(FOREIGN)),
                ("OPTIONS", "/generate", preflight_headers("http://127.0.0.9:8080")),
            ],
        )
    )
    assert ok[0] == 204  # no key on a preflight: browsers send none
    assert ok[1]["Access-Control-Allow-Origin"] == PAGE_ORIGIN
    assert "POST" in ok[1]["Access-Control-Allow-Methods"]
    assert ok[1]["Access-Control-Allow-Headers"] == "authorization,content-type"
    assert foreign[0] == 204 and "Access-Control-Allow-Origin" not in foreign[1]
    assert public[1]["Access-Control-Allow-Origin"] == "http://127.0.0.9:8080"


def test_real_requests_carry_the_header_and_still_need_the_key() -> None:
    door = HttpDoor(stub_server())
    auth = {"Authorization": f"Bearer {API_KEY}"}
    (keyless, keyed, foreign) = asyncio.run(
        answers(
            door,
            [
                ("GET", "/v1/models", {"Origin": PAGE_ORIGIN}),
                ("GET", "/health", {"Origin": PAGE_ORIGIN, **auth}),
                ("GET", "/health", {"Origin": FOREIGN, **auth}),
            ],
        )
    )
    assert keyless[0] == 401  # the error answer still tells the page why
    assert keyless[1]["Access-Control-Allow-Origin"] == PAGE_ORIGIN
    assert keyed[1]["Access-Control-Allow-Origin"] == PAGE_ORIGIN
    assert "Access-Control-Allow-Origin" not in foreign[1]


def test_allowed_origins_list_and_any() -> None:
    listed = Cors("https://app.example, http://localhost:3000", "GET,POST", "*")
    assert listed.allows("https://app.example") and listed.allows("http://localhost:3000")
    assert not listed.allows("http://localhost:3001")  # a list replaces the loopback default
    assert not listed.allows("https://app.example.evil")
    assert Cors("*", "GET", "*").allows(FOREIGN)
    loopback = Cors("", "GET", "*")
    assert loopback.allows("http://[::1]:8000") and loopback.allows("https://127.0.0.1")
    assert not loopback.allows("http://localhost.evil.example")
    assert not loopback.allows("http://127.0.0.1.evil.example:80")


# ---- a real browser ------------------------------------------------------------------------

PAGE = "<!doctype html><title>page</title><p>a page that calls the local model</p>"


@pytest.fixture(scope="module")
def page_port() -> Iterator[int]:
    """A static page on a loopback port (its own event loop in a thread)."""
    ready: dict[str, int] = {}
    loop = asyncio.new_event_loop()

    async def page(request: web.Request) -> web.Response:
        return web.Response(text=PAGE, content_type="text/html")

    async def serve() -> web.AppRunner:
        app = web.Application()
        app.router.add_get("/", page)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        ready["port"] = site._server.sockets[0].getsockname()[1]
        return runner

    runner = loop.run_until_complete(serve())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield ready["port"]
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def fetch_script(api: str) -> str:
    body = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}
    return f"""
        fetch({json.dumps(api + "/v1/chat/completions")}, {{
            method: "POST",
            headers: {{"Content-Type": "application/json",
                       "Authorization": "Bearer {API_KEY}"}},
            body: {json.dumps(json.dumps(body))},
        }}).then(r => r.json()).then(j => JSON.stringify(j)).catch(e => "blocked: " + e)
    """


async def evaluate_in_page(chromium: str, page: str, script: str) -> str:
    """Open `page` in headless Chromium and run `script` there (the DevTools protocol over
    its websocket); returns the script's string value. foreign.test resolves to 127.0.0.1."""
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        proc = subprocess.Popen(
            [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
             f"--user-data-dir={profile}", "--remote-debugging-port=0",
             "--host-resolver-rules=MAP foreign.test 127.0.0.1", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            port_file = Path(profile) / "DevToolsActivePort"
            deadline = time.monotonic() + 60
            while not port_file.exists() or not port_file.read_text().strip():
                assert time.monotonic() < deadline, "Chromium opened no DevTools port"
                await asyncio.sleep(0.1)
            port = port_file.read_text().split()[0]
            async with ClientSession() as http:
                async with http.get(f"http://127.0.0.1:{port}/json/list") as response:
                    target = next(t for t in await response.json() if t["type"] == "page")
                async with http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                    counter = iter(range(1, 1000))

                    async def call(method: str, **params: object) -> dict:
                        ident = next(counter)
                        await ws.send_json({"id": ident, "method": method, "params": params})
                        while True:
                            message = await ws.receive_json(timeout=120)
                            if message.get("id") == ident:
                                return message.get("result", {})

                    await call("Page.enable")
                    await call("Page.navigate", url=page)
                    for _ in range(100):  # until the page's origin is the one navigated to
                        done = await call(
                            "Runtime.evaluate", expression="location.origin", returnByValue=True
                        )
                        if page.startswith(done.get("result", {}).get("value", "-")):
                            break
                        await asyncio.sleep(0.1)
                    result = await call(
                        "Runtime.evaluate", expression=script, awaitPromise=True,
                        returnByValue=True,
                    )  # fmt: skip
                    return result["result"]["value"]
        finally:
            proc.kill()
            proc.wait(30)


def test_a_browser_page_calls_the_api_from_a_loopback_origin_only(
    shared_server: Any, page_port: int
) -> None:
    """The page sends an Authorization header, so the browser preflights every call (the
    shared server checks no key: the key with CORS is tested in process above)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed here (scripts/setup.sh installs it)")
    script = fetch_script(shared_server.url)
    allowed = asyncio.run(evaluate_in_page(chromium, f"http://localhost:{page_port}/", script))
    reply = json.loads(allowed)
    assert reply["object"] == "chat.completion", reply
    assert reply["usage"]["completion_tokens"] >= 1
    blocked = asyncio.run(evaluate_in_page(chromium, f"http://foreign.test:{page_port}/", script))
    assert blocked.startswith("blocked: TypeError"), blocked
