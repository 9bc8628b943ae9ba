"""Every family the loader serves, read from a GGUF laid out as llama.cpp writes one
(tests/gguf_models.py) with its matrices kept in their quantized blocks: the projections hold
the types written, greedy output equals transformers' own GGUF loader token for token, and
the logits of a prefill batch and of a single-row decode are within 1e-4 of the largest
logit of the dequantize-to-fp32 reference path (`--dequantize-weights`).

The default run reads one type per family and one Llama file holding every kept type (a
Q4_K_M-style mix: fused projections over ranges of different types) plus Q2_K and Q3_K
matrices, which are dequantized at load with a log line; `-m slow` runs every family in
every type."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from family_models import one_thread, tiny_tokenizer
from gguf_models import GGUF_FAMILIES, KEPT_TYPES, build_model, write_gguf
from torch import nn

from radixflow.kernels.cpu import decode_loop
from radixflow.kernels.cpu import quant as native_quant
from radixflow.kernels.quant import NAMES
from radixflow.runtime import Engine
from radixflow.runtime.config import ServerConfig
from radixflow.runtime.model_executor.model_runner import load_model
from radixflow.runtime.models import gguf_file
from radixflow.runtime.models.layers import CausalLM, ForwardBatch
from radixflow.runtime.models.loader import load_hf_config, resolve_model_dir
from radixflow.runtime.models.quantized import QuantEmbedding, QuantLinear, quant_layers

TOLERANCE = 1e-4  # of the largest logit
PARAMS = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
PROMPTS = [
    np.random.default_rng(seed).integers(0, 256, n).tolist()
    for seed, n in [(1, 30), (2, 21), (3, 9)]
]
REPRESENTATIVE = {"llama": "MIXED", "mistral": "Q5_1", "qwen2": "Q4_1", "qwen3": "Q5_K",
                  "phi3": "Q6_K", "gemma2": "Q8_0", "gemma3": "Q5_0"}  # fmt: skip
MIXED = {  # every kept type once, Q2_K and Q3_K beside them; Llama: q/k rows permuted
    "token_embd": "Q6_K", "output": "BF16",
    "blk.0.attn_q": "Q4_0", "blk.0.attn_k": "Q4_1", "blk.0.attn_v": "Q5_0",
    "blk.0.attn_output": "Q5_1", "blk.0.ffn_gate": "Q8_0", "blk.0.ffn_up": "Q8_0",
    "blk.0.ffn_down": "Q4_K", "blk.1.attn_q": "Q5_K", "blk.1.attn_k": "Q5_K",
    "blk.1.attn_v": "Q6_K", "blk.1.attn_output": "F16", "blk.1.ffn_gate": "Q2_K",
    "blk.1.ffn_up": "Q4_K", "blk.1.ffn_down": "Q3_K",
}  # fmt: skip
DEQUANTIZED_AT_LOAD = ("Q2_K", "Q3_K")
PROJECTIONS = {  # our module -> the GGUF tensors it is made of (Phi-3 stores them fused)
    "qkv_proj": (("attn_q", "attn_k", "attn_v"), ("attn_qkv",)),
    "o_proj": (("attn_output",),),
    "gate_up_proj": (("ffn_gate", "ffn_up"), ("ffn_up",)),
    "down_proj": (("ffn_down",),),
}
CASES = [
    pytest.param(family, name, marks=() if name == REPRESENTATIVE[family] else pytest.mark.slow)
    for family in GGUF_FAMILIES
    for name in (*KEPT_TYPES, "MIXED")
]


@pytest.fixture(scope="module", autouse=True)
def radixflow_cache(tmp_path_factory):
    """The GGUFs' converted directories in this module's own cache. The native kernels and
    the compiled decode loop are built (or found) in the suite's cache first: built in a
    fresh directory they would cost minutes on every run."""
    native_quant.library()
    decode_loop.extension()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RADIXFLOW_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


def _t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def prefill_and_decode(model: CausalLM) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts prefilled in one batch, every row's logits (rows, vocab); then one decode
    row continuing the first prompt, alone in its step (1, vocab)."""
    cfg = model.config
    k = torch.zeros(cfg.num_layers, 64, cfg.num_kv_heads, cfg.head_dim)
    v = torch.zeros_like(k)
    a, b = PROMPTS[0], PROMPTS[1]
    n = len(a) + len(b)
    prefill = model(
        ForwardBatch(
            _t(a + b), _t([*range(len(a)), *range(len(b))]), _t(list(range(n))), n,
            _t([0, len(a), n]), _t([0, 0, 0]), _t([]), _t([0]), _t([]), _t(list(range(n))),
        ),
        k, v,
    )  # fmt: skip
    decode = model(
        ForwardBatch(
            _t([PROMPTS[2][0]]), _t([len(a)]), _t([n]), 0, _t([0]), _t([0]), _t([]),
            _t([0, len(a) + 1]), _t([*range(len(a)), n]), _t([0]),
        ),
        k, v,
    )  # fmt: skip
    return prefill, decode


