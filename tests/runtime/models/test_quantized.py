"""SmolLM2's GGUF served from its quantized blocks: what is in memory, and that it computes
what the dequantize-to-fp32 reference computes (logits to 1e-4 of the largest, the same
greedy replies), through the Python layers and the compiled decode loop alike."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import pytest
import torch

from conftest import CHAT_PROMPTS, chat
from radixflow.kernels.cpu import quant as native
from radixflow.kernels.quant import NAMES
from radixflow.runtime.models import progress, quantized
from radixflow.runtime.models.layers import ForwardBatch
from radixflow.runtime.models.loader import builtin_gguf
from radixflow.runtime.models.quantized import (
    QuantEmbedding,
    QuantLinear,
    _x24_kernels,
    set_activations,
    weight_bytes,
)

GREEDY = {"max_new_tokens": 24, "temperature": 0}


@pytest.fixture(scope="module")
def reference():
    """The same file through the reference path: transformers dequantises it to fp32."""
    from radixflow.runtime import Engine

    with Engine(
        model="smollm2", dequantize_weights=True, cpu_matmul="linear", max_total_tokens=2048
    ) as eng:
        yield eng


def test_weights_stay_in_their_blocks(engine):
    model = engine._loaded.model
    layer = model.layers[0]
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        module = getattr(layer, name)
        assert isinstance(module, QuantLinear), name
        assert module.types == ["Q4_1"], (name, module.types)
    assert isinstance(model.embed_tokens, QuantEmbedding)
    assert NAMES[model.embed_tokens.weight_q.qtype] == "Q8_0"
    assert model.quant_head is not None and model.quant_head.types == ["Q8_0"]  # tied head
    file_size = builtin_gguf("smollm2").stat().st_size
    held = weight_bytes(model)
    # the file's tensors, each once (the tied head shares the embedding's blocks); the fp32
    # form would be 540 MB
    assert 0.9 * file_size < held < 1.02 * file_size, (held, file_size)


def test_a_mode_round_trip_keeps_the_tied_head_shared(engine):
    """Switching a model's activations to `auto` and back (as `Engine.with_config` does on
    shared weights) leaves the tied head on the embedding's own blocks: where `auto` holds
    the head repacked (Q8_0R, AVX512-VNNI's fixed-point kernels), going back shares the
    embedding's blocks again instead of unpacking a second copy of them."""
    model = engine._loaded.model
    try:
        set_activations(model, "auto")
        if _x24_kernels():
            assert NAMES[model.quant_head.parts[0].qtype] == "Q8_0R"
    finally:
        set_activations(model, "fp32")
    assert model.quant_head.parts[0] is model.embed_tokens.weight_q
    held = weight_bytes(model)
    assert held < 1.02 * builtin_gguf("smollm2").stat().st_size


def _batch(token_lists: list[list[int]]) -> ForwardBatch:
    ids = [t for tokens in token_lists for t in tokens]
    lengths = [len(t) for t in token_lists]
    indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return ForwardBatch(
        input_ids=torch.tensor(ids),
        positions=torch.tensor([p for n in lengths for p in range(n)]),
        out_slots=torch.arange(len(ids)),
        num_extend_tokens=len(ids),
        extend_qo_indptr=indptr,
        extend_kv_indptr=torch.zeros(len(lengths) + 1, dtype=torch.int64),
        extend_kv_indices=torch.zeros(0, dtype=torch.int64),
        decode_kv_indptr=torch.zeros(1, dtype=torch.int64),
        decode_kv_indices=torch.zeros(0, dtype=torch.int64),
        logit_rows=torch.arange(len(ids)),
    )


@pytest.mark.parametrize("prompts", [1, 3], ids=["one-prompt", "three-prompts"])
def test_logits_match_the_dequantized_reference(engine, reference, prompts):
    """Every position's logits of a prefill (many rows through every projection and the
    head), against the fp32 reference: within 1e-4 of the largest logit."""
    tokens = [engine.tokenizer.encode(chat(p)) for p in CHAT_PROMPTS[:prompts]]
    batch = _batch(tokens)
    outs = []
    for eng in (engine, reference):
        c = eng._loaded.model.config
        k = torch.zeros(c.num_layers, len(batch.input_ids), c.num_kv_heads, c.head_dim)
        outs.append(eng._loaded.model(batch, k, torch.zeros_like(k)))
    got, want = outs
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_projections_match_at_decode_sizes(engine, reference):
    """1 to 16 rows through each kind of projection and the head, against the reference's
    fp32 weights (the same file, dequantised by transformers + gguf)."""
    ours, theirs = engine._loaded.model, reference._loaded.model
    generator = torch.Generator().manual_seed(0)
    pairs = [
        (ours.layers[3].qkv_proj, theirs.layers[3].qkv_proj.weight),
        (ours.layers[3].down_proj, theirs.layers[3].down_proj.weight),
        (ours.quant_head, theirs.embed_tokens.weight),
    ]
    for rows in (1, 2, 3, 4, 7, 16):
        for module, weight in pairs:
            x = torch.randn(rows, weight.shape[1], generator=generator)
            want = x @ weight.T
            assert (module(x) - want).abs().max() <= 1e-4 * want.abs().max(), rows


def test_greedy_replies_equal_the_reference(engine, reference):
    prompts = [chat(p) for p in CHAT_PROMPTS]
    ours = engine.generate(prompts, sampling_params=GREEDY)
    theirs = reference.generate(prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in ours] == [o["output_ids"] for o in theirs]
    # one at a time: single rows, through the compiled decode loop where it is built
    for prompt, want in zip(prompts[:2], theirs[:2]):
        assert engine.generate(prompt, sampling_params=GREEDY)["output_ids"] == want["output_ids"]


def test_the_reference_path_is_plain_fp32(reference):
    model = reference._loaded.model
    assert type(model.layers[0].qkv_proj) is torch.nn.Linear
    assert Path(reference.model_info["model_path"], "model.safetensors").is_file()


def test_auto_takes_int8_batches_from_a_big_models_size(engine, monkeypatch):
    """`auto` resolves per model: SmolLM2 (1.3e8 weights) keeps it (its 32-block types
    exact at every row count); from BIG_MODEL_PARAMS weights it becomes "auto-big" (int8
    activations for calls of more than 4 rows: kernels test_qdot.py holds what that does).
    A small model's `auto`, where the x24 kernels run, holds the Q8_0 head as Q8_0R (the
    embedding keeps the file's blocks; `types` still names the file's); any other mode,
    Q8_0."""
    model = engine._loaded.model
    layers = quantized.quant_layers(model)
    before = {m.activations for m in layers}
    weights = sum(m.in_features * m.out_features for m in layers)
    x24 = native.isa() == "avx512" and native.set_int_isa(None) == "avx512-vnni"

    def head() -> str:
        return NAMES[model.quant_head.parts[0].qtype]

    try:
        quantized.set_activations(model, "auto")
        assert {m.activations for m in layers} == {"auto"}
        assert head() == ("Q8_0R" if x24 else "Q8_0") and model.quant_head.types == ["Q8_0"]
        assert NAMES[model.embed_tokens.weight_q.qtype] == "Q8_0"
        monkeypatch.setattr(quantized, "BIG_MODEL_PARAMS", weights)
        quantized.set_activations(model, "auto")
        assert {m.activations for m in layers} == {"auto-big"} and head() == "Q8_0"
        quantized.set_activations(model, "fp32")  # an explicit mode is kept whatever the size
        assert {m.activations for m in layers} == {"fp32"} and head() == "Q8_0"
    finally:
        (mode,) = before
        monkeypatch.undo()
        quantized.set_activations(model, mode)


def test_single_streams_take_the_compiled_decode_loop(engine, monkeypatch):
    """The compiled loop (kernels/cpu/decode_loop.cpp) calls the quantized kernel by its
    address; its replies are held to the reference above. Here: it is built and taken, a
    step at a time (decode runs take several: tests/runtime/scheduler/test_decode_runs.py)."""
    config = engine.scheduler.config.replace(num_continuous_decode_steps=1)
    monkeypatch.setattr(engine.scheduler, "config", config)
    model = engine._loaded.model
    loop = model.decode_loop
    assert loop is not None, "the decode loop was not built for the quantized model"
    taken: list[bool] = []

    class Counting:
        def run(self, *args):
            result = loop.run(*args)
            taken.append(result is not None)
            return result

    model.decode_loop = Counting()
    try:
        engine.generate(
            chat(CHAT_PROMPTS[0]), sampling_params={"max_new_tokens": 4, "temperature": 0}
        )
    finally:
        model.decode_loop = loop
    assert taken and all(taken), taken


def test_the_matmul_tuning_is_cached_per_machine_model_and_threads(
    engine, tmp_path, monkeypatch, caplog
):
    """choose_dense_rows times the kernel against dequantize + sgemm once, keeps the result
    under RADIXFLOW_CACHE, and a second start reads it without timing (and says so); another
    thread count is another key, timed again."""
    model = engine._loaded.model
    kept = [m.dense_from for m in quantized.quant_layers(model)]
    monkeypatch.setenv("RADIXFLOW_CACHE", str(tmp_path))
    timed: list[int] = []
    timing = quantized._time_dense_rows

    def counted(*args):
        timed.append(1)
        return timing(*args)

    monkeypatch.setattr(quantized, "_time_dense_rows", counted)
    load = [0.0]  # a quiet machine; then one busier than its cores
    monkeypatch.setattr(quantized.os, "getloadavg", lambda: (load[0], 0.0, 0.0))
    try:
        with caplog.at_level(logging.INFO, logger="radixflow"):
            load[0] = 4.0 * (os.cpu_count() or 1)
            quantized.choose_dense_rows(model, rounds=1)
            assert not (tmp_path / "tuning.json").exists()  # a busy machine's timing: not kept
            assert any("for this start only" in r.getMessage() for r in caplog.records)
            load[0], timed[:] = 0.0, []
            first = quantized.choose_dense_rows(model, rounds=1)
            second = quantized.choose_dense_rows(model, rounds=1)
        assert timed == [1] and first == second  # the quiet timing kept, then read
        assert (tmp_path / "tuning.json").is_file()
        assert any("tuning quantized matmuls" in r.getMessage() for r in caplog.records)
        assert any("the tuning cached for this machine" in r.getMessage() for r in caplog.records)
        threads = torch.get_num_threads()
        torch.set_num_threads(1 if threads > 1 else 2)
        try:
            quantized.choose_dense_rows(model, rounds=1)
        finally:
            torch.set_num_threads(threads)
        assert timed == [1, 1]
    finally:
        for m, rows in zip(quantized.quant_layers(model), kept):
            m.dense_from = rows


def test_startup_steps_say_what_they_do_in_plain_lines(caplog, monkeypatch):
    """Off a terminal a step logs when it starts, while it runs, and when it ends."""
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    with caplog.at_level(logging.INFO, logger="radixflow.startup"):
        with progress.Progress("reading the weights", total=4, unit="tensors") as bar:
            for _ in range(4):
                bar.update()
            bar.start -= 2  # as if it took two seconds
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "reading the weights ..."
    assert "reading the weights: 0 s so far (25%)" in lines[1]
    assert re.fullmatch(r"reading the weights: done in 2\.\d s", lines[-1])
