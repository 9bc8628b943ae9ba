"""Hugging Face checkpoints on the quantized kernels: 4-bit AWQ and GPTQ checkpoints read as
stored (packed by this test from the formats' published layouts), and --quantization int8.
Each is held against a plain fp32 checkpoint of the same weights (the dequantized values):
logits within 1e-4 of the largest, the same greedy tokens."""

from __future__ import annotations

import json

import pytest
import torch
from family_models import one_thread, save_family
from safetensors.torch import save_file

from radixflow.kernels import quant
from radixflow.runtime import Engine
from radixflow.runtime.models import UnsupportedModelError
from radixflow.runtime.models.quantized import QuantLinear

SIZE = dict(hidden_size=128, intermediate_size=256, head_dim=32)  # in-dims: groups of 128
GROUP = 128
PARAMS = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
PROMPTS = [list(range(40, 60)), list(range(100, 131))]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i]


def _groups(weight: torch.Tensor):
    """Asymmetric 4-bit groups of 128 along the input: q (out, in), scales and zeros
    (out, in / 128), fp16 scales as the formats store them."""
    out, k = weight.shape
    w = weight.reshape(out, k // GROUP, GROUP)
    low, high = w.amin(-1), w.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-4).half()
    zero = torch.round(-low / scale.float()).clamp(0, 15)
    q = torch.clamp(torch.round(w / scale.float()[..., None]) + zero[..., None], 0, 15)
    return q.reshape(out, k).to(torch.int32), scale, zero.to(torch.int32)


def _pack_rows(values: torch.Tensor) -> torch.Tensor:
    """(rows, cols) 0..15 -> int32 (rows / 8, cols): eight consecutive rows to a word."""
    v = values.reshape(values.shape[0] // 8, 8, values.shape[1])
    return sum(v[:, i] << (4 * i) for i in range(8)).to(torch.int32)


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    """(rows, cols) 0..15 -> int32 (rows, cols / 8), AWQ's column order inside a word."""
    v = values.reshape(values.shape[0], values.shape[1] // 8, 8)
    return sum(v[:, :, AWQ_ORDER[i]] << (4 * i) for i in range(8)).to(torch.int32)


def _write_quantized(root, method: str):
    """A tiny Llama as an AWQ or GPTQ checkpoint, and the same dequantized weights as a plain
    fp32 checkpoint: (quantized dir, plain dir)."""
    plain, hf = save_family("llama", root, f"{method}-plain", **SIZE)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    packed: dict[str, torch.Tensor] = {}
    for name, weight in list(state.items()):
        if not name.endswith("proj.weight"):
            continue
        q, scale, zero = _groups(weight.float())
        prefix = name.removesuffix(".weight")
        state[name] = (q - zero.repeat_interleave(GROUP, 1)) * scale.float().repeat_interleave(
            GROUP, 1
        )
        if method == "awq":
            packed[f"{prefix}.qweight"] = _pack_awq(q.T.contiguous())
            packed[f"{prefix}.qzeros"] = _pack_awq(zero.T.contiguous())
        else:
            packed[f"{prefix}.qweight"] = _pack_rows(q.T.contiguous())
            packed[f"{prefix}.qzeros"] = _pack_columns(zero.T.contiguous() - 1)
            packed[f"{prefix}.g_idx"] = torch.arange(weight.shape[1], dtype=torch.int32) // GROUP
        packed[f"{prefix}.scales"] = scale.T.contiguous()
    rest = {k: v.contiguous() for k, v in state.items() if not k.endswith("proj.weight")}
    save_file({k: v.contiguous() for k, v in state.items()}, str(plain / "model.safetensors"))
    quantized = root / method
    quantized.mkdir()
    for file in plain.iterdir():
        if file.name not in ("model.safetensors", "config.json"):
            (quantized / file.name).write_bytes(file.read_bytes())
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = (
        {
            "quant_method": "awq",
            "bits": 4,
            "group_size": GROUP,
            "zero_point": True,
            "version": "gemm",
        }
        if method == "awq"
        else {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": GROUP,
            "desc_act": False,
            "sym": False,
        }
    )
    (quantized / "config.json").write_text(json.dumps(config))
    save_file({**rest, **packed}, str(quantized / "model.safetensors"))
    return quantized, plain


def _pack_columns(values: torch.Tensor) -> torch.Tensor:
    """GPTQ's zeros: (groups, cols) -> int32 (groups, cols / 8), eight consecutive columns to
    a word in order."""
    v = values.reshape(values.shape[0], values.shape[1] // 8, 8)
    return sum((v[:, :, i] & 15) << (4 * i) for i in range(8)).to(torch.int32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    with one_thread():
        yield {m: _write_quantized(root, m) for m in ("awq", "gptq")}


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_4bit_checkpoint_is_served_from_its_groups(checkpoints, method):
    quantized, plain = checkpoints[method]
    with Engine(model_path=str(quantized), device="cpu", max_total_tokens=512) as engine:
        model = engine._loaded.model
        proj = model.layers[0].qkv_proj
        assert isinstance(proj, QuantLinear) and proj.types == ["Q4G128"]
        got = [engine.generate(input_ids=p, sampling_params=PARAMS)["output_ids"] for p in PROMPTS]
        with Engine(model_path=str(plain), device="cpu", max_total_tokens=512) as reference:
            want = [
                reference.generate(input_ids=p, sampling_params=PARAMS)["output_ids"]
                for p in PROMPTS
            ]
            generator = torch.Generator().manual_seed(1)
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                plain_proj = getattr(reference._loaded.model.layers[1], name)
                x = torch.randn(5, plain_proj.weight.shape[1], generator=generator)
                ours = getattr(model.layers[1], name)(x)
                theirs = torch.nn.functional.linear(x, plain_proj.weight, plain_proj.bias)
                assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max(), name
    assert got == want


def test_int8_quantizes_every_projection_and_the_head(checkpoints):
    _, plain = checkpoints["awq"]
    with Engine(
        model_path=str(plain), device="cpu", max_total_tokens=512, quantization="int8"
    ) as engine:
        model = engine._loaded.model
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            assert getattr(model.layers[0], name).types == ["I8"]
        assert model.quant_head is not None and model.quant_head.types == ["I8"]
        # exact against its own dequantized weights, and close to the fp32 model
        proj = model.layers[0].gate_up_proj
        x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
        want = torch.nn.functional.linear(x, quant.dequantize(proj.parts[0]), proj.bias)
        assert (proj(x) - want).abs().max() <= 1e-4 * want.abs().max()
        got = [engine.generate(input_ids=p, sampling_params=PARAMS)["output_ids"] for p in PROMPTS]
    assert all(len(g) == PARAMS["max_new_tokens"] for g in got)


def test_other_quantization_methods_are_refused_by_name(tmp_path):
    with one_thread():
        plain, _ = save_family("llama", tmp_path, "fp8", **SIZE)
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (plain / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="quant_method 'fp8'"):
        Engine(model_path=str(plain), device="cpu", max_total_tokens=256)
