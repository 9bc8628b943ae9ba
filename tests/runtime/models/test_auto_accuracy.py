"""The default `auto` mode on SmolLM2's real file at one row a matmul (its one stream), against
the exact mode (the session engine), teacher-forced over the exact mode's own greedy
continuations: where the CPU has AVX512-VNNI, `auto` runs the projections (Q4_1R) and the tied
head (Q8_0R) on the fixed-point integer kernels (kernels/cpu/quant_x24.c), whose rounding is
that of fp32's; on the AVX2 path (no AVX-512) the projections (Q4_1R) take the same fixed
point on AVX2's instructions (kernels/cpu/quant_x24_avx2.c). The model's choices must not
move."""

from __future__ import annotations

import pytest

from conftest import chat
from radixflow.bench.int8_accuracy import compare, forced
from radixflow.bench.quantized import PROMPTS
from radixflow.kernels.cpu import quant as native
from radixflow.kernels.quant import NAMES


@pytest.fixture(scope="module")
def auto_decode():
    """auto mode (the default), every prompt token in its own chunk: one-row matmuls"""
    from radixflow.runtime import Engine

    with Engine(
        model="smollm2", max_total_tokens=4096, kv_cache_dtype="fp32", chunked_prefill_size=1
    ) as eng:
        yield eng


def test_auto_mode_keeps_the_exact_modes_choices(engine, auto_decode) -> None:
    model = auto_decode._loaded.model
    x24 = native.isa() == "avx512" and native.set_int_isa(None) == "avx512-vnni"
    avx2 = native.isa() == "avx2"
    if x24:
        assert NAMES[model.quant_head.parts[0].qtype] == "Q8_0R"
    if x24 or avx2:
        assert NAMES[model.layers[0].qkv_proj.parts[0].qtype] == "Q4_1R"
    prompts = [chat(p) for p in PROMPTS[:2]]
    params = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
    engine.flush_cache()
    runs = engine.generate(prompts, params)
    encoded = [engine.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    sequences = [ids + r["output_ids"] for ids, r in zip(encoded, runs)]
    starts = [len(ids) - 1 for ids in encoded]
    figures = compare(forced(engine, sequences), forced(auto_decode, sequences), starts)
    assert figures["positions"] == 2 * 64
    assert figures["top1_agreement"] == 1.0, figures
    assert figures["logprob_err_max"] <= 2e-4, figures  # measured 0.0 (rounded to 1e-4)
    auto_decode.flush_cache()
    assert [r["output_ids"] for r in auto_decode.generate(prompts, params)] == [
        r["output_ids"] for r in runs
    ]
