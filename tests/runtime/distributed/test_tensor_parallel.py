"""Tensor parallelism (runtime/distributed/tensor_parallel.py, runtime/models/sharding.py,
runtime/distributed/tp_worker.py) on CPU with gloo, one torch thread per rank.

- the head, MLP and vocabulary partitions (even, uneven, replicated KV heads);
- tp=2 logits within 1e-4 of tp=1 on a ragged step with cached prefixes for a tiny model of
  every family, with 2, 3 and 1 KV heads (even, uneven, replicated over the 2 ranks);
- (slow) `--tp-size 1` never starts torch.distributed;
- a rank killed mid-run: the requests in flight get errors (no hang), the server reports
  unhealthy, restarts both ranks and serves the same tokens again;
- (slow) two "nodes" on loopback (`--nnodes 2`, `--node-rank 0/1`, one `--dist-init-addr`)
  serve 16 greedy prompts exactly as tp=1 does, again after node 1's rank was killed and
  rejoined, and SIGTERM on node 0 stops node 1 too;
- (slow) n-gram speculation, a regex and seeded sampling give tp=1's outputs;
- (slow) SmolLM2: tp=2 logits within 1e-4 of tp=1 on ragged steps with a cached prefix,
  and greedy output of 16 prompts equal.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from family_models import FAMILIES, one_thread, save_family, save_gemma3_multimodal
from tp_ranks import CPU, VARIANTS, ragged_logits

from conftest import CHAT_PROMPTS, Server, chat, die_with_parent, start_server
from radixflow.backend import RuntimeEndpointError
from radixflow.runtime import Engine
from radixflow.runtime.config import ServerConfig
from radixflow.runtime.model_executor.model_runner import load_model
from radixflow.runtime.models import UnsupportedModelError
from radixflow.runtime.models.sharding import gather_vocab, split_heads
from radixflow.runtime.protocol import messages as m
from radixflow.runtime.scheduler.batch import build_plan

TOLERANCE = 1e-4
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
TINY = {"device": "cpu", "dtype": "float32", "num_threads": 1, "max_total_tokens": 2048}
HELPER = Path(__file__).resolve().parents[2] / "tp_ranks.py"  # rank 1 of the tiny families


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """A tiny Llama with biases on every projection (o_proj's and down_proj's bias must be
    added once, after the all-reduce)."""
    with one_thread():
        path, _ = save_family("llama", tmp_path_factory.mktemp("tp"))
    return path


def _prompts(count: int) -> list[str]:
    words = ["alpha", "beta", "gamma", "delta", "sea", "sky", "seven", "blue", "tree"]
    return [
        " ".join(words[(i * 5 + j) % len(words)] for j in range(2 + i % 7)) for i in range(count)
    ]


# ---- partitions ---------------------------------------------------------------------------


def test_heads_split_so_each_rank_groups_uniformly() -> None:
    """Every query head is kept by exactly one rank, every rank's query heads read only its
    own KV heads, and the local grouping (local head h -> local KV head h // group) holds."""
    for heads, kv_heads, size in [(4, 2, 2), (9, 3, 2), (6, 3, 2), (4, 1, 2), (8, 2, 4),
                                  (12, 4, 8), (8, 8, 3), (32, 8, 8)]:  # fmt: skip
        owned: list[int] = []
        for rank in range(size):
            q, kv = split_heads(heads, kv_heads, size, rank)
            assert len(q) >= 1 and len(q) % len(kv) == 0, (heads, kv_heads, size, rank)
            local_group = len(q) // len(kv)
            for i, h in enumerate(q):  # the global KV head of h is the local one it reads
                assert h // (heads // kv_heads) == kv[i // local_group], (heads, kv_heads, h)
            owned += list(q)
        assert sorted(owned) == list(range(heads))
    assert [tuple(map(len, split_heads(9, 3, 2, r))) for r in (0, 1)] == [(3, 1), (6, 2)]
    with pytest.raises(UnsupportedModelError, match="exceeds"):
        split_heads(2, 1, 4, 0)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"tp_size": 3, "nnodes": 2, "dist_init_addr": "127.0.0.1:1234"}, "divide tp_size"),
        ({"tp_size": 2, "nnodes": 2}, "needs --dist-init-addr"),
        ({"tp_size": 2, "dist_init_addr": "127.0.0.1"}, "host:port"),
        ({"tp_size": 2, "nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, "node_rank"),
        ({"tp_size": 2, "dp_size": 2}, "not supported"),
        ({"tp_size": 0}, "tp_size"),
    ],
)
def test_bad_tensor_parallel_configs_are_refused(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerConfig(**changes)


class _FakeGroup:
    """Rank 0 of `size` whose peers' shards are given: gather returns them all."""

    def __init__(self, shards: list[torch.Tensor]) -> None:
        self.rank, self.size, self.shards = 0, len(shards), shards

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        width = tensor.shape[1]
        assert all(s.shape[1] <= width for s in self.shards)
        return [tensor] + [
            torch.nn.functional.pad(s, (0, width - s.shape[1])) for s in self.shards[1:]
        ]


def test_logits_gather_trims_uneven_vocabulary_shards() -> None:
    full = torch.arange(2 * 10, dtype=torch.float32).view(2, 10)
    shards = [full[:, 0:3], full[:, 3:6], full[:, 6:10]]  # split(10, 3, r)
    assert torch.equal(gather_vocab(shards[0], 10, _FakeGroup(shards)), full)


def test_rank0_refuses_to_step_after_a_partial_step_or_a_dead_worker() -> None:
    """A step whose forward raised on rank 0 after its plan went out leaves the ranks out of
    step; a worker that exited leaves the group short: either way no further step is sent."""
    from radixflow.runtime.distributed.tensor_parallel import TensorParallel, TensorParallelError

    sent = []
    tp = TensorParallel(0, 2)
    tp._control = lambda header, body=None, timeout=0.0: sent.append(int(header[0]))

    def failing_forward(plan: Any) -> Any:
        raise RuntimeError("rank 0 failed mid-forward")

    plan, _ = build_plan([], [], 16, ())
    assert tp.run_step(lambda p: "result", plan) == "result" and not tp.pending
    with pytest.raises(RuntimeError, match="mid-forward"):
        tp.run_step(failing_forward, plan)
    with pytest.raises(TensorParallelError, match="out of step"):
        tp.check()
    with pytest.raises(TensorParallelError, match="out of step"):
        tp.run_step(lambda p: "result", plan)
    assert sent == [1, 1]  # the first two steps' plans only
    tp = TensorParallel(0, 2)
    tp.workers = {1: subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])}
    tp.workers[1].wait(30)
    with pytest.raises(TensorParallelError, match="rank 1 exited with code 3"):
        tp.check()


