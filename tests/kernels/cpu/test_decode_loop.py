"""The compiled CPU decode loop (kernels/cpu/decode_loop.py) against its reference, the Python
layer loop: the same logits bit for bit, through the engine's public API; the steps it
refuses run in Python."""

from __future__ import annotations

import shutil

import pytest
import torch

from radixflow.kernels.cpu import decode_loop, native

# Only a machine without compilers skips; where they exist a failed build fails every test.
pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None or shutil.which("c++") is None,
    reason="needs a C and a C++ compiler for the native kernels and the extension",
)


@pytest.fixture(autouse=True)
def step_by_step(engine, monkeypatch):
    """A scheduling step per token: these tests hold each step's loop call to the Python
    layers (decode runs, several steps a call: tests/runtime/scheduler/test_decode_runs.py)."""
    config = engine.scheduler.config.replace(num_continuous_decode_steps=1)
    monkeypatch.setattr(engine.scheduler, "config", config)


def test_the_native_kernels_and_the_loop_build() -> None:
    assert native.library() is not None, "the native kernels did not build (see the log)"
    assert decode_loop.extension() is not None, "the decode loop did not build (see the log)"


@pytest.fixture
def model(engine):
    return engine.scheduler.runner.model


def counted(monkeypatch, loop) -> list[int | None]:
    """Each step's use of the loop: its row count, or None where it declined."""
    calls: list[int | None] = []
    real = type(loop).run

    def run(self, batch, hidden, *args):
        out = real(self, batch, hidden, *args)
        calls.append(None if out is None else len(hidden))
        return out

    monkeypatch.setattr(type(loop), "run", run)
    return calls


