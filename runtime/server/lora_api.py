"""SGLang's LoRA adapter routes: `POST /load_lora_adapter` {lora_name, lora_path} and
`POST /unload_lora_adapter` {lora_name}.

Both answer SGLang's shape, {"success", "error_message", "loaded_adapters": {name: path}},
200 when done and 400 when refused (a name already loaded or not loaded, an adapter that
cannot be served, an unload while requests run under it). The scheduler loads and unloads
between two steps (runtime/scheduler/loop.py), so running requests never change.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from radixflow.runtime.protocol.messages import LoadLoraAdapter, UnloadLoraAdapter
from radixflow.runtime.server.http_request import HttpError, json_response, new_rid, typed


class LoraRoutes:
    def __init__(self, door: Any) -> None:
        self.door = door

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/load_lora_adapter", self.load),
            web.post("/unload_lora_adapter", self.unload),
        ]

    async def load(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        path = typed(body, "lora_path", str)
        if not path:
            raise HttpError(400, "lora_path (a PEFT adapter directory) is required", "lora_path")
        return await self._answer(LoadLoraAdapter(new_rid(), self._name(body), path))

    async def unload(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        return await self._answer(UnloadLoraAdapter(new_rid(), self._name(body)))

    async def _body(self, request: web.Request) -> dict[str, Any]:
        body = await self.door.body(request)
        if not isinstance(body, dict):
            raise HttpError(400, "the body must be a JSON object")
        return body

    def _name(self, body: dict[str, Any]) -> str:
        name = typed(body, "lora_name", str)
        if not name:
            raise HttpError(400, "lora_name is required", "lora_name")
        return name

    async def _answer(self, msg: LoadLoraAdapter | UnloadLoraAdapter) -> web.Response:
        data = await self.door.ask(msg)
        return json_response(data, 200 if data["success"] else 400)