# ---- shards against the whole model --------------------------------------------------------


def test_tiny_families_tp2_logits_match_tp1(tmp_path) -> None:
    """Every family, with KV heads split evenly (2), unevenly (3) and replicated (1), and the
    image-text Gemma 3 checkpoint: rank 0 (this process) and rank 1 (tests/tp_ranks.py) run
    the same ragged step on their shards."""
    from radixflow.runtime.distributed.tensor_parallel import TensorParallel, load_shard

    with one_thread():
        for family in FAMILIES:
            for variant, overrides in VARIANTS.items():
                save_family(family, tmp_path, f"{family}-{variant}", **overrides)
        save_gemma3_multimodal(tmp_path)  # renamed names, a vision tower not read
    listener = socket.create_server(("127.0.0.1", 0))
    addr = f"127.0.0.1:{listener.getsockname()[1]}"
    rank1 = subprocess.Popen(
        [sys.executable, str(HELPER), addr, str(tmp_path)], preexec_fn=die_with_parent()
    )
    errors: dict[str, float] = {}
    local_kv_heads: dict[str, int] = {}
    try:
        with one_thread():
            tp = TensorParallel.join(0, 2, addr, 30.0, CPU, listener.detach())
            for path in sorted(tmp_path.iterdir()):
                want = ragged_logits(load_model(path, ServerConfig(), CPU, torch.float32))
                shard = load_shard(path, ServerConfig(), CPU, tp)
                local_kv_heads[path.name] = shard.config.num_kv_heads
                errors[path.name] = (ragged_logits(shard) - want).abs().max().item()
            tp.close(stop=False)
        assert rank1.wait(60) == 0
    finally:
        if rank1.poll() is None:
            rank1.kill()
    assert len(errors) == len(FAMILIES) * len(VARIANTS) + 1
    bad = {name: err for name, err in errors.items() if not err < TOLERANCE}
    assert not bad, f"max abs logit error over {TOLERANCE}: {bad}"
    # rank 0's share: 1 of 2 KV heads, 1 of 3 (uneven), the 1 (replicated)
    assert {local_kv_heads[f"llama-{v}"] for v in VARIANTS} == {1}
    assert local_kv_heads["gemma3-kv2"] == 1


@pytest.mark.slow  # a fresh interpreter loading torch and transformers: ~10 s of the budget
def test_tp1_never_starts_torch_distributed(tiny_llama) -> None:
    code = (
        "import sys, torch.distributed as dist\n"
        "from radixflow.runtime import Engine\n"
        f"e = Engine(model={str(tiny_llama)!r}, **{TINY!r})\n"
        "e.generate('Hi', {'max_new_tokens': 2})\n"
        "tp = 'radixflow.runtime.distributed.tensor_parallel'\n"
        "print(dist.is_initialized(), tp in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"]


