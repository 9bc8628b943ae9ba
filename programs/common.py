"""The command line every program shares: connect to a server or start a local Runtime, run
the program's `main(backend, **options)`, print its result as JSON."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

# Whole batches share two CPU cores: one request can wait minutes behind the others.
REQUEST_TIMEOUT_S = 600.0
COUNTERS = ("prompt_tokens", "cached_tokens", "prefill_tokens_computed", "forward_steps")


def counter_deltas(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """What the server counted between two `get_server_info` reads (one program's run, when
    nothing else runs): prompt and cached tokens, prefill tokens computed, forward steps."""
    return {name: after[name] - before.get(name, 0) for name in COUNTERS}  # {} before any stats


def connect(address: str | None, **config: Any) -> tuple[Any, Callable[[], None]]:
    """(backend, close): a RuntimeEndpoint for `address`, else a new local Runtime."""
    import radixflow as sgl

    if address:
        endpoint = sgl.RuntimeEndpoint(address, timeout=REQUEST_TIMEOUT_S)
        return endpoint, endpoint.close
    runtime = sgl.Runtime(model_path="smollm2", **config)
    runtime.endpoint.timeout = REQUEST_TIMEOUT_S
    return runtime, runtime.shutdown


def cli(
    main: Callable[..., Any],
    description: str | None,
    add_options: Callable[[argparse.ArgumentParser], None] | None = None,
) -> None:
    """Parse `--address` (and the program's own options), run main, print the result."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--address", help="a running server (tcp://host:port); default: start one")
    if add_options is not None:
        add_options(parser)
    options = vars(parser.parse_args())
    backend, close = connect(options.pop("address"))
    try:
        start = time.perf_counter()
        result = main(backend, **options)
        print(json.dumps(result, indent=2, ensure_ascii=False))
        print(f"# {time.perf_counter() - start:.1f}s")
    finally:
        close()
