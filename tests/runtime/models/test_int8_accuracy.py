"""The default int8 mode of quantized matmuls on SmolLM2's real file, against the exact mode
(the session engine: fp32 activations, within 1e-4 of the dequantized reference), teacher-
forced over the exact mode's own greedy continuations (bench/int8_accuracy.py's measure).

Held to what llama.cpp's own 8-bit path shows against the same reference on the same file
(docs/models.md, "Accuracy of the int8 mode": 97.85% top-1 agreement, mean |log-prob error|
0.028, max 0.26 over 1,024 generated positions; radixflow 96.97%, 0.028, 0.24), with a
margin for this shorter sample."""

from __future__ import annotations

import pytest

from conftest import chat
from radixflow.bench.int8_accuracy import compare, forced
from radixflow.bench.quantized import PROMPTS


@pytest.fixture(scope="module")
def int8_decode():
    """int8 mode, every prompt token in its own chunk: each matmul has one row, as in decode
    (the one-row integer dot products)."""
    from radixflow.runtime import Engine

    with Engine(
        model="smollm2",
        max_total_tokens=4096,
        kv_cache_dtype="fp32",
        chunked_prefill_size=1,
        quantized_activations="int8",
    ) as eng:
        yield eng


def test_int8_mode_tracks_the_exact_mode(engine, int8_decode) -> None:
    prompts = [chat(p) for p in PROMPTS[:3]]
    params = {"max_new_tokens": 96, "temperature": 0, "ignore_eos": True}
    engine.flush_cache()
    runs = engine.generate(prompts, params)
    encoded = [engine.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    sequences = [ids + r["output_ids"] for ids, r in zip(encoded, runs)]
    starts = [len(ids) - 1 for ids in encoded]
    figures = compare(forced(engine, sequences), forced(int8_decode, sequences), starts)
    assert figures["positions"] == 3 * 96
    assert figures["top1_agreement"] >= 0.95, figures
    assert figures["logprob_err_mean"] <= 0.04, figures
    assert figures["logprob_err_max"] <= 0.5, figures
    assert figures["logprob_err_mean"] > 1e-4, "the int8 path did not run: no rounding at all"
