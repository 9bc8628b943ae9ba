"""Tensor parallelism over torch.distributed: the group, the plan broadcast, the ranks' lives.

`--tp-size N` runs one model as N ranks, each holding a shard (runtime/models/sharding.py).
Rank 0 is the scheduler process (or the offline Engine's process): it schedules, and before
each forward it broadcasts the step's plan (token ids, positions, slots, logit rows, KV
copies) to ranks 1..N-1 (runtime/distributed/tp_worker.py), which run the same forward on their
shard with their own KV pools, numbered like rank 0's, so the radix tree is unchanged. Sampling
happens once, on rank 0, from the logits gathered there. Between steps rank 0 may send other
commands (`send_command`; ranks 1..N-1 run them through `on_command`): the disk tier's, so each
rank saves and loads its own shard of the store (tier_ranks.py).

Two process groups:
- control (the default group, always gloo on the CPU): plans, the KV pool size, pings and
  the stop message. Its timeout is long: an idle worker waits in it for the next plan.
- compute (gloo on CPU, NCCL on CUDA; `--dist-timeout`): the all-reduces and the logits
  gather inside the forward. A rank that died makes the others' collectives fail at once
  (gloo: the connection closes); a stuck one makes them time out.

Rendezvous: rank 0 listens on `--dist-init-addr` (default a free loopback port) with a
TCPStore on a socket bound to that address only; the ranks join within JOIN_TIMEOUT_S.
`--nnodes`/`--node-rank` place ranks on machines: node k runs ranks [k * N/nnodes, ...).

Failure: rank 0 stops stepping once a rank died or a step failed part-way (the ranks would
be out of step); `check()` then raises, the scheduler process exits, the server fails what
is in flight and restarts it (as for any dead scheduler), and the ranks rejoin the new one.
With `--tp-size 1` this module is never imported (engine.load imports it for N > 1 only), so
no process group is formed and no collective runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import numpy as np
import psutil
import torch
import torch.distributed as dist

from radixflow.runtime import models
from radixflow.runtime.config import ServerConfig
from radixflow.runtime.model_executor.model_runner import pick_device, pick_dtype, pick_ops
from radixflow.runtime.models.layers import CausalLM
from radixflow.runtime.models.loader import load_hf_config, weight_files
from radixflow.runtime.models.sharding import (
    local_config,
    parallelize,
    plan_shard,
    read_shard_state,
)
from radixflow.runtime.protocol.plan import BatchPlan, StepResult

log = logging.getLogger("radixflow.tp")

# the plan fields ranks 1..N-1 need (sampling stays on rank 0), broadcast as one int64 body
PLAN_FIELDS = (
    "input_ids", "positions", "out_slots", "extend_qo_indptr", "extend_kv_indptr",
    "extend_kv_indices", "decode_kv_indptr", "decode_kv_indices", "logit_rows", "copy_src",
    "copy_dst",
)  # fmt: skip
STEP, STOP, PING = 1, 2, 3
SAVE, PREFETCH, PROBE, WRITE = 4, 5, 6, 7  # the disk tier's shards (tier_ranks.py)
HEADER_LEN = 2 + len(PLAN_FIELDS)  # command, num_extend_tokens, the fields' lengths
JOIN_TIMEOUT_S = 600.0  # every rank has joined within this (model loading comes after)
LOAD_TIMEOUT_S = 3600.0  # and loaded its shard within this
CONTROL_TIMEOUT = timedelta(days=7)  # an idle worker waits this long for the next plan
PING_INTERVAL_S = 2.0  # an idle rank 0 pings this often (a dead remote rank is then noticed)
STOP_WAIT_S = 10.0


class TensorParallelError(RuntimeError):
    """A rank died, could not join, or a step failed part-way: the group cannot step."""


def split_addr(addr: str) -> tuple[str, int]:
    """'host:port' -> (host, port); raises ValueError."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--dist-init-addr must be host:port, got {addr!r}")
    return host, int(port)


def node_ranks(config: ServerConfig) -> range:
    """The ranks this node (`--node-rank`) runs."""
    per_node = config.tp_size // config.nnodes
    return range(config.node_rank * per_node, (config.node_rank + 1) * per_node)


def rank_device(config: ServerConfig, rank: int) -> torch.device:
    """CPU, or the rank's own GPU on its node (cuda:local_rank)."""
    device = pick_device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank - node_ranks(config).start)
        torch.cuda.set_device(device)
    return device


