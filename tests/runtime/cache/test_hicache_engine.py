"""The disk tier on the real model: agents cycling over a pool too small for their prefixes
load them from disk instead of recomputing them, a new engine on the same directory (a
restart) serves what the last one stored, and a damaged or foreign store is never served.
Replies always equal those of an engine without the tier."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from radixflow.runtime.config import ServerConfig
from radixflow.runtime.hicache import ENV_DIR, storage_dir

PARAMS = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


def agent_prompts(num_agents: int, prefix_len: int, turn: int) -> list[list[int]]:
    """Each agent's long private prefix (fixed) and a short question (one per turn)."""
    prompts = []
    for agent in range(num_agents):
        prefix = np.random.default_rng(agent).integers(1000, 40000, prefix_len)
        question = np.random.default_rng(1000 * turn + agent).integers(1000, 40000, 8)
        prompts.append([*prefix.tolist(), *question.tolist()])
    return prompts


def serve_one_by_one(eng, prompts: list[list[int]]) -> tuple[list[list[int]], int, int]:
    """Replies, prefill tokens computed and tokens loaded from disk, one request at a time."""
    before = eng.stats()
    outs = [eng.generate(input_ids=p, sampling_params=PARAMS)["output_ids"] for p in prompts]
    after = eng.stats()
    computed = after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
    return outs, computed, after.get("hicache_hit_tokens", 0) - before.get("hicache_hit_tokens", 0)


def check_agents(make_engine, tmp_path: Path, num_agents: int, prefix_len: int, pool: int):
    """Round 1 fills the disk; in round 2 every agent's prefix was evicted from the pool (it
    holds fewer agents than cycle), so without the tier it is computed again. The reference
    engine runs round 2 only: no agent shares a prefix with another, so a round 1 could not
    have left it anything to reuse."""
    tiered = make_engine(
        max_total_tokens=pool, enable_hierarchical_cache=True, hicache_storage_dir=str(tmp_path)
    )
    plain = make_engine(max_total_tokens=pool)
    serve_one_by_one(tiered, agent_prompts(num_agents, prefix_len, 1))
    second = agent_prompts(num_agents, prefix_len, 2)
    outs, computed_tiered, loaded = serve_one_by_one(tiered, second)
    reference, computed_plain, _ = serve_one_by_one(plain, second)
    assert outs == reference
    assert computed_plain >= num_agents * prefix_len  # every prefix recomputed
    assert loaded >= num_agents * (prefix_len - 64)  # all but a partial block, from disk
    assert computed_plain >= 4 * computed_tiered, (computed_plain, computed_tiered)
    tiered.check_idle()


def test_agents_cycling_over_a_small_pool(make_engine, tmp_path: Path) -> None:
    check_agents(make_engine, tmp_path, num_agents=3, prefix_len=192, pool=256)


@pytest.mark.slow
def test_eight_agents_1000_tokens_on_a_2048_pool(make_engine, tmp_path: Path) -> None:
    check_agents(make_engine, tmp_path, num_agents=8, prefix_len=1000, pool=2048)


PROMPT = agent_prompts(1, 260, 0)[0]  # 4 whole blocks of 64 and a tail


@pytest.fixture(scope="module")
def reference(make_engine) -> list[int]:
    return make_engine().generate(input_ids=PROMPT, sampling_params=PARAMS)["output_ids"]


def block_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kv"), key=lambda p: p.stat().st_mtime_ns)


def store_prompt(make_engine, root: Path, **config) -> None:
    eng = make_engine(enable_hierarchical_cache=True, hicache_storage_dir=str(root), **config)
    assert (
        eng.generate(input_ids=PROMPT, sampling_params=PARAMS)["meta_info"]["cached_tokens_disk"]
        == 0
    )
    eng.shutdown()  # a restart: the next engine has an empty pool


def serve_again(make_engine, root: Path, **config) -> tuple[list[int], dict, dict]:
    eng = make_engine(enable_hierarchical_cache=True, hicache_storage_dir=str(root), **config)
    out = eng.generate(input_ids=PROMPT, sampling_params=PARAMS)
    second = eng.generate(input_ids=PROMPT, sampling_params=PARAMS)  # it keeps serving
    assert second["output_ids"] == out["output_ids"]
    return out["output_ids"], out["meta_info"], eng.stats()


