"""Decode graphs (runtime/model_executor/cuda_graph.py) on CPU: the "record" backend replays the
captured callable over the same static buffers, so the ladder, the padding and the fixed-size
shared-prefix layout are checked against the eager forward without a GPU. The Triton ops
run in the interpreter; real torch.cuda.CUDAGraph capture only runs under CUDA
(`python -m radixflow.bench.gpu_check`)."""

from conftest import use_the_triton_interpreter

use_the_triton_interpreter()  # without CUDA; with it the module is skipped

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("triton")

import torch  # noqa: E402

from radixflow.kernels import CPU_OPS, REFERENCE_OPS, AttentionOps, triton_ops  # noqa: E402
from radixflow.kernels.shared_prefix import MIN_SHARED_KEYS  # noqa: E402
from radixflow.runtime.model_executor.cuda_graph import DecodeGraphs, graph_batch_sizes  # noqa: E402
from radixflow.runtime.model_executor.model_runner import ModelRunner  # noqa: E402
from radixflow.runtime.model_executor.step_inputs import StepInputs  # noqa: E402
from radixflow.runtime.models.layers import CausalLM, ModelConfig  # noqa: E402
from radixflow.runtime.protocol.plan import BatchPlan  # noqa: E402
from radixflow.runtime.protocol.sampling import SamplingParams  # noqa: E402

NUM_SLOTS = 700
MAX_BS = 8  # ladder 1, 2, 4, 8: every interpreted row costs about 0.3 s


def tiny_model(ops: AttentionOps) -> CausalLM:
    config = ModelConfig(
        vocab_size=97, hidden_size=48, intermediate_size=64, num_layers=1, num_heads=6,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=None, max_position=256, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return CausalLM(config, ops).eval()


def fill_caches(runner: ModelRunner) -> None:
    """Random finite K/V in every slot but the dummy page (what earlier steps would leave)."""
    gen = torch.Generator().manual_seed(1)
    for cache in (runner.k_caches, runner.v_caches):
        cache.copy_(torch.randn(cache.shape, generator=gen))
        cache[:, 0].zero_()


def decode_plan(num_reqs: int, seed: int, shared_runs: bool = True) -> BatchPlan:
    """A decode batch as the radix tree lays one out: requests 0..n-1 behind one 70-slot
    run, the first half also behind a further 64-slot run (nested groups), own tails of
    1..20 keys (only those without `shared_runs`); each request's last slot is its new token."""
    rng = np.random.default_rng(seed)
    root, branch = np.arange(1, 71), np.arange(71, 71 + MIN_SHARED_KEYS)
    free = iter(range(71 + MIN_SHARED_KEYS, NUM_SLOTS))
    requests = []
    for b in range(num_reqs):
        tail = [next(free) for _ in range(rng.integers(1, 21))]
        shared = [root, branch] if b < (num_reqs + 1) // 2 else [root]
        shared = shared if shared_runs else []
        requests.append(np.concatenate([*shared, tail]).astype(np.int64))
    lens = [len(r) for r in requests]
    greedy = SamplingParams(temperature=0.0)
    return BatchPlan(
        input_ids=rng.integers(0, 97, num_reqs),
        positions=np.asarray(lens, np.int64) - 1,
        out_slots=np.asarray([r[-1] for r in requests], np.int64),
        num_extend_tokens=0,
        extend_qo_indptr=np.zeros(1, np.int64),
        extend_kv_indptr=np.zeros(1, np.int64),
        extend_kv_indices=np.zeros(0, np.int64),
        decode_kv_indptr=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
        decode_kv_indices=np.concatenate(requests),
        logit_rows=np.arange(num_reqs, dtype=np.int64),
        logprob_targets=np.full(num_reqs, -1, np.int64),
        sample_rows=np.arange(num_reqs, dtype=np.int64),
        sampling=[greedy] * num_reqs,
        sample_seeds=[None] * num_reqs,
        output_ids=[[]] * num_reqs,
        banned_ids=[()] * num_reqs,
    )


@pytest.fixture(scope="module")
def triton_model() -> CausalLM:
    return tiny_model(triton_ops())


def eager_and_graphs(model: CausalLM, shared_prefix: bool = True, **kw: int):
    """Two runners over the same weights and KV contents: one eager, one with graphs."""
    eager = ModelRunner(model, NUM_SLOTS, shared_prefix=shared_prefix)
    graphed = ModelRunner(
        model, NUM_SLOTS, shared_prefix=shared_prefix, cuda_graph_max_bs=MAX_BS,
        max_kv_len=kw.get("max_kv_len", 256), graph_backend="record",
    )  # fmt: skip
    fill_caches(eager)
    fill_caches(graphed)
    return eager, graphed


def test_ladder() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]


