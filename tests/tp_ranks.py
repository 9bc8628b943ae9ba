"""Rank 1 of the tensor-parallel shard test (tests/runtime/distributed/test_tensor_parallel.py),
and the step both ranks run.

    python tests/tp_ranks.py HOST:PORT ROOT

joins the two-rank group at HOST:PORT as rank 1 and runs `ragged_logits` on its shard of
every checkpoint under ROOT, in name order, as rank 0 (the test process) does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from radixflow.runtime.config import ServerConfig
from radixflow.runtime.models.layers import CausalLM, ForwardBatch

# head layouts over 2 ranks: KV heads split evenly, unevenly (1 + 2), replicated (1 < 2)
VARIANTS = {
    "kv2": {},  # the tiny models' own: 4 heads, 2 KV heads
    "kv3": {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96, "head_dim": 16},
    "kv1": {"num_key_value_heads": 1},
}
PREFIX_LEN = 24
CPU = torch.device("cpu")


def _t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, size=n).tolist()


def ragged_logits(model: CausalLM) -> torch.Tensor:
    """A warm-up step caches two prefixes; then one ragged step: a fresh prompt, a prompt
    continuing after PREFIX_LEN cached tokens, a decode over 40 cached tokens, on scattered
    slots. -> (rows, vocab) logits of every row of that step."""
    cfg = model.config
    k = torch.zeros(cfg.num_layers, 256, cfg.num_kv_heads, cfg.head_dim)
    v = torch.zeros_like(k)
    free = (1 + torch.randperm(255, generator=torch.Generator().manual_seed(0))).tolist()
    s0, s1, s2 = _ids(1, 30), _ids(2, PREFIX_LEN + 14), _ids(3, 41)
    warm = [s1[:PREFIX_LEN], s2[:-1]]
    warm_slots = [[free.pop() for _ in w] for w in warm]
    n_warm = sum(map(len, warm))
    model(
        ForwardBatch(
            _t(warm[0] + warm[1]), _t(list(range(len(warm[0]))) + list(range(len(warm[1])))),
            _t(warm_slots[0] + warm_slots[1]), n_warm, _t([0, len(warm[0]), n_warm]),
            _t([0, 0, 0]), _t([]), _t([0]), _t([]), _t([0]),
        ),
        k, v,
    )  # fmt: skip
    new0, new1 = [free.pop() for _ in s0], [free.pop() for _ in s1[PREFIX_LEN:]]
    dec_slot, n_ext = free.pop(), len(s0) + len(new1)
    return model(
        ForwardBatch(
            _t(s0 + s1[PREFIX_LEN:] + [s2[-1]]),
            _t(list(range(len(s0))) + list(range(PREFIX_LEN, len(s1))) + [40]),
            _t(new0 + new1 + [dec_slot]), n_ext, _t([0, len(s0), n_ext]),
            _t([0, 0, PREFIX_LEN]), _t(warm_slots[0]), _t([0, len(s2)]),
            _t(warm_slots[1] + [dec_slot]), _t(list(range(n_ext + 1))),
        ),
        k, v,
    )  # fmt: skip


def main(addr: str, root: Path) -> int:
    from radixflow.runtime.distributed.tensor_parallel import TensorParallel, load_shard

    torch.set_num_threads(1)
    tp = TensorParallel.join(1, 2, addr, 30.0, CPU)
    for path in sorted(root.iterdir()):
        ragged_logits(load_shard(path, ServerConfig(), CPU, tp))
    tp.close(stop=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