def test_restart_serves_from_disk(make_engine, tmp_path: Path, reference) -> None:
    store_prompt(make_engine, tmp_path)
    assert len(block_files(tmp_path)) == 4
    assert (tmp_path.stat().st_mode & 0o777) == 0o700
    out, meta, stats = serve_again(make_engine, tmp_path)
    assert out == reference
    assert meta["cached_tokens_disk"] == meta["cached_tokens"] == 256
    assert stats["hicache_blocks_read"] == 4 and stats["hicache_bytes_read"] > 0


@pytest.mark.parametrize(
    "damage", ["flipped_byte", pytest.param("truncated", marks=pytest.mark.slow)]
)  # truncation is also covered without the model: test_disk_store.py
def test_damaged_block_is_recomputed(make_engine, tmp_path: Path, reference, damage) -> None:
    store_prompt(make_engine, tmp_path, hicache_write_policy="write_back")
    victim = [p for p in block_files(tmp_path) if p.name != "FINGERPRINT.json"][2]
    raw = bytearray(victim.read_bytes())
    if damage == "flipped_byte":
        raw[len(raw) // 2] ^= 0x01
        victim.write_bytes(bytes(raw))
    else:
        victim.write_bytes(bytes(raw[: len(raw) // 3]))
    out, meta, stats = serve_again(make_engine, tmp_path)
    assert out == reference
    assert meta["cached_tokens_disk"] == 128  # the blocks before the bad one
    assert stats["hicache_blocks_bad"] == 1


def test_store_of_another_configuration_is_ignored(make_engine, tmp_path, reference) -> None:
    store_prompt(make_engine, tmp_path)
    out, meta, _ = serve_again(make_engine, tmp_path, page_size=2)
    assert out == reference and meta["cached_tokens_disk"] == 0
    assert len(list(tmp_path.iterdir())) == 2  # a namespace per fingerprint


def test_an_int8_pool_is_stored_with_its_scales(make_engine, tmp_path: Path) -> None:
    """An int8 pool's blocks carry its scales: the restart's reply equals the int8 pool's own
    (a load that dropped the scales would read zeros where the prefix was)."""
    int8 = {"kv_cache_dtype": "int8"}
    own = make_engine(**int8).generate(input_ids=PROMPT, sampling_params=PARAMS)["output_ids"]
    store_prompt(make_engine, tmp_path, **int8)
    out, meta, _ = serve_again(make_engine, tmp_path, **int8)
    assert out == own and meta["cached_tokens_disk"] == 256


def test_int8_pages_round_trip_exactly() -> None:
    """PoolPages on an int8 pool: rows read from some slots and written to others leave those
    slots with the same int8 values and scales, keys and values alike."""
    import torch

    from radixflow.kernels.kv_int8 import Int8KV
    from radixflow.runtime.model_executor.kv_pages import PoolPages

    def pool() -> Int8KV:
        data = torch.randint(-127, 128, (3, 16, 2, 8), dtype=torch.int8)
        return Int8KV(data, torch.rand(3, 16, 2))

    runner = type("Runner", (), {"k_caches": pool(), "v_caches": pool()})()
    pages = PoolPages(runner)
    assert pages.bytes_per_token == 2 * 3 * 2 * (8 + 4)
    src, dst = np.array([1, 5, 9]), np.array([12, 13, 14])
    pages.write(dst, pages.read(src))
    for kv in (runner.k_caches, runner.v_caches):
        assert torch.equal(kv.data[:, dst], kv.data[:, src])
        assert torch.equal(kv.scale[:, dst], kv.scale[:, src])
    with pytest.raises(ValueError, match="int8 KV pool is stored as it is"):
        PoolPages(runner, "float16")


def test_storage_dir_and_config_checks(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "from-env"))  # SGLang's variable
    assert storage_dir(ServerConfig()) == tmp_path / "from-env"
    assert storage_dir(ServerConfig(hicache_storage_dir="/flag")) == Path("/flag")
    for bad in ({"hicache_write_policy": "write_later"}, {"hicache_size": 0}):
        with pytest.raises(ValueError, match="hicache"):
            ServerConfig(**bad)
