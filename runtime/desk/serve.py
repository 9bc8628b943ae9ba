"""`radixflow serve` with several models (more than one `--model-path NAME=PATH`, or
`--models-dir`): plan every model's memory, open the front doors (HTTP and ZeroMQ), print
one ready line (`radixflow ready on http://HOST:PORT (HTTP) and tcp://HOST:PORT (ZeroMQ;
desk of N models: ...)`, which `Runtime` parses as a single server's), serve until
SIGTERM/SIGINT, then drain every loaded model."""

from __future__ import annotations

import asyncio
import logging
import signal

import zmq

from radixflow.runtime.config import ServerConfig
from radixflow.runtime.desk.catalog import (
    DeskConfigError,
    memory_cap,
    model_entries,
    parse_duration,
)
from radixflow.runtime.desk.desk import GIB, Desk
from radixflow.runtime.desk.plan import plan_models
from radixflow.runtime.desk.routes import DeskDoor
from radixflow.runtime.desk.zmq_door import DeskZmqDoor
from radixflow.runtime.protocol.transport import is_loopback

log = logging.getLogger("radixflow.desk")


def serve_desk(config: ServerConfig, log_level: str = "info") -> int:
    """Run the desk until SIGTERM/SIGINT; returns an exit code (2: bad flags)."""
    try:
        entries = model_entries(config)
        cap, source = memory_cap(config)
        keep_alive = parse_duration(config.keep_alive)
    except DeskConfigError as e:
        log.error("%s", e)
        print(f"radixflow failed to start: {e}", flush=True)
        return 2
    if not is_loopback(config.host) and not config.api_key:
        log.error("binding %s (not loopback) requires --api-key", config.host)
        print("radixflow failed to start: binding off loopback requires --api-key", flush=True)
        return 2
    log.info("memory cap for the models: %.2f GiB (%s)", cap / GIB, source)
    needs = plan_models(config, entries, cap, log_level)
    for entry in entries:
        need = needs[entry.name]
        if need.error:
            log.error("model %s (%s): %s", entry.name, entry.path, need.error)
        else:
            log.info("model %s (%s): needs %.2f GiB: weights %.2f, KV pool of %s tokens %.2f, "
                     "reserve %.2f", entry.name, entry.path, need.total / GIB, need.weights / GIB,
                     f"{need.kv_tokens:,}", need.kv_bytes / GIB, need.reserve / GIB)  # fmt: skip
    desk = Desk(config, entries, needs, cap, keep_alive, log_level)
    try:
        asyncio.run(run(desk, config))
    except (OSError, zmq.ZMQError) as e:  # a port is taken
        log.error("%s", e)
        print(f"radixflow failed to start: {e}", flush=True)
        return 1
    return 0


async def run(desk: Desk, config: ServerConfig) -> None:
    door = DeskDoor(desk, config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    url = await door.start(config.host, config.port)
    zmq_door = DeskZmqDoor(desk, config)
    try:
        # as the single server: --port 0 picks both ports free
        address = zmq_door.start(config.host, config.zmq_port if config.port else 0)
    except zmq.ZMQError:
        await door.stop()
        raise
    reaper = asyncio.create_task(desk.reap())
    names = " ".join(desk.slots)
    print(f"radixflow ready on {url} (HTTP) and {address} (ZeroMQ; desk of {len(desk.slots)} "
          f"models: {names})", flush=True)  # fmt: skip
    try:
        await stop.wait()
        log.info("stopping: draining every loaded model")
    finally:
        reaper.cancel()
        await desk.stop_all()  # the ZeroMQ door relays the final replies meanwhile
        zmq_door.stop()
        await door.stop()
