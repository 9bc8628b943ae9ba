"""Data-parallel replicas behind sglang-router (runtime/distributed/data_parallel.py), on loopback.

One `radixflow serve --dp-size 2` (1 thread per replica, an API key) for the module: the DSL
workloads through the router give a single replica's outputs; the key is required at the
router and at the replicas and passed through; SIGHUP restarts the replicas one at a time
(rolling restart) while clients, streams among them, lose no request; SIGTERM stops the router
and every replica.
Slow: a replica SIGKILLed under load (every client gets a final answer, the replica comes back
and serves again), and the many-machine deployment with each "host" on its own loopback
address (127.0.0.2, 127.0.0.3) and the router launched by hand.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest

import radixflow as sgl
from conftest import Server, die_with_parent, start_server
from radixflow.bench import router as bench_router
from radixflow.runtime import cli
from radixflow.runtime.distributed import data_parallel

HAS_ROUTER = importlib.util.find_spec("sglang_router") is not None
needs_router = pytest.mark.skipif(not HAS_ROUTER, reason="pip install sglang-router (test extra)")
KEY = "router-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
OPTIONS = {"max_total_tokens": 4096, "log_level": "warning"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Server]:
    with start_server(
        dp_size=2,
        threads_per_replica=1,
        api_key=KEY,
        launch_timeout=900.0,  # two model loads on a shared 2-core machine
        **OPTIONS,
    ) as server:
        yield server


def replicas(router_url: str) -> list[str]:
    return bench_router.worker_urls(router_url, KEY)


def test_dp_size_without_the_router_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(data_parallel.shutil, "which", lambda name: None)
    monkeypatch.setattr(data_parallel.importlib.util, "find_spec", lambda name: None)
    with caplog.at_level(logging.ERROR):
        code = cli.main(["serve", "--dp-size", "2", "--port", "0"])
    assert code == 2
    assert "pip install sglang-router" in caplog.text


def test_replica_flags_carry_the_users_knobs_but_not_the_routers() -> None:
    config = sgl_config(dp_size=2, port=8000, max_total_tokens=4096, self_check=True)
    flags = data_parallel.replica_flags(config)
    assert flags == ["--max-total-tokens", "4096", "--self-check"]


def sgl_config(**changes: Any) -> Any:
    from radixflow.runtime.config import ServerConfig

    return ServerConfig(**changes)


@needs_router
@pytest.mark.parametrize("name", ["few_shot", "agent"])
def test_programs_through_the_router_equal_a_single_replica(cluster: Any, name: str) -> None:
    """Greedy programs (gen, select, multi-round state) through the router give what one
    replica alone gives, and the router's cache-aware placement loses no prefix reuse."""
    urls = replicas(cluster.url)
    assert len(urls) == 2
    routed = bench_router.run_workload(cluster.url, name, True, KEY)
    single = bench_router.run_workload(urls[0], name, True, KEY, replicas=[urls[0]])
    assert routed["per_program"] == single["per_program"]
    assert routed["output_tokens"] == single["output_tokens"] > 0
    assert routed["server_hit_rate"] >= 0.95 * single["server_hit_rate"]


@needs_router
def test_fork_and_select_run_through_the_router(cluster: Any) -> None:
    @sgl.function
    def plan(s: Any) -> None:
        s += "Task: add two numbers.\nAction:"
        s += sgl.select("tool", choices=[" search", " calculate", " finish"])
        branches = s.fork(2)
        for i, branch in enumerate(branches):
            branch += f"\nIdea {i + 1}:"
            branch += sgl.gen("idea", max_tokens=3, temperature=0)
        s += "\n" + branches[0]["idea"] + branches[1]["idea"]

    routed = plan.run(backend=cluster.endpoint)
    direct = plan.run(backend=sgl.RuntimeEndpoint(replicas(cluster.url)[1], api_key=KEY))
    assert routed.error() is None and direct.error() is None
    assert routed["tool"] in (" search", " calculate", " finish")
    assert routed.text() == direct.text()


@needs_router
def test_the_api_key_is_required_at_the_router_and_passed_to_replicas(cluster: Any) -> None:
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 1}}
    assert httpx.post(f"{cluster.url}/generate", json=body, timeout=60).status_code == 401
    for url in replicas(cluster.url):
        assert httpx.post(f"{url}/generate", json=body, timeout=60).status_code == 401
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # as SGLang's
    reply = httpx.post(f"{cluster.url}/generate", json=body, headers=AUTH, timeout=120)
    assert reply.status_code == 200 and reply.json()["meta_info"]["completion_tokens"] == 1
    loads = httpx.get(f"{replicas(cluster.url)[0]}/get_load", headers=AUTH, timeout=10).json()
    assert set(loads[0]) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}