# ---- lifecycle through the server ----------------------------------------------------------


def _workers(scheduler_pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(scheduler_pid).children() if "tp-worker" in p.cmdline()]


@pytest.mark.slow  # 25 s of starting and killing ranks
def test_killed_rank_fails_requests_then_the_server_recovers(tiny_llama) -> None:
    with start_server(model_path=str(tiny_llama), tp_size=2, log_level="warning", **TINY) as rt:
        before = rt.endpoint.generate("Hello", GREEDY)
        scheduler_pid = rt.endpoint.health()["scheduler_pid"]
        (worker,) = _workers(scheduler_pid)
        started, failures = threading.Event(), []
        long = {**GREEDY, "max_new_tokens": 220}

        def stream(i: int) -> None:
            try:
                for _ in rt.endpoint.generate_stream(f"Count {i}:", long):
                    started.set()
                failures.append(("finished", time.monotonic()))
            except RuntimeEndpointError as e:
                failures.append((e.code, time.monotonic()))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        assert started.wait(60)
        killed_at = time.monotonic()
        worker.kill()
        for t in threads:
            t.join(30)
        assert len(failures) == 3 and all(
            code in (m.ERROR_FAILED, m.ERROR_UNAVAILABLE) for code, _ in failures
        ), failures
        assert max(at for _, at in failures) - killed_at < 10
        statuses, deadline = [], time.monotonic() + 180
        while not ((health := rt.endpoint.health())["ok"] and health["scheduler_restarts"]):
            statuses.append(health["status"])
            assert time.monotonic() < deadline, statuses[-5:]
            time.sleep(0.05)
        assert "restarting" in statuses and "exited" in health["last_error"]
        assert health["scheduler_restarts"] == 1 and health["scheduler_pid"] != scheduler_pid
        assert not psutil.pid_exists(scheduler_pid)
        (new_worker,) = _workers(health["scheduler_pid"])
        assert rt.endpoint.generate("Hello", GREEDY)["output_ids"] == before["output_ids"]
        rt.process.send_signal(signal.SIGTERM)  # stops every rank
        assert rt.process.wait(30) == 0
        new_worker.wait(10)
        assert not psutil.pid_exists(health["scheduler_pid"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_on_loopback_serve_like_one(tiny_llama) -> None:
    """Node 0 (the server, rank 0) and node 1 (`serve --node-rank 1`: rank 1) on one
    address: 16 greedy prompts as tp=1 gives them; node 1's rank killed while idle, rank 0
    notices (its ping), restarts, node 1 joins again and the same tokens come back; SIGTERM
    on node 0 stops node 1."""
    prompts = _prompts(16)
    with Engine(model=str(tiny_llama), **TINY) as engine:
        want = [o["output_ids"] for o in engine.generate(prompts, GREEDY)]
    addr = f"127.0.0.1:{_free_port()}"
    nodes = {"tp_size": 2, "nnodes": 2, "dist_init_addr": addr, **TINY}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in nodes.items()]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "radixflow.runtime", "serve", "--model-path", str(tiny_llama),
         "--node-rank", "1", "--log-level", "warning", *flags],
        stdin=subprocess.DEVNULL, preexec_fn=die_with_parent(),
    )  # fmt: skip
    try:
        options = {"model_path": str(tiny_llama), "log_level": "warning", **nodes}
        with start_server(node_rank=0, **options) as rt:
            assert _generate_all(rt, prompts) == want
            assert rt.endpoint.health()["scheduler_restarts"] == 0
            (rank1,) = psutil.Process(node1.pid).children()
            rank1.kill()
            health = wait_for_health(rt, lambda h: h["ok"] and h["scheduler_restarts"] == 1)
            assert "exited" in health["last_error"]
            assert _generate_all(rt, prompts) == want
            rt.process.send_signal(signal.SIGTERM)
            assert rt.process.wait(30) == 0
        assert node1.wait(30) == 0  # rank 0 told node 1's rank to stop; the node exits
    finally:
        if node1.poll() is None:
            node1.kill()


