"""The disk tier's shards over tensor parallelism: rank 0's tier tells ranks 1..N-1 what to
save, prefetch and load (runtime/cache/tier_shards.py), as commands broadcast in order with the
step plans (tensor_parallel.py), so every rank's pool and shard see the same changes between
the same two forwards."""

from __future__ import annotations

import logging

import numpy as np

from radixflow.runtime.cache.tier_shards import ShardFollower, pack_keys, unpack_keys
from radixflow.runtime.distributed.tensor_parallel import (
    PREFETCH,
    PROBE,
    SAVE,
    WRITE,
    TensorParallel,
    TensorParallelError,
)

log = logging.getLogger("radixflow.tp")


class TierRanks:
    """Rank 0's `Shards`: the other ranks' shards of the store, through the plan broadcast.
    A save or prefetch the group cannot take (it broke: the scheduler restarts) is skipped:
    a shard that lacks a block makes its load a miss, never a wrong page. A load's agreement
    and copy raise TensorParallelError, as the next step would."""

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp

    def save(self, keys: list[bytes], tokens: np.ndarray, slots: np.ndarray) -> None:
        self._try(SAVE, [pack_keys(keys), tokens, slots])

    def prefetch(self, keys: list[bytes], tokens: np.ndarray) -> None:
        self._try(PREFETCH, [pack_keys(keys), tokens])

    def agree(self, keys: list[bytes], tokens: np.ndarray, have: int) -> int:
        self.tp.send_command(PROBE, 0, [pack_keys(keys), tokens])
        return self.tp.min_of(have)

    def write(self, slots: np.ndarray, skip: int) -> None:
        self.tp.send_command(WRITE, skip, [slots])

    def _try(self, command: int, arrays: list[np.ndarray]) -> None:
        try:
            self.tp.send_command(command, 0, arrays)
        except TensorParallelError as e:
            log.warning("hicache: the other ranks' shards miss a command: %s", e)


def follow(tp: TensorParallel, shard: ShardFollower) -> None:
    """Ranks 1..N-1: run rank 0's tier commands on this rank's shard."""

    def run(command: int, argument: int, arrays: list[np.ndarray]) -> None:
        if command == SAVE:
            shard.save(unpack_keys(arrays[0]), arrays[1], arrays[2])
        elif command == PREFETCH:
            shard.prefetch(unpack_keys(arrays[0]), arrays[1])
        elif command == PROBE:
            shard.keep(tp.min_of(shard.probe(unpack_keys(arrays[0]), arrays[1])))
        elif command == WRITE:
            shard.write(arrays[0], argument)
        else:
            raise AssertionError(f"unknown tp command {command}")

    tp.on_command = run
