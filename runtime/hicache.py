"""Wiring the disk tier under the radix tree (--enable-hierarchical-cache): its directory, the
fingerprint of everything that changes KV, the store, and the pool's page copies.
The tier itself is runtime/cache/tiered.py (torch-free); the file format disk_store.py."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from radixflow.runtime.cache.disk_store import DiskStore
from radixflow.runtime.cache.kv_pool import KVPool
from radixflow.runtime.cache.radix_cache import RadixCache
from radixflow.runtime.cache.tier_shards import ShardFollower
from radixflow.runtime.cache.tiered import DiskTier
from radixflow.runtime.config import ServerConfig
from radixflow.runtime.model_executor.kv_pages import PoolPages
from radixflow.runtime.model_executor.model_runner import ModelRunner
from radixflow.runtime.models.loader import cache_root, gguf_source

BLOCK_TOKENS = 64  # positions per stored block (rounded up to whole pages)
ENV_DIR = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"  # SGLang's file backend reads this


def storage_dir(config: ServerConfig) -> Path:
    return Path(config.hicache_storage_dir or os.environ.get(ENV_DIR) or cache_root() / "hicache")


def build_tier(
    config: ServerConfig, model_dir: Path, runner: ModelRunner, pool: KVPool, tp: tuple[int, int]
) -> DiskTier | None:
    """The disk tier and its tree, or None when --enable-hierarchical-cache is off (or the
    radix cache, or the model stores no KV). Under tensor parallelism this is rank 0's shard;
    the caller sets its `shards` (the other ranks')."""
    built = _build_store(config, model_dir, runner, tp)
    if built is None:
        return None
    store, pages, block = built
    tree = RadixCache(pool)
    return DiskTier(tree, pool, store, pages, config.hicache_write_policy, block)


def build_shard(
    config: ServerConfig, model_dir: Path, runner: ModelRunner, tp: tuple[int, int]
) -> ShardFollower | None:
    """Tensor-parallel rank tp[0] > 0's shard of the store (runtime/cache/tier_shards.py),
    or None where rank 0 builds no tier."""
    built = _build_store(config, model_dir, runner, tp)
    return None if built is None else ShardFollower(*built)


def _build_store(
    config: ServerConfig, model_dir: Path, runner: ModelRunner, tp: tuple[int, int]
) -> tuple[DiskStore, PoolPages, int] | None:
    if not config.enable_hierarchical_cache or config.disable_radix_cache:
        return None
    if not runner.model.stores_kv:
        return None
    pages = PoolPages(runner, config.hicache_storage_dtype)
    page = config.page_size
    block = -(-BLOCK_TOKENS // page) * page
    described = fingerprint_of(config, model_dir, runner, pages, block, tp)
    digest = hashlib.blake2b(json.dumps(described, sort_keys=True).encode(), digest_size=16)
    store = DiskStore(
        storage_dir(config), digest.digest(), int(config.hicache_size * 1e9), described
    )
    return store, pages, block


def fingerprint_of(
    config: ServerConfig,
    model_dir: Path,
    runner: ModelRunner,
    pages: PoolPages,
    block_tokens: int,
    tp: tuple[int, int],
) -> dict[str, Any]:
    """Everything that changes the KV a token sequence leaves in the pool: the weights' files
    (name, size, mtime: not their hash, which would read gigabytes at every start), the
    model's shape and rope, dtypes, quantization, the storage layout and the tp shard."""
    files = [p for p in sorted(model_dir.iterdir()) if p.is_file()]
    source = gguf_source(model_dir)
    files += [source] if source is not None and source.is_file() else []
    return {
        "format": 1,
        "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files],
        "model": json.loads(json.dumps(dataclasses.asdict(runner.model.config), default=str)),
        "dtype": str(runner.dtype),
        "kv_pool_dtype": str(runner.kv_dtype),
        "storage_dtype": str(pages.dtype),
        "bytes_per_token": pages.bytes_per_token,
        "page_size": config.page_size,
        "block_tokens": block_tokens,
        "quantization": config.quantization,
        "quantized_activations": config.quantized_activations,
        "dequantize_weights": config.dequantize_weights,
        "tp_rank": tp[0],
        "tp_size": tp[1],
    }
