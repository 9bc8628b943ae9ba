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


def test_smollm2_qualifies(model) -> None:
    loop = model.decode_loop
    # four projections a layer, each its quantized ranges (SmolLM2 loads from its GGUF blocks)
    assert loop is not None and len(loop.weights[2]) == 4 * model.config.num_layers
    assert all(meta for meta in loop.weights[3])


def test_decode_steps_give_the_python_layers_logits_bit_for_bit(engine, model, monkeypatch):
    """Five streams decoded with the loop and without: every step's logits are equal bit for
    bit (the same kernels on the same inputs in the same order), so are the tokens, and every
    decode step went through the loop."""
    loop = model.decode_loop
    logits: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    forward, use = type(model).forward, [True]

    def recorded(self, batch, *args):
        out = forward(self, batch, *args)
        if not batch.num_extend_tokens:
            logits[use[0]].append(out.clone())
        return out

    monkeypatch.setattr(type(model), "forward", recorded)
    calls = counted(monkeypatch, loop)
    prompts = [f"Describe the number {i} in one line:" for i in range(5)]
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    engine.flush_cache()
    tokens = [r["output_ids"] for r in engine.generate(prompts, params)]
    assert calls and all(rows == len(prompts) for rows in calls)  # 9 decode steps of 5 rows
    use[0] = False
    monkeypatch.setattr(model, "decode_loop", None)
    engine.flush_cache()
    assert [r["output_ids"] for r in engine.generate(prompts, params)] == tokens
    assert len(logits[True]) == len(logits[False]) == len(calls)
    for a, b in zip(logits[True], logits[False]):
        assert torch.equal(a, b)


def test_shared_prefixes_decline_to_python(engine, model, monkeypatch) -> None:
    """Streams behind a shared cached prefix need the shared runs merged, which the loop does
    not do: those steps run in Python, with the same tokens as with the loop off."""
    calls = counted(monkeypatch, model.decode_loop)
    shared = "You are a careful assistant. Answer in one short sentence, please. " * 8
    prompts = [shared + f"What is {i} plus {i}?" for i in range(3)]
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    engine.flush_cache()
    engine.generate(prompts[0], params)  # caches the prefix
    got = [r["output_ids"] for r in engine.generate(prompts, params)]
    assert None in calls
    monkeypatch.setattr(model, "decode_loop", None)
    engine.flush_cache()
    engine.generate(prompts[0], params)
    assert [r["output_ids"] for r in engine.generate(prompts, params)] == got


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
