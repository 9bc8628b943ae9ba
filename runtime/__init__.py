"""radixflow.runtime: the server, scheduler, KV cache and model.

`Engine` is imported lazily so that torch-free modules (sampling, messages, config) can be
imported by the frontend without pulling in torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Engine", "ServerConfig", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from radixflow.runtime.engine import Engine  # noqa: PLC0415 (torch: not for the frontend)

        return Engine
    if name == "ServerConfig":
        from radixflow.runtime.config import ServerConfig  # noqa: PLC0415 (lazy, as Engine)

        return ServerConfig
    if name == "SamplingParams":
        from radixflow.runtime.protocol.sampling import SamplingParams  # noqa: PLC0415 (lazy, as Engine)

        return SamplingParams
    raise AttributeError(name)