def _pin_gloo_interface(host: str) -> None:
    """gloo listens on the interface its hostname resolves to; make it the one that reaches
    rank 0 (loopback on one machine) unless GLOO_SOCKET_IFNAME says otherwise."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))  # UDP: only picks the route
        address = probe.getsockname()[0]
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == address for a in addresses):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return


def open_store(rank: int, size: int, init_addr: str, listen_fd: int | None = None) -> dist.Store:
    """The rendezvous store at `init_addr`: rank 0 serves it on `listen_fd` (a socket bound
    to that address only), the others connect (retrying for JOIN_TIMEOUT_S)."""
    host, port = split_addr(init_addr)
    _pin_gloo_interface(host)
    extra = {"master_listen_fd": listen_fd} if listen_fd is not None else {}
    return dist.TCPStore(
        host, port, size, rank == 0, timedelta(seconds=JOIN_TIMEOUT_S),
        wait_for_workers=False, use_libuv=False, **extra,
    )  # fmt: skip


class TensorParallel:
    """One rank's membership of the group: the collectives its shard calls (`all_reduce`,
    `gather`), the plan broadcast (`send_plan` on rank 0, `recv_plan` elsewhere) and, on
    rank 0, the local worker processes it started."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.compute: dist.ProcessGroup | None = None  # set by `connect`
        self.workers: dict[int, subprocess.Popen[bytes]] = {}  # rank -> process (rank 0)
        self.pending = False  # a plan went out and rank 0's forward of it has not returned
        self.broken = ""
        self.last_control = time.monotonic()
        self.dist_timeout = 60.0  # seconds; set by `connect`
        # ranks 1..N-1: what runs a command other than a step (command, argument, arrays)
        self.on_command: Callable[[int, int, list[np.ndarray]], None] | None = None

    def connect(
        self,
        store: dist.Store,
        dist_timeout: float,
        device: torch.device,
        alive: Callable[[], None] | None = None,
    ) -> None:
        """Form the groups through `store` (see `open_store`). Rank 0 first waits, calling
        `alive` (which raises when a local worker died), until every rank checked in; raises
        TensorParallelError when they do not within JOIN_TIMEOUT_S."""
        store.set(f"radixflow/joined/{self.rank}", str(os.getpid()))
        if self.rank == 0:
            keys = [f"radixflow/joined/{r}" for r in range(self.size)]
            deadline = time.monotonic() + JOIN_TIMEOUT_S
            while not store.check(keys):
                if alive is not None:
                    alive()
                if time.monotonic() > deadline:
                    raise TensorParallelError(f"not every rank joined in {JOIN_TIMEOUT_S:.0f}s")
                time.sleep(0.05)
        dist.init_process_group(
            "gloo", store=store, rank=self.rank, world_size=self.size, timeout=CONTROL_TIMEOUT
        )
        backend = "nccl" if device.type == "cuda" else "gloo"
        self.dist_timeout = dist_timeout
        self.compute = dist.new_group(backend=backend, timeout=timedelta(seconds=dist_timeout))
        log.info("tp rank %d of %d joined (%s)", self.rank, self.size, backend)

    @classmethod
    def join(
        cls,
        rank: int,
        size: int,
        init_addr: str,
        dist_timeout: float,
        device: torch.device,
        listen_fd: int | None = None,
    ) -> TensorParallel:
        """`open_store` + `connect`: rank `rank` of a group meeting at `init_addr`."""
        tp = cls(rank, size)
        tp.connect(open_store(rank, size, init_addr, listen_fd), dist_timeout, device)
        return tp

    # ---- collectives (models/sharding.Collectives) ---------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self.compute)

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        parts = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(tensor, parts, dst=0, group=self.compute)
        return parts

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (the KV pool size all ranks can hold)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MIN, async_op=True)
        work.wait(timedelta(seconds=LOAD_TIMEOUT_S))  # every rank has loaded by then
        return int(tensor)

    # ---- plans ----------------------------------------------------------------------------

    def run_step(self, forward: Callable[[BatchPlan], StepResult], plan: BatchPlan) -> StepResult:
        """Rank 0's `ModelRunner.forward`: send the plan to the other ranks, then run it here.
        If `forward` raises, the other ranks may be inside collectives rank 0 never reaches:
        the group stays out of step and every later step is refused. Raises
        TensorParallelError when the group cannot step."""
        self.send_plan(plan)
        self.pending = True
        result = forward(plan)
        self.pending = False
        return result

    def send_plan(self, plan: BatchPlan) -> None:
        """Rank 0: send the step to the other ranks. Raises TensorParallelError."""
        self._check_ranks()
        arrays = [np.ascontiguousarray(getattr(plan, f), dtype=np.int64) for f in PLAN_FIELDS]
        header = [STEP, plan.num_extend_tokens, *(len(a) for a in arrays)]
        self._control(
            torch.tensor(header, dtype=torch.int64), torch.from_numpy(np.concatenate(arrays))
        )

    def send_command(self, command: int, argument: int, arrays: list[np.ndarray]) -> None:
        """Rank 0: a command other than a step (`on_command` runs it on the other ranks),
        in order with the steps. Raises TensorParallelError."""
        self._check_ranks()
        arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in arrays]
        assert len(arrays) <= len(PLAN_FIELDS), len(arrays)
        header = [command, argument, *(len(a) for a in arrays)]
        header += [0] * (HEADER_LEN - len(header))
        body = torch.from_numpy(np.concatenate(arrays)) if arrays else None
        self._control(torch.tensor(header, dtype=torch.int64), body)

    def min_of(self, value: int) -> int:
        """The smallest of every rank's `value`, each rank calling it at the same point of
        the command stream. Raises TensorParallelError on rank 0 when a rank is unreachable."""
        tensor = torch.tensor([value], dtype=torch.int64)
        try:
            work = dist.all_reduce(tensor, op=dist.ReduceOp.MIN, async_op=True)
            work.wait(timedelta(seconds=self.dist_timeout))
        except RuntimeError as e:
            if self.rank:
                raise
            self._break(f"a tensor-parallel rank is unreachable: {e}")
        return int(tensor)

    def recv_plan(self) -> BatchPlan | None:
        """Ranks 1..N-1: the next step's plan (no sampling rows), or None when told to stop.
        Other commands meanwhile go to `on_command`."""
        while True:
            header = torch.zeros(HEADER_LEN, dtype=torch.int64)
            dist.broadcast(header, 0)
            command = int(header[0])
            if command in (STEP, STOP):
                break
            if command != PING:
                assert self.on_command is not None, f"unknown tp command {command}"
                self.on_command(command, int(header[1]), self._recv_body(header))
        if command == STOP:
            return None
        arrays = self._recv_body(header)
        fields = dict(zip(PLAN_FIELDS, arrays))
        return BatchPlan(
            num_extend_tokens=int(header[1]),
            logprob_targets=np.full(len(fields["logit_rows"]), -1, dtype=np.int64),
            sample_rows=np.zeros(0, dtype=np.int64),
            **fields,
        )

    def _recv_body(self, header: torch.Tensor) -> list[np.ndarray]:
        lengths = header[2:].tolist()
        body = torch.empty(sum(lengths), dtype=torch.int64)
        if len(body):
            dist.broadcast(body, 0)
        return np.split(body.numpy(), np.cumsum(lengths)[:-1])

    def _control(
        self, header: torch.Tensor, body: torch.Tensor | None = None, timeout: float = 0.0
    ) -> None:
        """Broadcast from rank 0; the ranks must take it within `timeout` (default: the
        compute timeout), else the group is broken (a rank that is alive but stuck)."""
        wait = timedelta(seconds=timeout or self.dist_timeout)
        try:
            dist.broadcast(header, 0, async_op=True).wait(wait)
            if body is not None and len(body):
                dist.broadcast(body, 0, async_op=True).wait(wait)
        except RuntimeError as e:
            self._break(f"a tensor-parallel rank is unreachable: {e}")
        self.last_control = time.monotonic()

    # ---- lifecycle (rank 0) ---------------------------------------------------------------

    def check(self) -> None:
        """Raise TensorParallelError when the group cannot step: a rank died, or a step
        failed part-way. Idle for a while, ping the ranks (a dead remote rank shows then)."""
        self._check_ranks()
        if time.monotonic() - self.last_control >= PING_INTERVAL_S:
            self._control(torch.tensor([PING] + [0] * (HEADER_LEN - 1), dtype=torch.int64))

    def _check_ranks(self) -> None:
        if self.broken:
            raise TensorParallelError(self.broken)
        if self.pending:
            self._break("a step failed part-way: the tensor-parallel ranks are out of step")
        for rank, proc in self.workers.items():
            if proc.poll() is not None:
                self._break(f"tensor-parallel rank {rank} exited with code {proc.returncode}")

    def _break(self, message: str) -> None:
        self.broken = message
        log.error("%s", message)
        raise TensorParallelError(message)

    def close(self, stop: bool = True) -> None:
        """Leave the group. With `stop` (the server or engine is shutting down) every rank is
        told to exit; without, only this node's workers are ended (ranks on other nodes see
        the connection close and rejoin a restarted rank 0)."""
        if stop and self.rank == 0 and not self.broken and not self.pending:
            with contextlib.suppress(TensorParallelError):
                stop_header = torch.tensor([STOP] + [0] * (HEADER_LEN - 1), dtype=torch.int64)
                self._control(stop_header, timeout=STOP_WAIT_S)
        end_processes(list(self.workers.values()), STOP_WAIT_S if stop else 0.0)
        if not self.broken:  # a broken gloo group is left to the process exit
            dist.destroy_process_group()
        self.broken = self.broken or "the tensor-parallel group is closed"


