"""One loaded model of a desk: a child `radixflow serve` on loopback with free ports, as
data parallelism runs its replicas (runtime/distributed/data_parallel.py), started and
stopped from the desk's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys

from radixflow.runtime.config import ServerConfig
from radixflow.runtime.desk.catalog import ENV_AVAILABLE, ModelEntry
from radixflow.runtime.distributed.data_parallel import READY, die_with_parent, replica_flags

log = logging.getLogger("radixflow.desk")
# the desk's own flags; each child serves one model on loopback ports of its own
DESK_ONLY = ("model_path", "served_model_name", "models_dir", "keep_alive", "models_memory",
             "max_total_tokens", "host", "port", "zmq_port")  # fmt: skip
START_TIMEOUT_S = 600.0
KILL_AFTER_S = 30.0  # past --shutdown-timeout: SIGKILL


class ChildError(RuntimeError):
    """A model's server could not start (it exited, or said why it failed)."""


def child_command(
    config: ServerConfig, entry: ModelEntry, tokens: int, log_level: str
) -> list[str]:
    flags = [f for f in replica_flags(config)]
    cmd = [sys.executable, "-m", "radixflow.runtime", "serve"]
    cmd += drop_flags(flags, DESK_ONLY)
    cmd += ["--model-path", entry.path, "--served-model-name", entry.name]
    cmd += ["--host", "127.0.0.1", "--port", "0", "--zmq-port", "0"]
    cmd += ["--max-total-tokens", str(tokens), "--log-level", log_level]
    return cmd


def drop_flags(flags: list[str], names: tuple[str, ...]) -> list[str]:
    """`flags` (as replica_flags writes them: --x VALUE, --x, --no-x) without `names`'."""
    dropped = {"--" + n.replace("_", "-") for n in names}
    out, skip = [], False
    for i, flag in enumerate(flags):
        if skip:
            skip = False
            continue
        if flag in dropped:
            takes_value = i + 1 < len(flags) and not flags[i + 1].startswith("--")
            skip = takes_value
            continue
        out.append(flag)
    return out


class Child:
    """A model's `radixflow serve` process: `start` until its ready line, `stop` drains it."""

    def __init__(self, entry: ModelEntry, command: list[str], cap: int) -> None:
        self.entry, self.command, self.cap = entry, command, cap
        self.process: asyncio.subprocess.Process | None = None
        self.url = ""
        self.zmq = ""  # its ZeroMQ door (tcp://127.0.0.1:PORT)
        self.pump: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else 0

    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def start(self) -> str:
        """Spawn and wait for the ready line; returns the child's URL. Raises ChildError."""
        # the child plans its pool against the desk's cap, as on a machine of that size
        env = {**os.environ, "PYTHONSAFEPATH": "1", ENV_AVAILABLE: str(self.cap)}
        self.process = await asyncio.create_subprocess_exec(
            *self.command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            env=env,
            preexec_fn=die_with_parent,
        )
        try:
            self.url = await asyncio.wait_for(self.ready(), START_TIMEOUT_S)
        except (TimeoutError, ChildError, asyncio.CancelledError):
            await self.stop(0.0)
            raise
        self.pump = asyncio.create_task(self.drain_stdout())  # never block on a full pipe
        return self.url

    async def ready(self) -> str:
        assert self.process is not None and self.process.stdout is not None
        while True:
            raw = await self.process.stdout.readline()
            if not raw:
                code = await self.process.wait()
                raise ChildError(f"the server of {self.entry.name} exited ({code}) while starting")
            line = raw.decode(errors="replace")
            found = READY.search(line)
            if found:
                self.zmq = found.group(2)
                return found.group(1)
            if line.startswith("radixflow failed to start:"):
                raise ChildError(line.strip().removeprefix("radixflow failed to start: "))

    async def drain_stdout(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        while await self.process.stdout.readline():
            pass

    async def stop(self, drain_s: float) -> int | None:
        """SIGTERM (the child answers what it has in flight for up to `drain_s`, its
        --shutdown-timeout), SIGKILL KILL_AFTER_S later; returns the exit code."""
        process = self.process
        if process is None:
            return None
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), drain_s + KILL_AFTER_S)
            except TimeoutError:
                log.error("%s (pid %d) did not stop; killing it", self.entry.name, process.pid)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        if self.pump is not None:
            self.pump.cancel()
        return process.returncode
