"""Tensor-parallel ranks 1..N-1, and the node that runs them on another machine.

    python -m radixflow.runtime tp-worker --rank R --init-addr HOST:PORT --model-dir DIR \
        --parent-pid PID --config-json JSON          (internal; started by rank 0 or a node)
    radixflow serve --tp-size N --nnodes M --node-rank K --dist-init-addr HOST:PORT  (K > 0)

A worker joins the group, loads its shard, sizes its KV pool with the others (the smallest
wins, so slot numbers mean the same on every rank), then runs every plan rank 0 broadcasts
through its own ModelRunner (the same forward; no sampling) until told to stop. It exits
when rank 0 is gone (its collectives fail) or its parent process is.

`serve --node-rank K` (K > 0) runs no server: it starts node K's ranks and starts them again
when their group broke (rank 0 restarted after a failure), until rank 0 stops the group,
SIGTERM/SIGINT arrive (it ends its ranks and exits 0), or the ranks keep failing.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from radixflow.runtime.cache.kv_pool import KVPool
from radixflow.runtime.cache.tier_shards import ShardFollower
from radixflow.runtime.config import ServerConfig, fixed_threads
from radixflow.runtime.distributed.tensor_parallel import (
    TensorParallel,
    end_processes,
    load_shard,
    node_ranks,
    rank_device,
    spawn_worker,
)
from radixflow.runtime.distributed.tier_ranks import follow
from radixflow.runtime.model_executor.kv_sizing import (
    kv_pool_dtype,
    rank0_pool_dtype,
    size_kv_pool,
)
from radixflow.runtime.model_executor.model_runner import ModelRunner
from radixflow.runtime.models.loader import resolve_model_dir

log = logging.getLogger("radixflow.tp_worker")
ShardBuilder = Callable[[ModelRunner], ShardFollower | None]
MAX_QUICK_FAILURES = 5  # ranks that failed this many times in a row, each soon after start
QUICK_S = 60.0
REJOIN_DELAY_S = 1.0


def _watch_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        log.error("the parent process %d is gone; this rank exits", parent_pid)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def run_worker(config: ServerConfig, rank: int, init_addr: str, model_dir: Path,
               parent_pid: int, shard: ShardBuilder | None = None) -> int:  # fmt: skip
    """One rank's life: join, load, size the pool, follow plans. Returns the exit code.
    `shard` builds this rank's shard of the disk tier's store from its runner (None: no
    tier), which then follows rank 0's tier (tier_ranks.py)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; rank 0 decides
    _watch_parent(parent_pid)
    if fixed_threads(config):
        torch.set_num_threads(fixed_threads(config))
    device = rank_device(config, rank)
    tp = TensorParallel.join(rank, config.tp_size, init_addr, config.dist_timeout, device)
    follower = None
    try:
        model = load_shard(model_dir, config, device, tp)
        dtype = rank0_pool_dtype(tp.agree_min, None)  # rank 0's: it saw the checkpoint
        sizing = size_kv_pool(dataclasses.replace(config, kv_cache_dtype=dtype), model, device)
        num_tokens = tp.agree_min(sizing.num_tokens)
        num_slots = KVPool(num_tokens, config.page_size).num_slots
        runner = ModelRunner(  # as rank 0 builds it (CUDA graphs stay off under tp)
            model,
            num_slots,
            seed=config.seed,
            shared_prefix=not config.disable_shared_prefix_attention,
            kv_dtype=kv_pool_dtype(sizing),
        )
        follower = shard(runner) if shard is not None else None
        if follower is not None:
            follow(tp, follower)
        while (plan := tp.recv_plan()) is not None:
            runner.forward(plan)
    except RuntimeError as e:  # rank 0 (or a peer) went away mid-collective
        log.error("tp rank %d leaves the group: %s", rank, e)
        return 1
    finally:
        if follower is not None:  # pending disk writes land before exit
            follower.close()
    tp.close(stop=False)
    log.info("tp rank %d stopped", rank)
    return 0


def serve_node(config: ServerConfig) -> int:
    """Run node `config.node_rank`'s ranks (see the module docstring); the exit code."""
    model_dir = resolve_model_dir(config.model_path, config.revision)
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    quick_failures = 0
    while not stopping.is_set():
        started = time.monotonic()
        ranks = node_ranks(config)
        procs = [spawn_worker(config, r, config.dist_init_addr, model_dir) for r in ranks]
        log.info("node %d: ranks %s join %s", config.node_rank, list(ranks), config.dist_init_addr)
        while not stopping.is_set() and all(p.poll() is None for p in procs):
            stopping.wait(0.2)
        codes = [p.poll() for p in procs]
        end_processes(procs, 0.0)
        if stopping.is_set():
            break
        if all(code == 0 for code in codes):
            log.info("node %d: rank 0 stopped the group", config.node_rank)
            return 0
        quick = time.monotonic() - started < QUICK_S
        quick_failures = quick_failures + 1 if quick else 0
        if quick_failures >= MAX_QUICK_FAILURES:
            log.error("node %d: ranks failed %d times in a row", config.node_rank, quick_failures)
            return 1
        log.warning("node %d: ranks exited %s; joining again", config.node_rank, codes)
        stopping.wait(REJOIN_DELAY_S)
    log.info("node %d: stopped", config.node_rank)
    return 0
