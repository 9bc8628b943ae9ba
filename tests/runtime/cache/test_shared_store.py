"""Two processes on one store directory at once (two servers given the same
--hicache-storage-dir, or the replicas of --dp-size): each writes, reads what the other wrote,
and deletes past a small cap, all concurrently. No read ever returns a block that fails its
check or differs from what was written for its key, and the directory is left whole. The same
with two real servers: tests/runtime/server/test_hicache_shared.py (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from radixflow.runtime.cache.disk_store import DiskStore
from radixflow.runtime.cache.tiered import chain_keys

FP = b"S" * 16
BLOCK = 64
WORKER = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from radixflow.runtime.cache.disk_store import DiskStore
    from radixflow.runtime.cache.tiered import chain_keys

    root, me, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    FP, BLOCK, ROW = b"S" * 16, 64, 256

    def block(seed):
        tokens = np.random.default_rng(seed).integers(0, 50000, BLOCK)
        rows = (tokens[:, None] * 7 + np.arange(ROW) * (seed + 1)) % 251
        return chain_keys(FP, tokens, BLOCK)[0], tokens, rows.astype(np.uint8)

    blocks = [block(seed) for seed in range(48)]
    # a cap of about 16 blocks: both processes delete files the other one wrote or reads
    store = DiskStore(root, FP, 16 * BLOCK * (ROW + 8) + 16 * 80, {"shared": True})
    rng = np.random.default_rng(me)
    served = wrong = 0
    for _ in range(rounds):
        for seed in rng.permutation(len(blocks)):
            if seed % 3 in (me, 2):  # its own thirds and a shared one
                store.put(*blocks[seed])
            key, tokens, rows = blocks[rng.integers(len(blocks))]
            got = store.get(key, tokens)
            if got is not None:
                served += 1
                wrong += not np.array_equal(got, rows)
        store.flush()
    store.close()
    print(json.dumps({"served": served, "wrong": wrong, **store.stats()}))
    """
)


def test_two_processes_share_one_directory(tmp_path: Path) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(tmp_path), str(me), "6"], stdout=subprocess.PIPE
        )
        for me in (0, 1)
    ]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        results.append(json.loads(out))
    for result in results:
        assert result["wrong"] == 0 and result["blocks_bad"] == 0, result
        assert result["served"] > 50 and result["blocks_deleted"] > 0, result
    assert not list(tmp_path.rglob("*.tmp"))  # no torn or stray file left
    # what is left reads back whole for a third process
    store = DiskStore(tmp_path, FP, 1 << 30, {})
    files = list(store.dir.rglob("*.kv"))
    assert files
    for seed in range(48):
        tokens = np.random.default_rng(seed).integers(0, 50000, BLOCK)
        key = chain_keys(FP, tokens, BLOCK)[0]
        if store.contains(key):
            assert store.get(key, tokens) is not None
    assert store.stats()["blocks_bad"] == 0
    store.close()
