"""LoraTable: the scheduler's view of the loaded LoRA adapters (torch-free).

Names map to ids; an id is never reused, so a reloaded name gets a new id: a new namespace
in the radix tree (`Req.cache_key`) and new weights in the runner, never the old ones'. The
weights themselves live in the model runner (runtime/models/lora.py), loaded under the id this
table hands out. Admission keeps the distinct adapters of one step within
--max-loras-per-batch (`admissible`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

from radixflow.runtime.scheduler.request import Req


class LoraTable:
    def __init__(self, max_per_batch: int) -> None:
        self.max_per_batch = max_per_batch
        self.ids: dict[str, int] = {}
        self.paths: dict[str, str] = {}
        self._next = itertools.count(1)

    def load(self, name: str, path: str, runner: Any) -> None:
        """Load adapter `name` from `path` into `runner` under a new id. Raises ValueError
        (models.lora.LoraError: a bad directory) for a name already loaded or an adapter
        that cannot be served; nothing changes then. Requests already running are untouched."""
        if not name:
            raise ValueError("lora_name must not be empty")
        if name in self.ids:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        uid = next(self._next)
        runner.load_lora(uid, name, path)
        self.ids[name], self.paths[name] = uid, path

    def unload(self, name: str, live: Iterable[Req], runner: Any) -> None:
        """Forget `name` and free its weights in `runner`. Raises ValueError for an unknown
        name or one a live request still runs under (refused, not deferred: the client
        retries once those requests are done, so no running request ever changes)."""
        uid = self.ids.get(name)
        if uid is None:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded")
        users = sum(1 for req in live if req.lora == uid)
        if users:
            raise ValueError(
                f"LoRA adapter {name!r} is in use by {users} request(s); unload it when they end"
            )
        del self.ids[name], self.paths[name]
        runner.unload_lora(uid)

    def id_of(self, name: str) -> int | None:
        """The id of adapter `name` ("": 0, the base model); None when none is loaded."""
        return 0 if not name else self.ids.get(name)

    def admissible(
        self, ordered: list[Req], in_step: list[Req], chunked: Req | None
    ) -> Iterator[Req]:
        """`ordered` (waiting requests in admission order) less those whose adapter would
        take a step past max_per_batch distinct adapters, counting the adapters of `in_step`
        (running and already admitted), of the chunked request and of requests yielded
        before. The base model (0) is not an adapter: it never counts, is never held back."""
        adapters = {req.lora for req in [*in_step, *([chunked] if chunked else [])] if req.lora}
        for req in ordered:
            if req.lora and req.lora not in adapters:
                if len(adapters) >= self.max_per_batch:
                    continue  # a later step, once fewer adapters run
                adapters.add(req.lora)
            yield req