@pytest.mark.parametrize(("shared_prefix", "batches"), [(True, (1, 3, 8)), (False, (3,))])
def test_padded_replay_equals_eager(
    triton_model: CausalLM, shared_prefix: bool, batches: tuple[int, ...]
) -> None:
    """Batches of 1, 3 and 8 replay the graphs of 1, 4 and 8 requests (nested shared
    runs in the fixed-size layout when on): the logits and every written K/V equal the
    eager step's, and the dummy slot is zero again."""
    eager, graphed = eager_and_graphs(triton_model, shared_prefix)
    assert graphed.graphs.sizes == [1, 2, 4, 8]
    for step, num_reqs in enumerate(batches):
        plan = decode_plan(num_reqs, seed=step)
        with torch.inference_mode():
            expected = triton_model(
                eager.inputs.forward_batch(plan), eager.k_caches, eager.v_caches
            )
            before = graphed.graphs.num_replays
            logits = graphed.graphs.replay(plan)
        assert graphed.graphs.num_replays == before + 1
        assert logits is not None and logits.shape == (num_reqs, 97)
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(graphed.k_caches, eager.k_caches, atol=1e-6, rtol=0)
        torch.testing.assert_close(graphed.v_caches, eager.v_caches, atol=1e-6, rtol=0)
        assert not graphed.k_caches[:, 0].any() and not graphed.v_caches[:, 0].any()


def test_replay_returns_only_the_logit_rows(triton_model: CausalLM) -> None:
    """A jump's tokens run as decode rows with a logit row only after the last
    (runtime/scheduler/batch.py): the graph's logits are those rows', as the eager step's."""
    eager, graphed = eager_and_graphs(triton_model)
    plan = decode_plan(3, seed=5)
    plan.logit_rows = np.array([0, 2], np.int64)
    plan.logprob_targets = np.full(2, -1, np.int64)
    plan.sample_rows = np.arange(2, dtype=np.int64)
    with torch.inference_mode():
        expected = triton_model(eager.inputs.forward_batch(plan), eager.k_caches, eager.v_caches)
        logits = graphed.graphs.replay(plan)
    assert logits is not None and logits.shape == (2, 97) == expected.shape
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_all_padding_batch_is_what_capture_runs(triton_model: CausalLM) -> None:
    """Capture runs the graph over an all-padding batch: finite logits, no real slot
    written, the dummy slot zeroed."""
    _, graphed = eager_and_graphs(triton_model)
    k_before = graphed.k_caches.clone()
    graphed.graphs._fill(None, 2)
    with torch.inference_mode():
        logits = graphed.graphs.graphs[2]()
    assert logits.shape == (2, 97) and torch.isfinite(logits).all()
    assert torch.equal(graphed.k_caches, k_before)


def test_eager_triton_step_takes_the_shared_prefix_path(triton_model: CausalLM) -> None:
    """The runner derives the Triton layout on the host: two nested groups for this plan."""
    batch = StepInputs(triton_model).forward_batch(decode_plan(5, seed=0))
    layout = batch.layouts["decode", 0]
    assert layout.num_groups == 2 and torch.diff(layout.prefix_indptr).tolist() == [70, 64]
    assert StepInputs(triton_model, shared_prefix=False).forward_batch(
        decode_plan(5, seed=0)
    ).layouts == {("decode", 0): None}