def serve_pids(supervisor_pid: int) -> dict[str, int]:
    """Replica server pids by the ports they listen on (HTTP and ZeroMQ)."""
    out = {}
    for child in psutil.Process(supervisor_pid).children():
        # a replica may exit meanwhile (a zombie until the supervisor reaps it): skip it
        with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
            if "serve" in child.cmdline():
                for conn in child.net_connections(kind="tcp"):
                    if conn.status == psutil.CONN_LISTEN:
                        out[str(conn.laddr.port)] = child.pid
    return out


def wait_for(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(1.0)
    raise AssertionError(f"{what}: not within {timeout:.0f}s")


def ok(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def healthy(router_url: str) -> int:
    try:
        workers = httpx.get(f"{router_url}/workers", headers=AUTH, timeout=10).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return 0
    return sum(1 for w in workers if w["is_healthy"])


@needs_router
@pytest.mark.slow
def test_a_killed_replica_loses_no_client_and_rejoins(cluster: Any) -> None:
    urls = replicas(cluster.url)
    ports = serve_pids(cluster.process.pid)
    answers: list[tuple[int, str]] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        with httpx.Client(headers=AUTH, timeout=180) as http:
            for i in range(3):  # bounded: 3 requests per client
                body = {
                    "text": f"Client {k} request {i}: count slowly from one to twenty:",
                    "sampling_params": {"max_new_tokens": 24, "temperature": 0},
                }
                try:
                    reply = http.post(f"{cluster.url}/generate", json=body)
                    outcome = (reply.status_code, reply.text[:200])
                except httpx.HTTPError as e:
                    outcome = (-1, repr(e))
                with lock:
                    answers.append(outcome)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()

    def busy_victim() -> str | None:
        for url in urls:
            if httpx.get(f"{url}/health", timeout=10).json()["requests_in_flight"]:
                return url
        return None

    victim = wait_for(busy_victim, 120, "a replica with requests in flight")
    os.kill(ports[victim.rsplit(":", 1)[1]], signal.SIGKILL)
    for t in threads:
        t.join(400)
    assert not any(t.is_alive() for t in threads), "a client is still waiting"
    statuses = sorted(status for status, _ in answers)
    print(f"killed {victim}: statuses {statuses}; errors {[t for c, t in answers if c != 200]}")
    assert len(answers) == 18
    assert all(status == 200 or (status >= 400 and text) for status, text in answers), answers
    assert sum(status == 200 for status, _ in answers) >= 12, answers
    # the supervisor restarts it on its port; the router's health checks take it back
    port = victim.rsplit(":", 1)[1]
    restarted = lambda: serve_pids(cluster.process.pid).get(port, ports[port]) != ports[port]
    wait_for(restarted, 400, "a new replica process on the killed one's port")
    wait_for(lambda: ok(victim) and healthy(cluster.url) == 2, 400, "the replica healthy again")

    def victim_serves() -> bool:
        for i in range(4):
            text = f"Fresh prompt {time.time()} {i}"
            body = {"text": text, "sampling_params": {"max_new_tokens": 1}}
            httpx.post(f"{cluster.url}/generate", json=body, headers=AUTH, timeout=120)
        info = httpx.get(f"{victim}/server_info", headers=AUTH, timeout=10).json()
        return info["internal_states"][0]["server"].get("request_generate", 0) > 0

    wait_for(victim_serves, 120, "the restarted replica serving requests")


def generate(http: httpx.Client, url: str, body: dict[str, Any]) -> tuple[int, str]:
    """(status, text) of a /generate; a stream counts as 200 only if it ends with a finished
    result and `[DONE]`."""
    if not body.get("stream"):
        reply = http.post(url, json=body)
        return reply.status_code, reply.text[:200]
    finished = False
    with http.stream("POST", url, json=body) as reply:
        for line in reply.iter_lines():
            if line == "data: [DONE]":
                return (reply.status_code if finished else -2), f"stream finished: {finished}"
            if line.startswith("data: "):
                meta = json.loads(line[6:]).get("meta_info", {})
                finished = meta.get("finish_reason") is not None
    return -3, f"stream ended before [DONE] ({reply.status_code})"


@pytest.mark.slow  # two model loads while traffic flows: about 2 minutes (the suite's budget)
@needs_router
def test_sighup_restarts_each_replica_in_turn_losing_no_request(cluster: Any) -> None:
    """Rolling restart: on SIGHUP the supervisor takes one replica at a time out of the
    router, lets it drain, starts it again on its port and hands it back. Requests flowing
    from 3 client threads all the while (half of them streams) all succeed; the new replicas
    take the traffic and answer."""
    urls = replicas(cluster.url)
    old = serve_pids(cluster.process.pid)
    ports = [url.rsplit(":", 1)[1] for url in urls]
    answers: list[tuple[int, str]] = []
    stop = threading.Event()

    def client(k: int) -> None:
        with httpx.Client(headers=AUTH, timeout=300) as http:
            for i in range(1000):  # bounded; stopped once both replicas are back
                if stop.is_set():
                    return
                body = {
                    "text": f"Client {k} request {i}: name a colour:",
                    "sampling_params": {"max_new_tokens": 16, "temperature": 0},
                    "stream": i % 2 == 1,  # a stream cut by a replica's exit is not retried
                }
                try:
                    answers.append(generate(http, f"{cluster.url}/generate", body))
                except httpx.HTTPError as e:
                    answers.append((-1, repr(e)))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(answers) >= 3, 120, "requests flowing")
        os.kill(cluster.process.pid, signal.SIGHUP)

        def both_replaced() -> bool:
            now = serve_pids(cluster.process.pid)
            fresh = all(now.get(p) not in (None, old[p]) for p in ports)
            return fresh and healthy(cluster.url) == 2

        wait_for(both_replaced, 900, "both replicas restarted and back in the router")
        settled = len(answers)
        wait_for(lambda: len(answers) >= settled + 3, 120, "requests after the restart")
    finally:
        stop.set()
        for t in threads:
            t.join(300)
    assert not any(t.is_alive() for t in threads), "a client is still waiting"
    failed = [a for a in answers if a[0] != 200]
    print(f"rolling restart: {len(answers)} requests, {len(failed)} failed")
    assert not failed, failed[:5]
    # the clients reached the new processes through the router (only one replica was in it
    # while the other restarted), and each new replica answers
    served = [server_counters(url).get("request_generate", 0) for url in urls]
    assert sum(served) > 0, served
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 1}}
    for url in urls:
        reply = httpx.post(f"{url}/generate", json=body, headers=AUTH, timeout=120)
        assert reply.status_code == 200 and reply.json()["meta_info"]["completion_tokens"] == 1