def both_paths(monkeypatch, model, loop) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every decode step of `model` run through the Python layers and then through `loop`
    (the loop's result returned): -> the (python, looped) logits, filled as steps run."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    forward = type(model).forward

    def both(self, batch, *args):
        if batch.num_extend_tokens:
            return forward(self, batch, *args)
        self.decode_loop = None
        try:
            python = forward(self, batch, *args).clone()
        finally:
            self.decode_loop = loop
        looped = forward(self, batch, *args)
        pairs.append((python, looped.clone()))
        return looped

    monkeypatch.setattr(type(model), "forward", both)
    return pairs


def test_smollm2_qualifies(model) -> None:
    loop = model.decode_loop
    # four projections a layer, each its quantized ranges (SmolLM2 loads from its GGUF blocks)
    assert loop is not None and len(loop.weights[2]) == 4 * model.config.num_layers
    assert all(meta for meta in loop.weights[3])


def test_pool_lists_are_converted_once_and_followed(model) -> None:
    """The loop converts the runner's pool lists for the extension once and reuses that while
    it is handed the same lists; other lists (another pool) get their own conversion, and
    the old one is let go."""
    loop = model.decode_loop
    k, v = (tuple(torch.zeros(8, 3, 64) for _ in range(2)) for _ in "kv")
    first = loop._pools(k, v)
    assert loop._pools(k, v) is first
    other = tuple(t.clone() for t in k)
    second = loop._pools(other, v)
    assert second is not first and loop._pools(other, v) is second
    assert len(loop.pools) == 1 and loop.pools[0][0] is other


def test_decode_steps_give_the_python_layers_logits_bit_for_bit(engine, model, monkeypatch):
    """Five streams decoded: every decode step runs twice on the same inputs, first through
    the Python layers, then through the loop (each writes the step's K/V into the same slots
    before its attention reads them), and the two give the same logits bit for bit (the same
    kernels on the same inputs in the same order); every decode step went through the loop.

    Both paths run within one step, on one KV cache: two separate generations would compare
    prefills too, and a prefill's matmul path is chosen by its row count and by timing at load
    (dense sgemm, AMX), so under load the two generations' caches could differ in last digits
    (seen in CI) while the loop was right."""
    loop = model.decode_loop
    pairs = both_paths(monkeypatch, model, loop)
    calls = counted(monkeypatch, loop)
    prompts = [f"Describe the number {i} in one line:" for i in range(5)]
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    engine.flush_cache()
    results = engine.generate(prompts, params)
    assert all(len(r["output_ids"]) == 10 for r in results)
    assert calls and all(rows == len(prompts) for rows in calls)  # 9 decode steps of 5 rows
    assert len(pairs) == len(calls) == 9
    for python, looped in pairs:
        assert torch.equal(python, looped)


SHARED = "You are a careful assistant. Answer in one short sentence, please. " * 8


def shared_prefix_run(engine, params) -> list[list[int]]:
    """Three streams behind a cached shared prefix (about 130 tokens): their output ids."""
    prompts = [SHARED + f"What is {i} plus {i}?" for i in range(3)]
    engine.flush_cache()
    engine.generate(prompts[0], params)  # caches the prefix
    return [r["output_ids"] for r in engine.generate(prompts, params)]


def test_shared_prefixes_run_in_the_loop(engine, model, monkeypatch) -> None:
    """Streams behind a shared cached prefix take the loop, each row reading the shared keys
    itself: every decode step of three rows went through it, and its logits equal those of
    the Python layers, which read the shared run once and merge it by log-sum-exp (the same
    attention summed in another order: equal to rounding, the same greedy tokens)."""
    loop = model.decode_loop
    pairs = both_paths(monkeypatch, model, loop)
    calls = counted(monkeypatch, loop)
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    shared_prefix_run(engine, params)
    assert calls[-5:] == [3] * 5  # the three streams' five decode steps
    for python, looped in pairs[-5:]:
        torch.testing.assert_close(looped, python, rtol=1e-4, atol=1e-4)
        assert torch.equal(looped.argmax(-1), python.argmax(-1))


def test_long_shared_prefixes_decline_to_python(engine, model, monkeypatch) -> None:
    """Where reading the shared keys row by row would cost more than the Python layers'
    overhead (`SHARED_ATTENTION_MACS`; here lowered below these streams'), those steps run in
    Python, with the same tokens as with the loop off."""
    monkeypatch.setattr(decode_loop, "SHARED_ATTENTION_MACS", 1 << 10)
    calls = counted(monkeypatch, model.decode_loop)
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    got = shared_prefix_run(engine, params)
    assert calls[-5:] == [None] * 5
    monkeypatch.setattr(model, "decode_loop", None)
    assert shared_prefix_run(engine, params) == got


def test_models_it_does_not_serve_get_none(model, monkeypatch) -> None:
    """A model the loop does not cover (here: its LM head sharded, as tensor parallelism
    does; soft-capping; q/k norms; a head size the native attention does not take) builds
    no loop."""
    import dataclasses

    assert decode_loop.build(model) is not None
    monkeypatch.setattr(model, "gather_logits", lambda logits: logits)
    assert decode_loop.build(model) is None
    monkeypatch.setattr(model, "gather_logits", None)
    for change in ({"attn_logit_cap": 30.0}, {"qk_norm": True}, {"head_dim": 40}):
        monkeypatch.setattr(model, "config", dataclasses.replace(model.config, **change))
        assert decode_loop.build(model) is None


@pytest.fixture
def activations(engine, model, request):
    """The model's projections under the --quantized-activations mode of the test's parameter
    (its loop rebuilt for them), the engine's own mode and loop restored after."""
    from radixflow.runtime.models import quantized

    mode, before = request.param, engine.config.quantized_activations
    loop = model.decode_loop
    quantized.set_activations(model, mode)
    model.decode_loop = decode_loop.build(model)
    try:
        yield mode
    finally:
        quantized.set_activations(model, before)
        model.decode_loop = loop


def on_two_threads_both_paths(engine, model, monkeypatch, prompts, new_tokens):
    """`prompts` generated greedily on two threads, every decode step through both paths
    (`both_paths`); -> (the generated results, the (python, looped) logits, whether each
    decode_layers call took the team path)."""
    loop = model.decode_loop
    teamed: list[bool] = []
    layers = loop.ext.decode_layers

    def recording(*args):
        out = layers(*args)
        teamed.append(out[3])
        return out

    monkeypatch.setattr(loop.ext, "decode_layers", recording)
    pairs = both_paths(monkeypatch, model, loop)
    # the team splits over threads (one thread keeps the per-call path): two, held while the
    # test runs (`--num-threads auto`'s governor drops one on a busy machine)
    monkeypatch.setattr(engine.scheduler.runner, "governor", None)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
        engine.flush_cache()
        results = engine.generate(prompts, params)
    finally:
        torch.set_num_threads(threads)
    return results, pairs, teamed


# int8 at one row only: from 2 rows AVX2's 4-bit types take the integer panels, which keep
# their own threads (the team refuses such steps)
@pytest.mark.parametrize(
    ("streams", "activations"),
    [(1, "fp32"), (3, "fp32"), (1, "auto"), (3, "auto"), (1, "int8")],
    indirect=["activations"],
)
def test_team_steps_give_the_python_layers_logits_bit_for_bit(
    engine, model, monkeypatch, streams, activations
):
    """1-4 streams on two threads take the team path (a whole step in one parallel region,
    kernels/cpu/decode_team.h): every decode step, run first through the Python layers and then
    through the loop on the same inputs, gives the same logits bit for bit, and every one of
    them went through the team. SmolLM2's projections take the exact fused kernels under fp32,
    the fixed-point ones under `auto` (where the CPU has them), the integer dot products' row
    kernels under int8 (qdot_calls.c's qlinear_int_team: each thread quantizes x itself)."""
    prompts = [f"Count from {i} to {i + 5}:" for i in range(streams)]
    _, pairs, teamed = on_two_threads_both_paths(engine, model, monkeypatch, prompts, 8)
    assert len(pairs) == 7 and teamed == [True] * 7
    for python, looped in pairs:
        assert torch.equal(python, looped)


def test_long_contexts_stay_on_the_team(engine, model, monkeypatch) -> None:
    """A stream past a thousand keys (enough attention work that it is shared out by KV head:
    native.c's ATTENTION_SPLIT) still takes the team path, its attention's tasks shared by the
    team's threads, with the Python layers' logits bit for bit."""
    prompt = " ".join(f"Box {i} holds {i % 7} red balls." for i in range(120))
    prompts = [prompt + " How many boxes are there?"]
    (result,), pairs, teamed = on_two_threads_both_paths(engine, model, monkeypatch, prompts, 4)
    keys = result["meta_info"]["prompt_tokens"]
    heads, dim = model.config.num_heads, model.config.head_dim
    assert keys * heads * dim >= 1 << 19  # past the one-thread attention's limit
    assert len(pairs) == 3 and teamed == [True] * 3
    for python, looped in pairs:
        assert torch.equal(python, looped)
