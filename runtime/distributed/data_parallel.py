"""`radixflow serve --dp-size N`: N replicas behind SGLang's router, one supervisor process.

Each replica is a child `radixflow serve` (its own server, scheduler process and KV pool) on
loopback with free ports; on CPU each gets `--threads-per-replica` torch threads (default:
cores / N), on CUDA one GPU each (CUDA_VISIBLE_DEVICES). When every replica has printed its
ready line, `sglang-router launch --worker-urls ...` starts on `--host`/`--port` with
`--policy` = `--router-policy`, and once the router reports every worker healthy this process
prints one ready line: `radixflow ready on http://HOST:PORT (HTTP, sglang-router ...)`, which
`radixflow.Runtime` parses (no ZeroMQ address: clients speak HTTP to the router).

What the router calls on a worker (sglang-router 0.3.2, observed): at registration an HTTP/2
probe (gRPC detection; the worker answers 400 and it falls back to HTTP), `GET /health`,
`GET /server_info`, `GET /model_info`; then `GET /health` every `--health-check-interval-secs`;
`GET /get_load` (power_of_two); it forwards `/generate` (one prompt per request: a batch
body is refused by the router itself), `/v1/chat/completions`, `/v1/completions`,
`/v1/models`, `/get_model_info`, and fans `/flush_cache` out to every worker, each with
`Authorization: Bearer <--api-key>`.

Supervision: SIGTERM/SIGINT stop the router first (no new traffic), then every replica
(SIGTERM: each answers what it has in flight), then exit 0. A replica that dies unexpectedly
is restarted on the same ports (at most MAX_RESTARTS times), so the router's health checks
take it back; meanwhile the router's retries send its traffic to the others. If the router
itself dies, everything stops and the exit code is 1.

Rolling restart: SIGHUP restarts the replicas one at a time (new code, new weights on disk)
without losing a request. For each: the router forgets it (`DELETE /workers/{id}`: no new
requests reach it; those in flight carry on), it drains (SIGTERM: it finishes what it has in
flight, up to --shutdown-timeout), a new replica starts on its ports, the router takes it
back (`POST /workers`) and, once the router reports it healthy, the next one goes. The others
serve meanwhile.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib.util
import logging
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx

from radixflow.runtime.config import ServerConfig
from radixflow.runtime.protocol.transport import is_loopback

log = logging.getLogger("radixflow.data_parallel")

READY = re.compile(r"radixflow ready on (http://\S+) \(HTTP\) and (tcp://\S+)")
INSTALL_HINT = (
    "--dp-size needs SGLang's router: pip install sglang-router (or pip install "
    "'radixflow[router]'); it puts `sglang-router` on PATH"
)
ROUTER_ONLY = ("dp_size", "threads_per_replica", "router_policy", "host", "port", "zmq_port")
START_TIMEOUT_S = 600.0
ROUTER_TIMEOUT_S = 120.0
STOP_WAIT_S = 30.0
MAX_RESTARTS = 5
HEALTH_CHECK_INTERVAL_S = 2  # the router's; its default (60 s) leaves a dead replica listed long
CIRCUIT_OPEN_S = 10  # the router's wait before it tries a failed worker again (default 60 s)


class DataParallelError(RuntimeError):
    """The replicas or the router could not start (router not installed, a replica failed)."""


@dataclass
class Replica:
    index: int
    process: subprocess.Popen[bytes]
    lines: queue.Queue[str] = field(default_factory=queue.Queue)
    url: str = ""
    zmq_address: str = ""
    restarts: int = 0


def router_command() -> list[str]:
    """How to run `sglang-router launch`; raises DataParallelError when it is not installed."""
    binary = shutil.which("sglang-router")
    if binary:
        return [binary, "launch"]
    if importlib.util.find_spec("sglang_router") is not None:
        return [sys.executable, "-m", "sglang_router.launch_router"]
    raise DataParallelError(INSTALL_HINT)


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def replica_flags(config: ServerConfig) -> list[str]:
    """The replica's `radixflow serve` flags: every knob the user changed but the router's."""
    flags = []
    for f in dataclasses.fields(ServerConfig):
        value = getattr(config, f.name)
        if f.name in ROUTER_ONLY or value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, tuple):
            flags += [flag, *value]
        else:
            flags += [flag, str(value)]
    return flags


def uses_cuda(config: ServerConfig) -> bool:
    if config.device != "auto":
        return config.device == "cuda"
    import torch  # noqa: PLC0415 (heavy: the supervisor only decides; the replicas load the model)

    return torch.cuda.is_available()


class DataParallel:
    """The supervisor: start replicas and router, print the ready line, watch, stop."""

    def __init__(self, config: ServerConfig, log_level: str = "info") -> None:
        if not is_loopback(config.host) and not config.api_key:
            raise DataParallelError(
                f"binding {config.host} (not loopback) requires --api-key; the router passes "
                "it to the replicas and clients must send it"
            )
        self.config, self.log_level = config, log_level
        self.router_cmd = router_command()  # fail before loading N models
        self.cuda = uses_cuda(config)
        self.replicas: list[Replica] = []
        self.router: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.stopping = False
        self.rolling = False  # SIGHUP: restart every replica in turn

    # ---- start ----------------------------------------------------------------------------

    def replica_command(self, index: int, port: int = 0, zmq_port: int = 0) -> list[str]:
        cmd = [sys.executable, "-m", "radixflow.runtime", "serve", *replica_flags(self.config)]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--zmq-port", str(zmq_port)]
        if not self.cuda and "--num-threads" not in cmd:
            cores = os.cpu_count() or 1
            threads = self.config.threads_per_replica or max(1, cores // self.config.dp_size)
            cmd += ["--num-threads", str(threads)]
        return cmd + ["--log-level", self.log_level]

    def spawn(self, index: int, port: int = 0, zmq_port: int = 0) -> Replica:
        env = {**os.environ, "PYTHONSAFEPATH": "1"}  # as the server's scheduler (server.py)
        if self.cuda:
            env["CUDA_VISIBLE_DEVICES"] = str(index)
        process = subprocess.Popen(
            self.replica_command(index, port, zmq_port),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            env=env,
            preexec_fn=die_with_parent,
        )
        replica = Replica(index, process)
        threading.Thread(target=pump_lines, args=(process, replica.lines), daemon=True).start()
        return replica

    def wait_ready(self, replica: Replica, deadline: float) -> None:
        """Until the replica's ready line; raises DataParallelError if it exits or times out."""
        while time.monotonic() < deadline and not self.stopping:
            try:
                line = replica.lines.get(timeout=0.2)
            except queue.Empty:
                if replica.process.poll() is not None:
                    raise DataParallelError(
                        f"replica {replica.index} exited ({replica.process.returncode}) while "
                        "starting; see its log above"
                    ) from None
                continue
            found = READY.search(line)
            if found:
                replica.url, replica.zmq_address = found.group(1), found.group(2)
                log.info("replica %d ready on %s", replica.index, replica.url)
                return
        raise DataParallelError(f"replica {replica.index} did not start in time")

    def start(self) -> str:
        """Start replicas and router; returns the router's URL. Raises DataParallelError."""
        deadline = time.monotonic() + START_TIMEOUT_S
        self.replicas = [self.spawn(i) for i in range(self.config.dp_size)]
        for replica in self.replicas:
            self.wait_ready(replica, deadline)
        host = self.config.host
        port = self.config.port or free_port(host)
        cmd = [*self.router_cmd, "--host", host, "--port", str(port)]
        cmd += ["--worker-urls", *[r.url for r in self.replicas]]
        cmd += ["--policy", self.config.router_policy]
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port("127.0.0.1"))]
        cmd += ["--health-check-interval-secs", str(HEALTH_CHECK_INTERVAL_S)]
        cmd += ["--shutdown-grace-period-secs", str(int(STOP_WAIT_S) // 2)]
        cmd += ["--cb-timeout-duration-secs", str(CIRCUIT_OPEN_S)]
        cmd += ["--log-level", {"warning": "warn"}.get(self.log_level, self.log_level)]
        if self.config.api_key:
            cmd += ["--api-key", self.config.api_key]
        self.router = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(), preexec_fn=die_with_parent
        )
        literal = f"[{host}]" if ":" in host else host
        self.url = f"http://{literal}:{port}"
        self.wait_router()
        return self.url

    def wait_router(self) -> None:
        """Until the router lists every replica as a healthy worker."""
        assert self.router is not None
        deadline = time.monotonic() + ROUTER_TIMEOUT_S
        while time.monotonic() < deadline and not self.stopping:
            if self.router.poll() is not None:
                raise DataParallelError(f"sglang-router exited ({self.router.returncode})")
            if self.healthy_workers() >= len(self.replicas):
                return
            time.sleep(0.3)
        raise DataParallelError("sglang-router did not register every replica in time")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}

    def workers(self) -> list[dict]:
        """The router's worker list (`GET /workers`); empty when it does not answer."""
        try:
            reply = httpx.get(f"{self.url}/workers", headers=self.headers, timeout=5)
            return reply.json().get("workers", [])
        except (httpx.HTTPError, ValueError, AttributeError):
            return []

    def healthy_workers(self) -> int:
        return sum(1 for w in self.workers() if w.get("is_healthy"))

    # ---- run and stop ---------------------------------------------------------------------

    def watch(self) -> int:
        """Until SIGTERM/SIGINT (0) or the router's death (1); restarts dead replicas, and
        every replica in turn after a SIGHUP."""
        while not self.stopping:
            time.sleep(0.2)
            if self.router is not None and self.router.poll() is not None:
                log.error("sglang-router exited (%s); stopping", self.router.returncode)
                return 1
            for i, replica in enumerate(self.replicas):
                if replica.process.poll() is not None and not self.stopping:
                    self.replicas[i] = self.restart(replica)
            if self.rolling:
                self.rolling = False
                self.rolling_restart()
        return 0

    def request_rolling_restart(self, *_: object) -> None:
        """SIGHUP handler: the watch loop restarts every replica in turn."""
        self.rolling = True

    def rolling_restart(self) -> None:
        """Replace each replica in turn; stops at the first that fails to come back (the
        watch loop restarts it if it died, and the router is told about it again)."""
        log.info("rolling restart of %d replicas", len(self.replicas))
        for i in range(len(self.replicas)):
            if self.stopping:
                return
            try:
                self.replace(i)
            except DataParallelError as e:
                log.error("rolling restart stopped at replica %d: %s", i, e)
                with contextlib.suppress(DataParallelError):
                    self.router_call("POST", self.replicas[i].url)
                return
        log.info("rolling restart done")

    def replace(self, i: int) -> None:
        """Take replica `i` out of the router, let it drain and exit, start a new one on its
        ports and wait until the router routes to it again. Raises DataParallelError."""
        old = self.replicas[i]
        self.router_call("DELETE", old.url)
        terminate([old.process], self.config.shutdown_timeout + STOP_WAIT_S)
        log.info("replica %d drained (exit %s); starting it again", i, old.process.returncode)
        new = self.spawn(old.index, port_of(old.url), port_of(old.zmq_address))
        new.url, new.zmq_address = old.url, old.zmq_address
        self.replicas[i] = new
        self.wait_ready(new, time.monotonic() + START_TIMEOUT_S)
        self.router_call("POST", new.url)
        deadline = time.monotonic() + ROUTER_TIMEOUT_S
        while not any(w.get("url") == new.url and w.get("is_healthy") for w in self.workers()):
            if time.monotonic() > deadline or self.stopping:
                raise DataParallelError(f"the router did not take {new.url} back in time")
            time.sleep(0.3)

    def router_call(self, method: str, url: str) -> None:
        """Remove (DELETE /workers/{id}) or add (POST /workers) a worker at the router."""
        if method == "DELETE":
            ids = [w["id"] for w in self.workers() if w.get("url") == url]
            requests = [("DELETE", f"{self.url}/workers/{i}", None) for i in ids]
        else:
            body = {"url": url, **({"api_key": self.config.api_key} if self.config.api_key else {})}
            requests = [("POST", f"{self.url}/workers", body)]
        for verb, target, body in requests:
            try:
                reply = httpx.request(verb, target, json=body, headers=self.headers, timeout=30)
            except httpx.HTTPError as e:
                raise DataParallelError(f"{verb} {target}: {e}") from e
            if reply.status_code >= 300:
                raise DataParallelError(f"{verb} {target}: {reply.status_code} {reply.text}")

    def restart(self, dead: Replica) -> Replica:
        code = dead.process.returncode
        if dead.restarts >= MAX_RESTARTS:
            if dead.restarts == MAX_RESTARTS:
                log.error("replica %d died %d times; not restarting it", dead.index, dead.restarts)
                dead.restarts += 1
            return dead
        log.error("replica %d exited (%s); restarting it on %s", dead.index, code, dead.url)
        replica = self.spawn(dead.index, port_of(dead.url), port_of(dead.zmq_address))
        replica.url, replica.zmq_address = dead.url, dead.zmq_address  # until its ready line
        replica.restarts = dead.restarts + 1
        return replica

    def request_stop(self, *_: object) -> None:
        self.stopping = True

    def stop(self) -> None:
        """Router first (no new requests), then every replica (each drains its requests in
        flight for up to --shutdown-timeout); SIGKILL STOP_WAIT_S after that."""
        self.stopping = True
        if self.router is not None:
            terminate([self.router], STOP_WAIT_S)
        terminate([r.process for r in self.replicas], self.config.shutdown_timeout + STOP_WAIT_S)


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def terminate(processes: list[subprocess.Popen[bytes]], wait_s: float) -> None:
    live = [p for p in processes if p.poll() is None]
    for p in live:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    for p in live:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            log.error("pid %d did not stop in %.0fs; killing it", p.pid, wait_s)
            p.kill()
            p.wait()


