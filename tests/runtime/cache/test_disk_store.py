"""The disk tier without a model: the block files (checks, atomic writes, capacity, stray
temporary files, fingerprints) and the tier's write-back and load over a real tree and pool."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from radixflow.runtime.cache.disk_store import HEADER, DiskStore
from radixflow.runtime.cache.kv_pool import KVPool
from radixflow.runtime.cache.radix_cache import RadixCache
from radixflow.runtime.cache.tiered import DiskTier, chain_keys

FP_A, FP_B = b"A" * 16, b"B" * 16
ROW = 12  # bytes per token of the fake pool


class FakePages:
    """A pool of KV rows as plain bytes."""

    def __init__(self, num_slots: int) -> None:
        self.data = np.zeros((num_slots, ROW), dtype=np.uint8)

    def read(self, slots: np.ndarray) -> np.ndarray:
        return self.data[slots].copy()

    def write(self, slots: np.ndarray, rows: np.ndarray) -> None:
        self.data[slots] = rows


def rows_for(tokens: np.ndarray) -> np.ndarray:
    """KV rows that depend on the token and its position, as real KV does."""
    grid = tokens[:, None] * 7 + np.arange(len(tokens))[:, None] * 13 + np.arange(ROW)
    return (grid % 251).astype(np.uint8)


def block(seed: int, n: int = 8) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.random.default_rng(seed).integers(0, 50000, n)
    return tokens, rows_for(tokens)


def stored_file(store: DiskStore) -> Path:
    (path,) = [p for p in store.dir.rglob("*.kv")]
    return path


def test_round_trip_and_checks(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "hc", FP_A, 1 << 30, {"model": "a"})
    tokens, rows = block(0)
    key = chain_keys(FP_A, tokens, 8)[0]
    assert store.put(key, tokens, rows)
    store.flush()
    assert np.array_equal(store.get(key, tokens), rows)
    assert (tmp_path / "hc").stat().st_mode & 0o777 == 0o700
    assert store.dir.stat().st_mode & 0o777 == 0o700
    path = stored_file(store)
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x10  # one flipped bit in the payload
    path.write_bytes(bytes(raw))
    assert store.get(key, tokens) is None
    assert not path.exists() and store.stats()["blocks_bad"] == 1  # dropped, not kept
    store.put(key, tokens, rows)
    store.flush()
    path.write_bytes(path.read_bytes()[:-100])  # truncated
    assert store.get(key, tokens) is None and not path.exists()
    store.put(key, tokens, rows)
    store.flush()
    assert store.get(key, tokens + 1) is None  # another prefix under the same name: refused
    store.close()


def test_other_fingerprint_is_ignored(tmp_path: Path) -> None:
    a = DiskStore(tmp_path, FP_A, 1 << 30, {})
    tokens, rows = block(1)
    key = chain_keys(FP_A, tokens, 8)[0]
    a.put(key, tokens, rows)
    a.close()
    b = DiskStore(tmp_path, FP_B, 1 << 30, {})
    assert not b.contains(key) and b.get(key, tokens) is None
    (b.dir / key.hex()[:2]).mkdir()
    os.link(stored_file(a), b.dir / key.hex()[:2] / f"{key.hex()}.kv")  # a file moved across
    assert b.get(key, tokens) is None  # its header names the other fingerprint
    assert chain_keys(FP_A, tokens, 8) != chain_keys(FP_B, tokens, 8)
    b.close()


def test_capacity_drops_least_recently_used(tmp_path: Path) -> None:
    tokens, rows = block(2)
    size = len(tokens) * 8 + rows.nbytes + 64  # about one file
    store = DiskStore(tmp_path, FP_A, 3 * size, {})
    keys = []
    for seed in range(3):
        t, r = block(seed)
        keys.append(chain_keys(FP_A, t, 8)[0])
        store.put(keys[-1], t, r)
        store.flush()
    assert store.get(keys[0], block(0)[0]) is not None  # used: now the most recent
    t, r = block(3)
    store.put(chain_keys(FP_A, t, 8)[0], t, r)
    store.flush()
    assert [store.contains(k) for k in keys] == [True, False, True]
    assert store.disk_bytes <= 3 * size
    store.close()


def test_sigkill_mid_write_leaves_a_readable_store(tmp_path: Path) -> None:
    """A writer killed mid-stream: every block file is whole, stray temporary files go."""
    script = textwrap.dedent(f"""
        import numpy as np, sys
        from radixflow.runtime.cache.disk_store import HEADER, DiskStore
        store = DiskStore({str(tmp_path)!r}, {FP_A!r}, 1 << 34, {{}})
        rng = np.random.default_rng(0)
        for i in range(100000):
            t = rng.integers(0, 50000, 64)
            store.put(i.to_bytes(16, "big"), t, np.full((64, 4096), i % 251, np.uint8))
            if i == 20:  # some blocks surely on disk (the writer thread may lag), more coming
                store.flush()
                print("writing", flush=True)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert child.stdout.readline() == b"writing\n"
    child.send_signal(signal.SIGKILL)
    child.wait()
    (stray := tmp_path / FP_A.hex() / "00" / ".x.kv.999999999.1.tmp").parent.mkdir(exist_ok=True)
    stray.write_bytes(b"torn")  # as a killed writer leaves one (pid 999999999 is no process)
    store = DiskStore(tmp_path, FP_A, 1 << 34, {})
    assert not stray.exists()
    files = list(store.dir.rglob("*.kv"))
    assert files, "the child wrote nothing before it was killed"
    for path in files:
        raw = path.read_bytes()
        i = int(path.stem, 16)
        tokens = np.frombuffer(raw[HEADER.size : HEADER.size + 64 * 8], np.int64)
        payload = store.get(bytes.fromhex(path.stem), tokens)
        assert payload is not None and (payload == i % 251).all()
    store.close()