def server_counters(url: str) -> dict[str, Any]:
    info = httpx.get(f"{url}/server_info", headers=AUTH, timeout=10).json()
    return info["internal_states"][0]["server"]


@needs_router
@pytest.mark.slow
def test_many_hosts_behind_a_router_launched_by_hand() -> None:
    """Each host on its own loopback address with --api-key; `sglang-router launch
    --worker-urls ... --api-key` in front; programs through it equal one host's."""
    host = {"api_key": KEY, "num_threads": 1, "max_total_tokens": 4096, "log_level": "warning"}
    with contextlib.ExitStack() as servers:
        urls = [servers.enter_context(start_server(host=h, **host)).url
                for h in ("127.0.0.2", "127.0.0.3")]  # fmt: skip
        assert [u.split(":")[1] for u in urls] == ["//127.0.0.2", "//127.0.0.3"]
        port = data_parallel.free_port("127.0.0.1")
        cmd = [*data_parallel.router_command(), "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--worker-urls", *urls, "--api-key", KEY, "--policy", "cache_aware"]
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port"]
        cmd += [str(data_parallel.free_port("127.0.0.1")), "--log-level", "warn"]
        router = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, preexec_fn=die_with_parent()
        )
        servers.callback(data_parallel.terminate, [router])
        router_url = f"http://127.0.0.1:{port}"
        wait_for(lambda: healthy(router_url) == 2, 120, "both hosts registered")
        routed = bench_router.run_workload(router_url, "agent", True, KEY)
        single = bench_router.run_workload(urls[1], "agent", True, KEY, replicas=[urls[1]])
        assert routed["per_program"] == single["per_program"]


@needs_router
def test_sigterm_stops_the_router_and_every_replica(cluster: Any) -> None:
    """Last in the module: it shuts the cluster down."""
    children = psutil.Process(cluster.process.pid).children(recursive=True)
    names = " ".join(" ".join(c.cmdline()) for c in children)
    assert names.count("radixflow.runtime serve") == 2 and "scheduler" in names
    assert "sglang" in names  # the router
    cluster.shutdown()
    assert cluster.process.returncode == 0
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.pid for p in alive]
