"""`radixflow serve`: a Server run until SIGINT/SIGTERM, its one stdout line saying it is
ready (with its addresses) or why it failed to start; both are parsed by `Runtime`."""

from __future__ import annotations

import asyncio
import logging
import signal

from radixflow.runtime.config import ServerConfig
from radixflow.runtime.server.server import Server, ServerStartError

log = logging.getLogger("radixflow.server")


def ready_line(http_url: str, zmq_address: str) -> str:
    """The one stdout line that says the server can serve (parsed by `Runtime`)."""
    return f"radixflow ready on {http_url} (HTTP) and {zmq_address} (ZeroMQ)"


def failed_line(reason: object) -> str:
    """The stdout line of a server that could not start (`Runtime` raises with it)."""
    return f"radixflow failed to start: {reason}"


def serve(config: ServerConfig, log_level: str = "info") -> int:
    """Run a server until SIGINT/SIGTERM; print the ready line on stdout. Returns an exit code."""
    try:
        server = Server(config, log_level)
    except ServerStartError as e:
        log.error("%s", e)
        print(failed_line(e), flush=True)
        return 1
    signal.signal(signal.SIGTERM, server.request_stop)  # while loading; the loop's own after
    signal.signal(signal.SIGINT, server.request_stop)
    try:
        server.start()
        asyncio.run(
            server.run(lambda url, zmq_address: print(ready_line(url, zmq_address), flush=True))
        )
    except (ServerStartError, OSError) as e:  # OSError: the HTTP port is taken
        log.error("%s", e)
        print(failed_line(e), flush=True)
        return 1
    finally:
        server.close()
    return 0
