"""`radixflow serve` (also `python -m radixflow.runtime`): start a runtime server. (The
`radixflow` command, `radixflow.lab.cli`, hands `serve` and the internal entries here.) The
server process imports no torch: the scheduler process and tensor-parallel ranks import it
when they start (function-level imports, each marked `(torch)`).

    radixflow serve --model smollm2 --port 0

Every ServerConfig field is a flag (`--max-total-tokens`, `--self-check/--no-self-check`).
HTTP (SGLang's native API, OpenAI's /v1, /metrics) is served on `--port` (default 30000) and
radixflow's ZeroMQ protocol on `--zmq-port` (default 30001); `--port 0` picks both free. The
server prints one line `radixflow ready on http://HOST:P (HTTP) and tcp://HOST:Q (ZeroMQ)`
on stdout when it can serve; logs go to stderr. `radixflow scheduler` and `radixflow
tp-worker` are the internal entries of the scheduler process and of tensor-parallel ranks
1..N-1; `serve --node-rank K` (K > 0) runs only node K's ranks (runtime/distributed/tp_worker.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
from pathlib import Path

from radixflow.runtime.config import config_from_kwargs
from radixflow.runtime.config.cli import add_config_arguments, config_from_args
from radixflow.runtime.desk.catalog import is_desk, single_model
from radixflow.runtime.desk.serve import serve_desk
from radixflow.runtime.distributed.data_parallel import serve_data_parallel
from radixflow.runtime.protocol.transport import IpcAddresses
from radixflow.runtime.server import serve

LOG_LEVELS = ("debug", "info", "warning", "error")
COMMANDS = ("serve", "scheduler", "tp-worker")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixflow", description="radixflow runtime")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="run the runtime server",
        description="HTTP (SGLang's native API, OpenAI's /v1, /metrics) on --port and "
        "radixflow's ZeroMQ protocol on --zmq-port; --port 0 picks free ports for both.",
    )
    add_config_arguments(serve)
    serve.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="stderr log level")
    internal = commands.add_parser("scheduler", help="(internal) the scheduler process")
    internal.add_argument("--ipc-dir", required=True)
    internal.add_argument("--parent-pid", type=int, required=True)
    internal.add_argument("--config-json", required=True)
    internal.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    worker = commands.add_parser("tp-worker", help="(internal) a tensor-parallel rank > 0")
    worker.add_argument("--rank", type=int, required=True)
    worker.add_argument("--init-addr", required=True)
    worker.add_argument("--model-dir", required=True)
    worker.add_argument("--parent-pid", type=int, required=True)
    worker.add_argument("--config-json", required=True)
    worker.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS + ("-h", "--help"):
        argv = ["serve", *argv]  # `python -m radixflow.runtime --model smollm2`
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=args.log_level.upper(),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if args.command == "scheduler":
        from radixflow.runtime.scheduler.loop import run_scheduler  # noqa: PLC0415 (torch)

        config = config_from_kwargs(**json.loads(args.config_json))
        run_scheduler(config, IpcAddresses(args.ipc_dir), args.parent_pid)
        return 0
    if args.command == "tp-worker":
        from radixflow.runtime.distributed.tp_worker import run_worker  # noqa: PLC0415 (torch)
        from radixflow.runtime.hicache import build_shard  # noqa: PLC0415 (torch)

        config = config_from_kwargs(**json.loads(args.config_json))
        model_dir, tp = Path(args.model_dir), (args.rank, config.tp_size)
        shard = functools.partial(build_shard, config, model_dir, tp=tp)
        return run_worker(config, args.rank, args.init_addr, model_dir, args.parent_pid, shard)
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"radixflow: {e}", file=sys.stderr)
        return 2
    if config.node_rank > 0:  # another machine's tensor-parallel ranks; no server here
        from radixflow.runtime.distributed.tp_worker import serve_node  # noqa: PLC0415 (torch)

        return serve_node(config)
    if is_desk(config):  # several models, each its own child server (runtime/desk/)
        return serve_desk(config, args.log_level)
    config = single_model(config)
    if config.dp_size > 1:
        return serve_data_parallel(config, args.log_level)
    return serve.serve(config, args.log_level)