def die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM it when the supervisor dies, even by SIGKILL,
    so no replica outlives it."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def pump_lines(process: subprocess.Popen[bytes], lines: queue.Queue[str]) -> None:
    """Read a replica's stdout for good (so it never blocks on a full pipe)."""
    assert process.stdout is not None
    for raw in process.stdout:
        lines.put(raw.decode(errors="replace"))


def ready_line(url: str, config: ServerConfig, replicas: list[Replica]) -> str:
    """The one stdout line that says the router can serve (parsed by `Runtime`)."""
    workers = " ".join(r.url for r in replicas)
    return (
        f"radixflow ready on {url} (HTTP, sglang-router {config.router_policy} over "
        f"{len(replicas)} replicas: {workers})"
    )


def serve_data_parallel(config: ServerConfig, log_level: str = "info") -> int:
    """`radixflow serve --dp-size N` until SIGTERM/SIGINT; returns an exit code."""
    try:
        supervisor = DataParallel(config, log_level)
    except DataParallelError as e:
        log.error("%s", e)
        return 2
    signal.signal(signal.SIGTERM, supervisor.request_stop)
    signal.signal(signal.SIGINT, supervisor.request_stop)
    signal.signal(signal.SIGHUP, supervisor.request_rolling_restart)
    try:
        url = supervisor.start()
        print(ready_line(url, config, supervisor.replicas), flush=True)
        return supervisor.watch()
    except DataParallelError as e:
        log.error("%s", e)
        return 1
    finally:
        supervisor.stop()