def _expected_types(written: dict[str, str], layer: int, module: str) -> list[str]:
    """The types a projection holds: its tensors' in order, neighbours of one type joined,
    a type without a kernel as the fp32 it was dequantized to."""
    for names in PROJECTIONS[module]:
        found = [f"blk.{layer}.{name}.weight" for name in names]
        if all(name in written for name in found):
            types = ["F32" if written[n] in DEQUANTIZED_AT_LOAD else written[n] for n in found]
            return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]
    raise AssertionError(f"layer {layer} {module}: none of {PROJECTIONS[module]} written")


def check_types(model: CausalLM, written: dict[str, str]) -> None:
    """Every projection, the embedding and the head hold the blocks written."""
    for i, layer in enumerate(model.layers):
        for module in PROJECTIONS:
            want = _expected_types(written, i, module)
            got = getattr(layer, module)
            if want == ["F32"]:  # dequantized at load: a plain (maybe packed) fp32 layer
                assert not isinstance(got, QuantLinear), (i, module, got.types)
            else:
                assert isinstance(got, QuantLinear) and got.types == want, (i, module, want)
    assert isinstance(model.embed_tokens, QuantEmbedding)
    assert model.embed_tokens.weight_q.name == written["token_embd.weight"]
    head = written.get("output.weight", written["token_embd.weight"])  # tied: the embedding
    assert model.quant_head is not None and model.quant_head.types == [head]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


