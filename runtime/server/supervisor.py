"""The server's scheduler process: spawned with the server's config, spoken to over two ipc://
queues, stopped by a Shutdown message (killed if it does not go), and watched: the server
restarts it when it dies, a few times in a row at most (server.py decides)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from typing import Any

import zmq

from radixflow.runtime.config import ServerConfig
from radixflow.runtime.protocol.messages import FROM_SCHEDULER, Shutdown
from radixflow.runtime.protocol.transport import (
    PullQueue,
    PushQueue,
    TransportError,
    make_ipc_dir,
    remove_ipc_dir,
)

log = logging.getLogger("radixflow.server")
SHUTDOWN_WAIT_S = 10.0


class SchedulerProcess:
    """`python -m radixflow.runtime scheduler` and its queues: `put` sends to it, `inbox`
    receives from it (its socket is polled by the server's loop)."""

    def __init__(self, ctx: zmq.Context, config: ServerConfig, log_level: str) -> None:
        self.config, self.log_level = config, log_level
        self.ipc = make_ipc_dir()
        self.outbox: PushQueue[Any] = PushQueue(ctx, self.ipc.to_scheduler, True)
        self.inbox: PullQueue[Any] = PullQueue(ctx, self.ipc.from_scheduler, True, FROM_SCHEDULER)
        self.proc: subprocess.Popen[bytes] | None = None
        self.spawns = 0

    @property
    def restarts(self) -> int:
        return max(self.spawns - 1, 0)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def spawn(self) -> None:
        self.spawns += 1
        config = dataclasses.asdict(self.config.replace(api_key=""))
        cmd = [sys.executable, "-m", "radixflow.runtime", "scheduler", "--ipc-dir"]
        cmd += [self.ipc.directory, "--parent-pid", str(os.getpid())]
        cmd += ["--config-json", json.dumps(config), "--log-level", self.log_level]
        # PYTHONSAFEPATH: `-m` would put the working directory first on sys.path, and a
        # checkout's kernels/ folder there shadows the `kernels` package transformers imports
        env = {**os.environ, "PYTHONSAFEPATH": "1"}
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(), env=env
        )

    def exit_code(self) -> int | None:
        """The process's exit code once it has exited (None while it runs or before spawn)."""
        return None if self.proc is None else self.proc.poll()

    def reap(self) -> int | None:
        """The exit code of a process that has exited, once (None while it runs, and after)."""
        code = self.exit_code()
        if code is not None:
            self.proc = None
        return code

    def put(self, message: Any) -> None:
        """Raises TransportError when the scheduler is not there to take it."""
        self.outbox.put(message)

    def stop(self) -> None:
        """Ask it to stop (a Shutdown message), kill it after SHUTDOWN_WAIT_S."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.outbox.put(Shutdown())
        except TransportError:
            self.proc.terminate()
        try:
            self.proc.wait(SHUTDOWN_WAIT_S)
        except subprocess.TimeoutExpired:
            log.error("scheduler did not stop in %.0fs; killing it", SHUTDOWN_WAIT_S)
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        self.stop()
        self.outbox.close()
        self.inbox.close()
        remove_ipc_dir(self.ipc)
