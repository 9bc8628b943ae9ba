"""The disk tier under tensor parallelism: every rank keeps its own shard of the store (torch-free).

With `--tp-size N` each rank's KV pool holds its own KV heads, numbered like rank 0's slots
(runtime/distributed/tensor_parallel.py). Each rank therefore stores its own pages in its own
DiskStore, under a fingerprint that names its rank and the tp size (runtime/hicache.py): a
block's key is rank 0's (chained from rank 0's fingerprint, it names the whole prefix) on
every rank, its payload each rank's own heads. A restart with the same tp size finds every
rank's shard; another tp size (or another rank count) has other fingerprints and reads none.

Rank 0's DiskTier decides everything, in the order the scheduler meets it, and tells ranks
1..N-1 through `Shards` (broadcast with the step plans, so each command lands between the same
two forwards on every rank):

- `save`: copy these slots out of your pool and store them under these keys (an eviction, a
  write-through, the drain's write-back);
- `prefetch`: start reading these blocks (a request started waiting);
- `agree`: read and check these blocks and keep them; the count every rank holds (the
  smallest) is what is loaded: a block missing or bad on any rank is recomputed by all;
- `write`: copy the kept blocks into these slots (empty: drop them; no pages were free).

`ShardFollower` is a rank's side of those commands.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from radixflow.runtime.cache.disk_store import DiskStore

KEY_BYTES = 16


class Shards(Protocol):
    """Ranks 1..N-1's shards, as rank 0's tier sees them."""

    def save(self, keys: list[bytes], tokens: np.ndarray, slots: np.ndarray) -> None: ...

    def prefetch(self, keys: list[bytes], tokens: np.ndarray) -> None: ...

    def agree(self, keys: list[bytes], tokens: np.ndarray, have: int) -> int: ...

    def write(self, slots: np.ndarray, skip: int) -> None: ...


class RowPages(Protocol):
    def read(self, slots: np.ndarray) -> np.ndarray: ...

    def write(self, slots: np.ndarray, rows: np.ndarray) -> None: ...


def pack_keys(keys: list[bytes]) -> np.ndarray:
    """Block keys as int64 (two per key), to travel with the plans."""
    return np.frombuffer(b"".join(keys), dtype=np.int64).copy()


def unpack_keys(packed: np.ndarray) -> list[bytes]:
    raw = np.ascontiguousarray(packed, dtype=np.int64).tobytes()
    return [raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]


class ShardFollower:
    """A rank > 0's shard of the store: it does what rank 0's tier tells it, on its own pool."""

    def __init__(self, store: DiskStore, pages: RowPages, block_tokens: int) -> None:
        self.store, self.pages, self.block_tokens = store, pages, block_tokens
        self._held: list[np.ndarray] = []  # blocks read by `probe`, until `write`

    def _blocks(self, keys: list[bytes], tokens: np.ndarray):
        block = self.block_tokens
        tokens = np.asarray(tokens, dtype=np.int64)
        assert len(tokens) == len(keys) * block, f"{len(tokens)=} {len(keys)=}"
        for i, key in enumerate(keys):
            yield i, key, tokens[i * block : (i + 1) * block]

    def save(self, keys: list[bytes], tokens: np.ndarray, slots: np.ndarray) -> None:
        rows = self.pages.read(np.asarray(slots, dtype=np.int64))
        block = self.block_tokens
        for i, key, span in self._blocks(keys, tokens):
            if not self.store.contains(key):
                self.store.put(key, span, rows[i * block : (i + 1) * block])

    def prefetch(self, keys: list[bytes], tokens: np.ndarray) -> None:
        for _, key, span in self._blocks(keys, tokens):
            self.store.prefetch(key, span)

    def probe(self, keys: list[bytes], tokens: np.ndarray) -> int:
        """Read and check `keys` in order, holding them; the count read before the first
        missing or bad one."""
        self._held = []
        for _, key, span in self._blocks(keys, tokens):
            payload = self.store.get(key, span)
            if payload is None:
                break
            self._held.append(payload)
        return len(self._held)

    def keep(self, count: int) -> None:
        """The ranks agreed on `count` blocks: hold only those."""
        del self._held[count:]

    def write(self, slots: np.ndarray, skip: int) -> None:
        """Copy the held blocks' positions skip..skip+len(slots) into `slots`; let go."""
        if len(slots) and self._held:
            rows = np.concatenate(self._held)[skip : skip + len(slots)]
            self.pages.write(np.asarray(slots, dtype=np.int64), rows)
        self._held = []

    def close(self) -> None:
        self.store.close()