def end_processes(procs: list[subprocess.Popen[bytes]], wait_s: float) -> None:
    """Wait up to `wait_s` for `procs` to exit, then terminate (and at last kill) them."""
    deadline = time.monotonic() + wait_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(deadline - time.monotonic(), 0.0))
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def load_shard(
    model_dir: Path, config: ServerConfig, device: torch.device, tp: TensorParallel
) -> CausalLM:
    """This rank's shard of the model in `model_dir`, read from the checkpoint's slices (fp32
    or bf16: a GGUF is read dequantised; AWQ/GPTQ and int8 are refused)."""
    hf_config = load_hf_config(model_dir)
    if getattr(hf_config, "quantization_config", None) or config.quantization:
        raise models.UnsupportedModelError(
            "--tp-size > 1 shards fp32/bf16 weights only: not AWQ/GPTQ checkpoints or "
            "--quantization int8 (GGUF files are dequantised for it)"
        )
    full = models.model_config(hf_config)
    shard = plan_shard(full, tp.size, tp.rank)
    model = CausalLM(local_config(full, shard), pick_ops(config.attention_backend, device, full))
    model.load_hf_state_dict(read_shard_state(weight_files(model_dir), full, shard))
    parallelize(model, full, shard, tp)
    return model.to(device=device, dtype=pick_dtype(config.dtype, device)).eval()