def wait_for_health(rt: Server, done: Any, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while not done(health := rt.endpoint.health()):
        assert time.monotonic() < deadline, health
        time.sleep(0.1)
    return health


def _generate_all(rt: Server, prompts: list[str]) -> list[Any]:
    """All prompts at once (one thread each), so they batch: -> output ids in order."""
    results: list[Any] = [None] * len(prompts)

    def run(i: int) -> None:
        results[i] = rt.endpoint.generate(prompts[i], GREEDY)["output_ids"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


@pytest.mark.slow
def test_engine_tp2_sampling_features_match_tp1(tiny_llama) -> None:
    """Sampling stays on rank 0: n-gram speculative decoding (verify rows in the plan), a
    regex grammar and seeded sampling give tp=1's outputs."""
    prompts = ["one two three one two three one two", "abc abc abc abc", "hello world"]
    runs = [
        {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
        {"max_new_tokens": 16, "temperature": 0, "regex": "[0-9]{3}-[a-z]{4}"},
        {"max_new_tokens": 16, "temperature": 0.8, "seed": 5},
    ]
    outs = []
    for tp in (1, 2):
        with Engine(
            model=str(tiny_llama),
            tp_size=tp,
            speculative_algorithm="ngram",
            speculative_disable_by_batch_size=0,
            **TINY,
        ) as e:
            outs.append([[o["output_ids"] for o in e.generate(prompts, p)] for p in runs])
            assert e.stats()["spec_verify_steps"] > 0  # drafts were verified
    assert outs[0] == outs[1]


# ---- SmolLM2 ------------------------------------------------------------------------------


def _capture_logits(engine: Engine) -> list[torch.Tensor]:
    """Every step's logits as the runner samples from them (rank 0's gathered ones)."""
    runner, steps = engine.scheduler.runner, []
    postprocess = runner._postprocess

    def capture(logits: torch.Tensor, plan: Any) -> Any:
        steps.append(logits.clone())
        return postprocess(logits, plan)

    runner._postprocess = capture
    return steps


@pytest.mark.slow
def test_smollm2_tp2_matches_tp1(make_engine) -> None:
    """Ragged steps (a decode beside prompts, two continuing a cached prefix, one fresh,
    input logprobs on every row) have tp=2 logits within 1e-4 of tp=1; 16 greedy chat
    prompts give the same tokens."""
    config = {"max_total_tokens": 16384, "self_check": True}
    engines = [make_engine(**config), Engine(model="smollm2", tp_size=2, num_threads=1, **config)]
    try:
        prefix = chat("Tell me about the history of Paris in detail.")
        steps = []
        for engine in engines:
            captured = _capture_logits(engine)
            engine.generate(prefix, {"max_new_tokens": 1})  # caches the prefix
            captured.clear()
            (running,) = engine.submit(chat("Count to twenty."), {**GREEDY, "max_new_tokens": 6})
            engine.step()
            engine.step()  # now decoding beside the batch below
            start = len(engine.tokenizer.encode(prefix, add_special_tokens=False))
            batch = engine.submit(
                [prefix + "Paris", prefix + "The city"],
                {**GREEDY, "max_new_tokens": 4},
                return_logprob=True,
                logprob_start_len=start,  # rows after the cached prefix
            )
            batch += engine.submit(
                chat("Name a color."), {**GREEDY, "max_new_tokens": 4}, return_logprob=True
            )
            while engine.step():
                pass
            assert running.finished and all(h.finished for h in batch)
            assert batch[0].result()["meta_info"]["cached_tokens"] > 30
            steps.append(captured)
        assert [s.shape for s in steps[0]] == [s.shape for s in steps[1]]
        errors = [(a - b).abs().max().item() for a, b in zip(*steps)]
        assert max(errors) < TOLERANCE, errors
        prompts = [chat(p) for p in CHAT_PROMPTS] + [chat(p) for p in _prompts(11)]
        params = {"max_new_tokens": 24, "temperature": 0}
        outs = [[o["output_ids"] for o in e.generate(prompts, params)] for e in engines]
        assert outs[0] == outs[1]
    finally:
        engines[1].shutdown()


def test_every_rank_takes_rank0s_pool_dtype() -> None:
    """Under auto, rank 0 plans from the quantized checkpoint (a float16 pool) and a rank > 0
    from its dequantized shard (float32): both take rank 0's, through the group's min."""
    import threading

    from radixflow.runtime.model_executor.kv_sizing import KVSizing, rank0_pool_dtype

    values: list[int] = []
    both = threading.Barrier(2)

    def agree_min(value: int) -> int:  # an all-reduce-min over the two threads
        values.append(value)
        both.wait()
        return min(values)

    chosen: dict[int, str] = {}

    def rank(r: int, dtype: str) -> None:  # rank 1 would have chosen its own dtype
        sizing = KVSizing(1024, 64, "test", 4096, dtype)
        chosen[r] = rank0_pool_dtype(agree_min, sizing if r == 0 else None)

    threads = [threading.Thread(target=rank, args=a) for a in ((0, "float16"), (1, "float32"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert chosen == {0: "float16", 1: "float16"}
