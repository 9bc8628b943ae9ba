"""Hugging Face checkpoints onto the quantized kernels: 4-bit AWQ and GPTQ checkpoints as they
are stored, and `--quantization int8` for any fp32/bf16 checkpoint.

- AWQ (`quant_method: awq`, GEMM layout): per projection `qweight` int32 (in, out / 8) with
  eight output columns to a word in the order 0 2 4 6 1 3 5 7, `qzeros` packed alike
  (in / group, out / 8), `scales` fp16 (in / group, out); w = (q - z) * s.
- GPTQ (`quant_method: gptq`, the v1 format most checkpoints use): `qweight` int32
  (in / 8, out) with eight consecutive input rows to a word, `qzeros` (in / group, out / 8)
  holding z - 1, `scales` fp16 (in / group, out), `g_idx` the group of each input row
  (activation order, `desc_act`, is refused: its groups are not contiguous).
- Both become `Q4G128` weights (`radixflow.kernels.quant.from_groups`: d = s, m = -z * s in
  fp32, so d * q + m equals (q - z) * s bit for bit). 4 bits and groups of 128 only, the
  common form; anything else is refused by name.
- int8: each projection and the LM head are quantized at load, per output channel (absmax /
  127, rounded to nearest). The embedding stays in the checkpoint's precision.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from radixflow.kernels import quant
from radixflow.runtime.models import UnsupportedModelError
from radixflow.runtime.models.quantized import QuantLinear

log = logging.getLogger(__name__)
METHODS = ("awq", "gptq")
AWQ_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)  # output column j of a word sits in nibble AWQ_COLUMN[j]
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def quant_method(hf_config: Any) -> str:
    """'' for a plain checkpoint, else the supported method its quantization_config names;
    raises UnsupportedModelError for any other method or layout."""
    qc = getattr(hf_config, "quantization_config", None)
    if not qc:
        return ""
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        raise UnsupportedModelError(
            f"quantization_config quant_method {method!r} is not supported (supported: "
            f"{', '.join(METHODS)} with 4 bits and group size 128; GGUF files; --quantization int8)"
        )
    bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
    if bits != 4 or group != 128:
        raise UnsupportedModelError(f"{method} with {bits} bits, group size {group}: only 4, 128")
    if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        raise UnsupportedModelError(f"AWQ version {qc.get('version')!r}: only the GEMM layout")
    if method == "gptq" and qc.get("desc_act"):
        raise UnsupportedModelError("GPTQ with desc_act (activation order) is not supported")
    if method == "gptq" and str(qc.get("checkpoint_format", "gptq")) != "gptq":
        raise UnsupportedModelError(f"GPTQ checkpoint_format {qc.get('checkpoint_format')!r}")
    return method


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 (..., W) -> the eight 4-bit fields of each word, low first: (..., W * 8) uint8."""
    fields = (words.to(torch.int32)[..., None] >> SHIFTS) & 15
    return fields.reshape(*words.shape[:-1], -1).to(torch.uint8)


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's column-packed int32 (rows, out / 8) -> (rows, out) in column order."""
    fields = _nibbles(packed).reshape(packed.shape[0], -1, 8)
    return fields[:, :, list(AWQ_COLUMN)].reshape(packed.shape[0], -1)


def from_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> quant.QuantWeight:
    q = _awq_columns(qweight).T  # (out, in)
    zeros = _awq_columns(qzeros).T  # (out, in / group)
    return quant.from_groups(q.contiguous(), scales.T.contiguous(), zeros.contiguous())


def from_gptq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None
) -> quant.QuantWeight:
    rows = qweight.shape[0] * 8
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(rows) // 128):
        raise UnsupportedModelError("GPTQ g_idx out of order (activation order) is not supported")
    q = _nibbles(qweight.T.contiguous())  # (out, in): eight consecutive input rows per word
    zeros = (_nibbles(qzeros).to(torch.int16) + 1).T  # (out, in / group), stored as z - 1
    return quant.from_groups(q.contiguous(), scales.T.contiguous(), zeros.contiguous())


def convert_state(state: dict[str, torch.Tensor], method: str) -> dict[str, Any]:
    """A checkpoint's tensors with each quantized projection's packed tensors replaced by one
    QuantWeight under `<prefix>.weight`; the rest as fp32."""
    out: dict[str, Any] = {}
    prefixes = [name.removesuffix(".qweight") for name in state if name.endswith(".qweight")]
    for prefix in prefixes:
        qweight, qzeros, scales = (
            state.pop(f"{prefix}.{k}") for k in ("qweight", "qzeros", "scales")
        )
        g_idx = state.pop(f"{prefix}.g_idx", None)
        if method == "awq":
            out[f"{prefix}.weight"] = from_awq(qweight, qzeros, scales)
        else:
            out[f"{prefix}.weight"] = from_gptq(qweight, qzeros, scales, g_idx)
    for name, value in state.items():
        out[name] = value.float() if value.is_floating_point() else value
    return out


def quantize_int8(model: nn.Module) -> int:
    """Replace every projection (and the LM head) of a loaded fp32 model by an int8 QuantLinear,
    per output channel; -> bytes of weights freed."""
    freed = 0
    for layer in model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            linear = getattr(layer, name)
            weight = linear.weight.detach()
            bias = None if linear.bias is None else linear.bias.detach()
            setattr(layer, name, QuantLinear([quant.quantize(weight, quant.I8)], bias))
            freed += weight.numel() * (weight.element_size() - 1)
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    model.quant_head = QuantLinear([quant.quantize(head.detach(), quant.I8)])
    if model.lm_head is not None:
        model.lm_head = model.quant_head
    log.info(
        "--quantization int8: projections and head in int8 per channel (%.1f MiB freed)",
        freed / 2**20,
    )
    return freed