def _transformers_model(path: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def _fp32_reference(family: str, path: Path, source: nn.Module) -> CausalLM:
    """The dequantize-to-fp32 path on the same file. transformers' GGUF loader has no
    tensor-name table for `mistral` (gguf names no such architecture), so it cannot
    dequantize a Mistral file: there the reference is the fp32 checkpoint of the source
    model, which holds exactly the file's values."""
    if family == "mistral":
        source.save_pretrained(path.parent / "mistral-fp32")
        tiny_tokenizer().save_pretrained(path.parent / "mistral-fp32")
        model_dir, config = path.parent / "mistral-fp32", ServerConfig()
    else:
        model_dir, config = resolve_model_dir(str(path)), ServerConfig(dequantize_weights=True)
    return load_model(model_dir, config, torch.device("cpu"), torch.float32)


def _serve(path: Path, written: dict[str, str]) -> tuple[list[list[int]], ...]:
    """Load `path` through the Engine, check its blocks, and run it: -> (greedy output ids of
    PROMPTS, prefill logits through the kernel, the same dequantized into sgemm, decode)."""
    # auto's fp16 pool rounds KV, the default int8 activations round x
    exact = {"max_total_tokens": 256, "kv_cache_dtype": "fp32", "quantized_activations": "fp32"}
    with Engine(model_path=str(path), device="cpu", **exact) as engine:
        model = engine._loaded.model
        check_types(model, written)
        outs = engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
        with torch.no_grad():
            for layer in quant_layers(model):  # every row count through the kernel
                layer.dense_from = 0
            prefill, decode = prefill_and_decode(model)
            for layer in quant_layers(model):  # and prefill dequantized into sgemm
                layer.dense_from = 1
            dense, _ = prefill_and_decode(model)
    return [out["output_ids"] for out in outs], prefill, dense, decode


@pytest.mark.parametrize(("family", "type_name"), CASES)
def test_gguf_kept_quantized_matches(root, caplog, family, type_name):
    path = root / f"{family}-{type_name}.gguf"
    source = build_model(family)
    if type_name == "MIXED":  # a family's tensors MIXED does not name (Phi-3's fused): Q4_0
        written = write_gguf(path, source, "Q4_0", MIXED)
    else:
        written = write_gguf(path, source, type_name)
    with one_thread(), caplog.at_level(logging.WARNING, "radixflow.runtime.models.gguf_file"):
        outs, prefill, dense, decode = _serve(path, written)
        reference = source if family == "mistral" else _transformers_model(path)
        if family != "mistral":  # transformers reads the file back as the source model
            state = reference.state_dict()
            for name, value in source.state_dict().items():
                assert torch.equal(state[name], value), name
            with torch.no_grad():
                want, got = (m(torch.tensor([PROMPTS[0]])).logits for m in (source, reference))
            assert (got - want).abs().max() <= TOLERANCE * want.abs().max(), "config"
        reference.generation_config.eos_token_id = None
        with torch.no_grad():
            for prompt, got in zip(PROMPTS, outs):
                want = reference.generate(
                    torch.tensor([prompt]), max_new_tokens=12, do_sample=False
                )
                assert got == want[0, len(prompt) :].tolist(), f"{family} {type_name}: greedy"
            want_prefill, want_decode = prefill_and_decode(_fp32_reference(family, path, source))
    for step, got, want in [
        ("prefill", prefill, want_prefill),
        ("prefill dequantized", dense, want_prefill),
        ("decode", decode, want_decode),
    ]:
        err = (got - want).abs().max().item()
        bound = TOLERANCE * want.abs().max().item()
        assert err <= bound, f"{family} {type_name} {step}: max abs logit error {err} > {bound}"
    fallback = sorted({t for t in written.values() if t in DEQUANTIZED_AT_LOAD})
    logged = [r.getMessage() for r in caplog.records if "no quantized kernel" in r.getMessage()]
    assert [t for t in fallback if not any(f" {t} matrices" in m for m in logged)] == [], logged
    assert len(logged) == len(fallback), logged


def test_rope_factor_tensors_are_not_weights(root):
    """llama.cpp writes Llama 3's rope frequencies (`rope_freqs`) and Phi-3's LongRoPE factors
    as tensors of the file; the rope comes from the config, as in transformers' GGUF loader,
    so the file reads as its weights alone."""
    source = build_model("llama")
    path = root / "llama-rope-freqs.gguf"
    write_gguf(path, source, "Q8_0", extra={"rope_freqs.weight": np.ones(32, np.float32)})
    state = gguf_file.read_state(path, load_hf_config(resolve_model_dir(str(path))))
    assert sorted(state) == sorted(source.state_dict())


def test_q8_0_weights_under_auto_take_the_x24_kernels(root, monkeypatch):
    """A small Q8_0 Llama under the default `auto`, where the x24 kernels run (AVX512-VNNI):
    its projections and head held as Q8_0R, decode steps through the compiled loop's team on
    two threads (rf_qteam_takes admits Q8_0R there), and the greedy output the exact mode's."""
    if native_quant.isa() != "avx512" or native_quant.set_int_isa(None) != "avx512-vnni":
        pytest.skip("no AVX512-VNNI here: auto keeps Q8_0")
    path = root / "llama-q8_0-auto.gguf"
    write_gguf(path, build_model("llama"), "Q8_0")
    outs = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for mode in ("fp32", "auto"):
            with Engine(model_path=str(path), device="cpu", max_total_tokens=256,
                        kv_cache_dtype="fp32", quantized_activations=mode) as engine:  # fmt: skip
                model = engine._loaded.model
                monkeypatch.setattr(engine.scheduler.runner, "governor", None)
                kept = {NAMES[p.qtype] for m in quant_layers(model) for p in m.parts}
                assert kept == ({"Q8_0R"} if mode == "auto" else {"Q8_0"}), kept
                teamed: list[bool] = []
                loop = model.decode_loop
                if mode == "auto" and loop is not None:
                    layers = loop.ext.decode_layers

                    def recording(*args, layers=layers, teamed=teamed):
                        out = layers(*args)
                        teamed.append(out[3])
                        return out

                    monkeypatch.setattr(loop.ext, "decode_layers", recording)
                outs[mode] = [
                    o["output_ids"]
                    for o in engine.generate(input_ids=PROMPTS[:1], sampling_params=PARAMS)
                ]
                if mode == "auto" and loop is not None:
                    assert teamed and all(teamed), teamed
                monkeypatch.undo()
    finally:
        torch.set_num_threads(threads)
    assert outs["auto"] == outs["fp32"]


def test_joined_projections_are_read_into_their_place(root):
    """q, k, v (permuted back as read) and gate, up of one block type are read straight into
    the rows of the matrix they join (runtime/models/joined.py): the model's joined weight
    is that memory, not a copy, and holds the file's rows in the model's order."""
    from radixflow.runtime.models import quantized

    source = build_model("llama")
    path = root / "llama-joined.gguf"
    write_gguf(path, source, "Q8_0")
    state = gguf_file.read_state(path, load_hf_config(resolve_model_dir(str(path))))
    q, k, v = (state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    gate, up = (state[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up"))
    for group in ((q, k, v), (gate, up)):
        assert group[0].data._base is not None
        assert all(p.data._base is group[0].data._base for p in group)
    qkv = quantized.QuantLinear([q, k, v])
    assert len(qkv.parts) == 1 and qkv.parts[0].data.data_ptr() == q.data.data_ptr()
    expected = torch.cat([source.model.layers[0].self_attn.q_proj.weight,
                          source.model.layers[0].self_attn.k_proj.weight,
                          source.model.layers[0].self_attn.v_proj.weight])  # fmt: skip
    got = quantized.QuantLinear([q, k, v])(torch.eye(expected.shape[1])).T
    assert (got - expected).abs().max() <= 0.02 * expected.abs().max()