def test_runner_tokens_equal_with_and_without_graphs(triton_model: CausalLM) -> None:
    """ModelRunner.forward: the same greedy tokens and logprobs through the graph."""
    eager, graphed = eager_and_graphs(triton_model)
    plan = decode_plan(3, seed=4)
    expected, got = eager.forward(plan), graphed.forward(plan)
    assert graphed.graphs.num_replays == 1
    assert got.next_token_ids == expected.next_token_ids
    np.testing.assert_allclose(got.next_logprobs, expected.next_logprobs, atol=1e-5)


def test_replay_declines_what_does_not_fit(triton_model: CausalLM) -> None:
    """Extend rows, more requests than the top rung, more own keys or shared-run slots than
    the static metadata holds: None (the runner runs those steps eagerly)."""
    _, graphed = eager_and_graphs(triton_model, max_kv_len=10)  # 80 run slots, 88 own keys
    graphs: DecodeGraphs = graphed.graphs
    assert graphs.replay(decode_plan(MAX_BS + 1, seed=0)) is None
    extend = decode_plan(2, seed=0)
    extend.num_extend_tokens = 1
    assert graphs.replay(extend) is None
    too_many_keys = decode_plan(8, seed=1, shared_runs=False)
    assert len(too_many_keys.decode_kv_indices) == 97
    assert graphs.replay(too_many_keys) is None
    assert graphs.replay(decode_plan(3, seed=0)) is None  # runs of 70 + 64 slots
    assert graphs.num_eager == 2 and graphs.num_replays == 0
    assert graphs.replay(decode_plan(2, seed=0, shared_runs=False)) is not None


def test_record_backend_with_cpu_ops() -> None:
    """The padding also holds for ops that derive their own layout (the CPU fast path),
    though only the Triton ops may be captured on CUDA."""
    model = tiny_model(CPU_OPS)
    eager, graphed = eager_and_graphs(model)
    plan = decode_plan(3, seed=2)
    with torch.inference_mode():
        expected = model(eager.inputs.forward_batch(plan), eager.k_caches, eager.v_caches)
        logits = graphed.graphs.replay(plan)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="Triton ops on a CUDA device"):
        DecodeGraphs(model, eager.k_caches, eager.v_caches, 4, 64, backend="cuda")


def test_triton_extend_takes_its_grid_from_the_host(triton_model: CausalLM) -> None:
    """Prefills of 5 and 9 tokens: the runner hands the Triton extend its longest extend
    (no device sync), and the logits equal the reference ops' on the same weights."""
    plan = decode_plan(1, seed=0)
    plan.input_ids = np.arange(14, dtype=np.int64) % 97
    plan.positions = np.concatenate([np.arange(5), np.arange(9)])
    plan.out_slots = np.arange(300, 314, dtype=np.int64)
    plan.num_extend_tokens = 14
    plan.extend_qo_indptr = np.array([0, 5, 14], np.int64)
    plan.extend_kv_indptr = np.zeros(3, np.int64)
    plan.decode_kv_indptr, plan.decode_kv_indices = np.zeros(1, np.int64), np.zeros(0, np.int64)
    plan.logit_rows = np.array([4, 13], np.int64)
    reference_model = tiny_model(REFERENCE_OPS)
    results = []
    for model in (triton_model, reference_model):
        runner = ModelRunner(model, NUM_SLOTS)
        batch = runner.inputs.forward_batch(plan)
        with torch.inference_mode():
            results.append(model(batch, runner.k_caches, runner.v_caches))
        if model is triton_model:
            assert batch.layouts["extend", 0].max_extend_len == 9
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=1e-5)