def make_tier(tmp_path: Path, policy: str, page_size: int = 1) -> tuple[DiskTier, FakePages]:
    pool = KVPool(64, page_size)
    pages = FakePages(pool.num_slots)
    store = DiskStore(tmp_path, FP_A, 1 << 30, {})
    return DiskTier(RadixCache(pool), pool, store, pages, policy, 4 * page_size), pages


def compute(tier: DiskTier, pages: FakePages, tokens: np.ndarray) -> None:
    """What a request does: KV into fresh pages, the tree adopts them, the request lets go."""
    size = tier.pool.page_size
    got = tier.pool.alloc_pages(-(-len(tokens) // size))
    slots = (np.asarray(got)[:, None] * size + np.arange(size)).ravel()[: len(tokens)]
    pages.write(slots, rows_for(tokens))
    tier.tree.insert(tokens, slots)
    tier.computed(tokens, slots, 0)
    tier.pool.decref(got)


@pytest.mark.parametrize(("policy", "page_size"), [("write_back", 1), ("write_through", 2)])
def test_tier_writes_back_and_loads(tmp_path: Path, policy: str, page_size: int) -> None:
    tier, pages = make_tier(tmp_path, policy, page_size)
    block_len = tier.block_tokens
    tokens = np.arange(100, 100 + 3 * block_len + 3)  # 3 whole blocks and a tail
    compute(tier, pages, tokens)
    tier.store.flush()
    on_disk = len(list(tier.store.dir.rglob("*.kv")))
    assert on_disk == (3 if policy == "write_through" else 0)
    assert tier.tree.evict(1000) == len(tokens)  # the pool forgets it: now it is on disk
    tier.store.flush()
    assert len(list(tier.store.dir.rglob("*.kv"))) == 3
    tier.store.close()

    fresh, fresh_pages = make_tier(tmp_path, policy, page_size)  # a restart
    head = tokens[: block_len + 1]  # one block and a token of the next, already in the pool
    compute(fresh, fresh_pages, head)
    prefix, node = fresh.tree.match_prefix(tokens)
    assert len(prefix) == len(head)
    loaded = fresh.load(tokens, prefix, node, fresh.pool.alloc_pages)
    assert loaded == 3 * block_len - len(head)
    slots, _ = fresh.tree.match_prefix(tokens)
    assert len(slots) == 3 * block_len
    assert np.array_equal(fresh_pages.data[slots], rows_for(tokens[: 3 * block_len]))
    refs = fresh.tree.check()
    refs[0] += 1
    assert (refs == fresh.pool.refs).all()  # the tree holds exactly the loaded pages
    assert fresh.stats()["hicache_hit_tokens"] == loaded
    fresh.store.close()


def test_tier_load_stops_at_a_bad_block(tmp_path: Path) -> None:
    tier, pages = make_tier(tmp_path, "write_through")
    tokens = np.arange(7, 7 + 12)
    compute(tier, pages, tokens)
    tier.store.close()
    keys = chain_keys(FP_A, tokens, 4)
    second = tier.store.dir / keys[1].hex()[:2] / f"{keys[1].hex()}.kv"
    second.write_bytes(second.read_bytes()[:-1])
    fresh, _ = make_tier(tmp_path, "write_through")
    prefix, node = fresh.tree.match_prefix(tokens)
    assert fresh.load(tokens, prefix, node, fresh.pool.alloc_pages) == 4  # block 0 only
    assert not second.exists()
    fresh.store.close()


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_prefetch_reads_the_blocks_past_the_pool_match(tmp_path: Path) -> None:
    """A waiting request's blocks are read in the background: its admission gets them from
    memory (here: even once their files are gone)."""
    tier, pages = make_tier(tmp_path, "write_through")
    tokens = np.arange(3, 3 + 12)  # 3 blocks of 4
    compute(tier, pages, tokens)
    tier.store.close()
    fresh, fresh_pages = make_tier(tmp_path, "write_through")
    compute(fresh, fresh_pages, tokens[:5])  # block 0 and a token of block 1 in the pool
    fresh.prefetch(tokens)
    wait_for(lambda: fresh.store.stats()["blocks_prefetched"] == 2)  # blocks 1 and 2 only
    for path in fresh.store.dir.rglob("*.kv"):
        path.unlink()
    prefix, node = fresh.tree.match_prefix(tokens)
    assert fresh.load(tokens, prefix, node, fresh.pool.alloc_pages) == 12 - 5
    slots, _ = fresh.tree.match_prefix(tokens)
    assert np.array_equal(fresh_pages.data[slots], rows_for(tokens))
    fresh.store.close()


def test_two_stores_on_one_directory(tmp_path: Path) -> None:
    """Two processes' stores writing the same blocks at once (as two servers would): every
    file ends whole, and each store reads what the other wrote."""
    a, b = DiskStore(tmp_path, FP_A, 1 << 30, {}), DiskStore(tmp_path, FP_A, 1 << 30, {})
    blocks = [block(seed, 64) for seed in range(40)]
    keys = [chain_keys(FP_A, tokens, 64)[0] for tokens, _ in blocks]
    for key, (tokens, rows) in zip(keys, blocks):
        a.put(key, tokens, rows)
        b.put(key, tokens, rows)
    a.flush()
    b.flush()
    only_b = block(99, 64)
    b.put(key_b := chain_keys(FP_A, only_b[0], 64)[0], *only_b)
    b.flush()
    assert np.array_equal(a.get(key_b, only_b[0]), only_b[1])
    for key, (tokens, rows) in zip(keys, blocks):
        assert np.array_equal(a.get(key, tokens), rows)
    assert not list(tmp_path.rglob("*.tmp"))
    a.close()
    b.close()