def spawn_worker(
    config: ServerConfig, rank: int, init_addr: str, model_dir: Path
) -> subprocess.Popen[bytes]:
    """Start rank `rank` (`python -m radixflow.runtime tp-worker`), a child of this process."""
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
    cmd = [sys.executable, "-m", "radixflow.runtime", "tp-worker", "--rank", str(rank)]
    cmd += ["--init-addr", init_addr, "--model-dir", str(model_dir)]
    cmd += ["--parent-pid", str(os.getpid()), "--log-level", level]
    cmd += ["--config-json", json.dumps(dataclasses.asdict(config.replace(api_key="")))]
    env = {**os.environ, "PYTHONSAFEPATH": "1"}  # as the server's scheduler (server.py)
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env)


def start_rank0(config: ServerConfig, model_dir: Path) -> tuple[CausalLM, TensorParallel]:
    """Rank 0: serve the store on `--dist-init-addr`, start this node's other ranks, load
    rank 0's shard while they start, then form the group. Raises TensorParallelError (a
    rank died or did not join)."""
    host, port = split_addr(config.dist_init_addr or "127.0.0.1:0")
    listener = socket.create_server((host, port))
    addr = f"{host}:{listener.getsockname()[1]}"
    store = open_store(0, config.tp_size, addr, listener.detach())  # the store owns the socket
    tp = TensorParallel(0, config.tp_size)
    tp.workers = {r: spawn_worker(config, r, addr, model_dir) for r in node_ranks(config) if r}

    def alive() -> None:
        for rank, proc in tp.workers.items():
            if proc.poll() is not None:
                raise TensorParallelError(f"tp rank {rank} exited with code {proc.returncode}")

    try:
        device = rank_device(config, 0)
        # the shard needs the groups only from its first forward on
        model = load_shard(model_dir, config, device, tp)
        tp.connect(store, config.dist_timeout, device, alive)
        return model, tp
    except BaseException:
        tp.broken = tp.broken or "rank 0 failed to start"
        end_processes(list(tp.workers.values()), 0.0)
        raise
