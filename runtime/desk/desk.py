"""The desk's bookkeeping: which models are loaded, which are busy, when each expires, and
the memory they hold together under the cap. Every load, unload and eviction goes through
one lock, so two requests never start the same model twice nor evict past each other; the
loads themselves run outside it (a request for a loaded model never waits on another's load).

A model's states: unloaded -> loading -> loaded -> stopping -> unloaded. `acquire` loads a
model (evicting idle ones, least recently used first, until its need fits under the cap)
and counts the request in; `release` counts it out and sets when the model expires: now +
keep-alive (the request's own, Ollama's `keep_alive`, else --keep-alive), never for -1. The
reaper unloads expired idle models and notices children that died.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from radixflow.runtime.config import ServerConfig
from radixflow.runtime.desk.catalog import ModelEntry
from radixflow.runtime.desk.children import Child, ChildError, child_command
from radixflow.runtime.desk.plan import Need
from radixflow.runtime.protocol.messages import ERROR_SHUTDOWN, ERROR_UNAVAILABLE
from radixflow.runtime.server.http_request import HttpError

log = logging.getLogger("radixflow.desk")
GIB = 1 << 30
REAP_EVERY_S = 0.2
LOAD_GRACE_S = 2.0  # a model just loaded stays at least this long for the requests it waits on
UNSET: Any = object()  # no keep_alive in the request: the desk's default


@dataclass(eq=False)
class Slot:
    """One model of the desk and, while loaded, its child server."""

    entry: ModelEntry
    need: Need
    state: str = "unloaded"  # unloaded, loading, loaded, stopping
    child: Child | None = None
    loading: asyncio.Task[None] | None = None
    active: int = 0  # requests in flight
    last_used: float = 0.0  # monotonic
    expires: float | None = None  # monotonic; None: never (or busy)
    info: dict[str, Any] = field(default_factory=dict)  # the child's /get_model_info

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def resident(self) -> bool:
        return self.state in ("loading", "loaded", "stopping")


class Desk:
    def __init__(
        self,
        config: ServerConfig,
        entries: list[ModelEntry],
        needs: dict[str, Need],
        cap: int,
        keep_alive: float | None,
        log_level: str = "info",
    ) -> None:
        self.config, self.cap, self.keep_alive, self.log_level = config, cap, keep_alive, log_level
        self.slots = {e.name: Slot(e, needs[e.name]) for e in entries}
        self.default = entries[0].name
        self.lock = asyncio.Lock()
        self.draining = False
        self.counts: Counter[tuple[str, str]] = Counter()  # (event, model) -> count

    # ---- names ---------------------------------------------------------------------------

    def find(self, name: str | None) -> Slot | None:
        """The model a request names: its name, NAME:latest (Ollama's tag), "default" or no
        name for the first model; None when unknown."""
        if name is None or name in ("", "default"):
            return self.slots[self.default]
        return self.slots.get(name) or self.slots.get(name.removesuffix(":latest"))

    def resident_bytes(self) -> int:
        return sum(s.need.total for s in self.slots.values() if s.resident)

    # ---- requests ------------------------------------------------------------------------

    async def acquire(self, slot: Slot) -> Child:
        """Count a request in on `slot`'s model, loading it first if need be; returns its
        child. Raises HttpError: 503 while draining or when busy models hold the memory it
        needs, 500 when it cannot fit even alone or fails to load."""
        while True:
            if self.draining:
                raise HttpError(503, "the server is shutting down", code=ERROR_SHUTDOWN)
            if slot.state == "loaded" and slot.child is not None and slot.child.alive():
                slot.active += 1
                slot.expires = None
                return slot.child
            if slot.state == "loading" and slot.loading is not None:
                await asyncio.shield(slot.loading)
                continue
            async with self.lock:
                if slot.state != "unloaded":
                    continue
                self.check_fits(slot)
                await self.make_room(slot)
                slot.state = "loading"
                slot.loading = asyncio.create_task(self.load(slot))
                slot.loading.add_done_callback(lambda t: t.cancelled() or t.exception())

    def release(self, slot: Slot, keep_alive: Any = UNSET) -> None:
        """Count a request out; the model expires keep-alive after its last request."""
        slot.active -= 1
        assert slot.active >= 0, f"{slot.name}: {slot.active=}"
        now = time.monotonic()
        slot.last_used = now
        keep = self.keep_alive if keep_alive is UNSET else keep_alive
        if slot.active == 0:
            slot.expires = None if keep is None else now + keep

    def check_fits(self, slot: Slot) -> None:
        if slot.need.error:
            self.counts[("refused", slot.name)] += 1
            log.error("refused %s: %s", slot.name, slot.need.error)
            raise HttpError(500, f"model '{slot.name}' {slot.need.error}")
        if slot.need.total > self.cap:
            self.counts[("refused", slot.name)] += 1
            message = (
                f"model '{slot.name}' needs {slot.need.total / GIB:.2f} GiB (weights, KV pool, "
                f"reserve) but the desk's memory cap is {self.cap / GIB:.2f} GiB: cannot fit "
                "even alone (--models-memory)"
            )
            log.error("refused %s: %s", slot.name, message)
            raise HttpError(500, message)

    async def make_room(self, slot: Slot) -> None:
        """Unload idle models, least recently used first, until `slot`'s need fits under the
        cap (called under the lock). Raises a 503 HttpError, evicting nothing, when even
        every idle model would not make room."""
        idle = sorted(
            (s for s in self.slots.values() if s.state == "loaded" and s.active == 0),
            key=lambda s: s.last_used,
        )
        over = self.resident_bytes() + slot.need.total - self.cap
        if over > sum(s.need.total for s in idle):
            busy = [s.name for s in self.slots.values() if s.resident and s not in idle]
            self.counts[("busy", slot.name)] += 1
            raise HttpError(
                503,
                f"no room for model '{slot.name}' ({slot.need.total / GIB:.2f} GiB) under the "
                f"memory cap of {self.cap / GIB:.2f} GiB while {', '.join(busy)} serve "
                "requests; retry later",
                code=ERROR_UNAVAILABLE,
            )
        for victim in idle:
            if self.resident_bytes() + slot.need.total <= self.cap:
                break
            log.info("evicting %s (least recently used) to make room for %s", victim.name,
                     slot.name)  # fmt: skip
            self.counts[("evictions", victim.name)] += 1
            await self.stop(victim, "evicted")

    async def load(self, slot: Slot) -> None:
        """Start `slot`'s child and read its model info; on failure the slot is unloaded
        again and the error (a 500 HttpError) goes to every request waiting on it."""
        started = time.monotonic()
        tokens = slot.need.kv_tokens or self.config.max_total_tokens
        command = child_command(self.config, slot.entry, tokens, self.log_level)
        child = Child(slot.entry, command, self.cap)
        log.info("loading %s from %s (needs %.2f GiB; %.2f of %.2f GiB resident)", slot.name,
                 slot.entry.path, slot.need.total / GIB, self.resident_bytes() / GIB,
                 self.cap / GIB)  # fmt: skip
        try:
            await child.start()
            slot.info = await self.model_info(child)
        except (ChildError, TimeoutError, aiohttp.ClientError, ValueError) as e:
            await child.stop(0.0)
            slot.state, slot.loading = "unloaded", None
            self.counts[("load_failures", slot.name)] += 1
            log.error("loading %s failed: %s", slot.name, e)
            raise HttpError(500, f"model '{slot.name}' failed to load: {e}") from e
        except asyncio.CancelledError:
            slot.state, slot.loading = "unloaded", None
            raise
        slot.child, slot.state, slot.loading = child, "loaded", None
        now = time.monotonic()
        slot.last_used = now
        keep = self.keep_alive
        slot.expires = None if keep is None else now + max(keep, LOAD_GRACE_S)
        self.counts[("loads", slot.name)] += 1
        log.info("loaded %s in %.1fs: pid %d on %s, KV pool of %s tokens", slot.name,
                 now - started, child.pid, child.url, f"{slot.need.kv_tokens:,}")  # fmt: skip

    async def model_info(self, child: Child) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(f"{child.url}/get_model_info", headers=headers) as reply:
                reply.raise_for_status()
                return await reply.json()

    async def stop(self, slot: Slot, reason: str) -> None:
        """Stop an idle loaded model's child (under the lock) and wait until it exits: its
        memory is free when this returns."""
        child = slot.child
        if slot.state != "loaded" or slot.active or child is None:
            return
        slot.state = "stopping"
        code = await child.stop(self.config.shutdown_timeout)
        slot.state, slot.child, slot.expires = "unloaded", None, None
        self.counts[("unloads", slot.name)] += 1
        log.info("unloaded %s (%s): pid %d exited (%s), %.2f GiB freed", slot.name, reason,
                 child.pid, code, slot.need.total / GIB)  # fmt: skip

    async def unload(self, slot: Slot, reason: str) -> bool:
        """Unload `slot`'s model now if it is idle; whether it is unloaded."""
        async with self.lock:
            await self.stop(slot, reason)
        return slot.state == "unloaded"

    # ---- background ----------------------------------------------------------------------

    async def reap(self) -> None:
        """Forever: unload expired idle models; forget children that died."""
        while True:
            await asyncio.sleep(REAP_EVERY_S)
            now = time.monotonic()
            for slot in self.slots.values():
                child = slot.child
                if slot.state == "loaded" and child is not None and not child.alive():
                    log.error("the server of %s exited (%s) unexpectedly", slot.name,
                              child.process.returncode if child.process else None)  # fmt: skip
                    slot.state, slot.child = "unloaded", None
                    self.counts[("crashes", slot.name)] += 1
                elif slot.state == "loaded" and not slot.active and slot.expires is not None:
                    if now >= slot.expires:
                        await self.unload(slot, "keep-alive expired")

    async def stop_all(self) -> None:
        """Drain: refuse new requests; every child answers what it has in flight (its own
        SIGTERM drain, up to --shutdown-timeout) and exits."""
        self.draining = True
        for slot in self.slots.values():
            if slot.loading is not None:
                slot.loading.cancel()
        children = [s.child for s in self.slots.values() if s.child is not None]
        log.info("stopping %d loaded models", len(children))
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*(c.stop(self.config.shutdown_timeout) for c in children))
        for slot in self.slots.values():
            if slot.child is not None:
                self.counts[("unloads", slot.name)] += 1
            slot.state, slot.child = "unloaded", None
