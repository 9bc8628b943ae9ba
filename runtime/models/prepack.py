"""fp32 and bf16 CPU weights prepacked once for the fastest gemm this machine has.

`F.linear` hands MKL the weight as it is stored, and MKL repacks it into its blocked layout
on every call. At decode sizes (a few to a few hundred rows) that repacking is a large share
of each matmul. `prepack` packs each projection and the LM head once, after loading, in one
of two layouts:

- **onednn**: oneDNN's blocked layout (`mkldnn._reorder_linear_weight`), multiplied by
  `mkldnn._linear_pointwise`. oneDNN picks its kernels by the CPU's instruction sets, not
  its vendor: on this project's AMD EPYC (AVX-512) a 64-row step of SmolLM2's matmuls took
  0.57x F.linear's time (173 against 113 GFLOP/s), 4 rows 0.36x and 1 row 0.6x.
- **mkl**: MKL's packed layout (`mkl._mkl_reorder_linear_weight`), multiplied by
  `mkl._mkl_linear`. On this project's Xeon it took 0.7-0.8x F.linear's time at 64 rows;
  on the AMD EPYC, 0.9-1.1x (MKL's AMD path does not use AVX-512).

`auto` (the default) times F.linear and both layouts on the model's own first-layer weights
and LM head at DECODE_ROWS rows and keeps the fastest (a layout must beat the one before it
in `WAYS` by MARGIN, so that noise does not flip the choice between runs); then, at one row,
whether the pack or F.linear serves single streams. The choice is made once per process for
a set of shapes (`_CHOICES`), so engines of one model in one process multiply alike.

- Both packed layouts serve any number of rows (they are sized from the weight alone; each
  call passes its own row count). A check at pack time compares the chosen layout with
  F.linear on a few row counts and falls back to F.linear if they disagree.
- The plain weights stay (tensor-parallel sharding, tests and the loader read them), so the
  packed copies cost one more copy of the projection and head weights in memory, paid before
  the KV pool is sized from what is left.
- Results match `F.linear` to fp32 rounding (about 1e-6), not bit for bit.
- bf16 weights (`--dtype bfloat16`) pack for oneDNN only (MKL packs fp32), which multiplies
  them with fp32 accumulation, with AVX512-BF16 instructions where the CPU has them. On this
  project's AMD EPYC (AVX512-BF16; 1 thread, the machine loaded), SmolLM2's projections and
  head took 17-24 ms at 1 row against 42-53 ms for fp32's pack, 68-85 ms at 64 rows against
  170-180 ms, and 0.36-0.73x F.linear's bf16 time.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)
WAYS = ("linear", "mkl", "onednn")  # later ways must win by MARGIN to be chosen
MARGIN = 0.9  # a way is chosen over an earlier one below this share of its time
DECODE_ROWS = 64  # rows of the calibration (and the row count the layouts are packed for)
PACKED_MIN_ROWS = 4  # default: fewer rows go through F.linear (MKL's matrix-vector path)
_CHOICES: dict[tuple[object, ...], tuple[str, int]] = {}  # shapes -> (way, min_rows)


@dataclass(frozen=True)
class Packed:
    """A weight's packed copy in `way`'s layout ("onednn" or "mkl"; torch holds both as
    opaque mkldnn tensors), used for calls of at least `min_rows` rows (fewer go through
    F.linear)."""

    tensor: torch.Tensor
    way: str
    min_rows: int = PACKED_MIN_ROWS


def available_ways(device: torch.device, dtype: torch.dtype) -> list[str]:
    """The packed layouts this torch offers for `dtype` on `device`: fp32 on a CPU build with
    MKL (x86) and oneDNN; bf16 with oneDNN where it supports bf16 on this CPU."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return []
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return []
    ways = []
    mkl = torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    if mkl and dtype == torch.float32:
        ways.append("mkl")
    onednn_ops = ("_reorder_linear_weight", "_linear_pointwise")
    if torch.backends.mkldnn.is_available() and all(
        hasattr(torch.ops.mkldnn, op) for op in onednn_ops
    ):
        ways.append("onednn")
    return ways


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch can pack weights of `dtype` on `device` at all."""
    return bool(available_ways(device, dtype))


def pack(weight: torch.Tensor, way: str = "mkl", min_rows: int = PACKED_MIN_ROWS) -> Packed:
    """The packed copy of an (out, in) fp32 (or, for onednn, bf16) weight in `way`'s layout."""
    reorders = {
        "onednn": torch.ops.mkldnn._reorder_linear_weight,
        "mkl": torch.ops.mkl._mkl_reorder_linear_weight,
    }
    if way not in reorders:
        raise ValueError(f"unknown packed layout {way!r}; known: {', '.join(reorders)}")
    return Packed(reorders[way](weight.detach(), DECODE_ROWS), way, min_rows)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    packed: Packed | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, from `packed` when there is one and the rows are many."""
    if x.dim() == 2:  # the model's case: no reshapes (each is a dispatched op per call)
        rows, flat = x.shape[0], x
    else:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        flat = x.reshape(rows, x.shape[-1])  # (rows, in)
    if packed is None or rows < packed.min_rows:
        return F.linear(x, weight, bias)
    if packed.way == "onednn":
        out = torch.ops.mkldnn._linear_pointwise.default(flat, packed.tensor, bias, "none", [], "")
    else:
        out = torch.ops.mkl._mkl_linear.default(flat, packed.tensor, weight, bias, rows)
    return out if flat is x else out.reshape(*x.shape[:-1], weight.shape[0])


class PackedLinear(nn.Module):
    """An `nn.Linear` (same `weight` and `bias` parameters) multiplied from a packed copy."""

    def __init__(self, linear: nn.Linear, packed: Packed) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.packed, self.bias)


def agrees(weight: torch.Tensor, packed: Packed) -> bool:
    """Whether `packed` reproduces `F.linear` at row counts other than DECODE_ROWS."""
    generator = torch.Generator().manual_seed(0)
    tolerance = 1e-4 if weight.dtype == torch.float32 else 2e-2  # bf16 outputs: 8-bit mantissa
    for rows in (packed.min_rows, 7, DECODE_ROWS + 3):
        x = torch.randn(rows, weight.shape[1], generator=generator).to(weight.dtype)
        want = F.linear(x, weight).float()
        got = linear(x, weight, packed).float()
        if not torch.allclose(got, want, rtol=tolerance, atol=tolerance):
            return False
    return True


def _median_times(calls: dict[str, list], rows: int, rounds: int = 5) -> dict[str, float]:
    """Median seconds of one pass of each way's calls over `rows` rows, ways interleaved.
    `calls[way]` holds (weight, Packed | None) pairs."""
    widths = {w.shape[1] for pairs in calls.values() for w, _ in pairs}
    generator = torch.Generator().manual_seed(0)  # torch's global generator is left alone
    dtype = next(w for pairs in calls.values() for w, _ in pairs).dtype
    inputs = {w: torch.randn(rows, w, generator=generator).to(dtype) for w in widths}
    times: dict[str, list[float]] = {way: [] for way in calls}
    for round_ in range(rounds + 1):
        for way, pairs in calls.items():
            start = time.perf_counter()
            for weight, packed in pairs:
                linear(inputs[weight.shape[1]], weight, packed)
            if round_:  # the first round warms up (and builds oneDNN's kernels)
                times[way].append(time.perf_counter() - start)
    return {way: statistics.median(t) for way, t in times.items()}


def choose(weights: list[torch.Tensor], ways: list[str]) -> tuple[str, int]:
    """-> (way, min_rows) for a model whose matmuls look like `weights` (its first layer's
    projections and its LM head): the fastest of F.linear and the packed `ways` at
    DECODE_ROWS rows, then the rows from which that pack beats F.linear (1 or
    PACKED_MIN_ROWS). Made once per process for a set of shapes."""
    shapes = tuple(tuple(w.shape) for w in weights)
    key = (shapes, weights[0].dtype, tuple(ways), torch.get_num_threads())
    if key in _CHOICES:
        return _CHOICES[key]
    packs = {way: [pack(w, way, min_rows=1) for w in weights] for way in ways}
    calls = {"linear": [(w, None) for w in weights]}
    calls |= {way: list(zip(weights, packs[way])) for way in ways}
    many = _median_times(calls, DECODE_ROWS)
    best = "linear"
    for way in WAYS[1:]:
        if way in many and many[way] < MARGIN * many[best]:
            best = way
    min_rows = PACKED_MIN_ROWS
    if best != "linear":
        one = _median_times({"linear": calls["linear"], best: calls[best]}, 1)
        min_rows = 1 if one[best] < MARGIN * one["linear"] else PACKED_MIN_ROWS
    log.info(
        "CPU matmuls (%s): %s from %d rows (%s at %d rows)",
        str(weights[0].dtype).removeprefix("torch."), best, min_rows,
        ", ".join(f"{w} {t * 1e3:.2f} ms" for w, t in many.items()), DECODE_ROWS,
    )  # fmt: skip
    _CHOICES[key] = (best, min_rows)
    return best, min_rows


def prepack(model: nn.Module, way: str = "auto") -> str:
    """Replace the model's `nn.Linear` projections by `PackedLinear` and pack its LM head
    (`model.head_pack`), in `way`'s layout ("mkl", "onednn", or "auto": `choose`). Returns
    the way used: "linear" (nothing packed) where this torch cannot pack the model's weights,
    the timing chose F.linear, or the packed path disagrees with it. Logs what a bf16 model's
    layers run on."""
    used = _pack_model(model, way)
    param = next(model.parameters())
    if param.device.type == "cpu" and param.dtype == torch.bfloat16:
        log.info(
            "bfloat16 weights on CPU: matmuls by %s with fp32 accumulation (%s); norms, rope "
            "and attention run in torch ops (the native kernels and the compiled decode loop "
            "take fp32 activations)",
            "oneDNN packs" if used == "onednn" else "F.linear", _bf16_instructions(),
        )  # fmt: skip
    return used


def _bf16_instructions() -> str:
    """Which bf16 instructions this CPU has, for the log."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    found = [flag for flag in ("avx512_bf16", "amx_bf16") if f" {flag}" in info]
    return f"the CPU has {' and '.join(found)}" if found else "no bf16 instructions: emulated"


def _pack_model(model: nn.Module, way: str) -> str:
    param = next(model.parameters())
    ways = available_ways(param.device, param.dtype)
    if way != "auto" and way not in ways:
        if way != "linear":
            log.warning("CPU matmul way %r is not available here (%s): F.linear", way, ways)
        return "linear"
    with torch.inference_mode():
        found = [
            (parent, name, child)
            for parent in model.modules()
            for name, child in parent.named_children()
            if type(child) is nn.Linear
        ]
        if not found or not ways:
            return "linear"
        head = getattr(model, "lm_head", None)  # untied: packed with the projections
        # a head in quantized blocks multiplies from them (a GGUF whose Q3_K matrices were
        # dequantized at load has plain fp32 projections beside it)
        quant_head = getattr(model, "quant_head", None) is not None
        head_weights = [] if quant_head else [(model.embed_tokens if head is None else head).weight]
        min_rows = PACKED_MIN_ROWS if way == "mkl" else 1
        if way == "auto":
            layer = [child.weight for _, _, child in found[:4]]
            way, min_rows = choose([*layer, *head_weights], ways)
            if way == "linear":
                return way
        first = pack(found[0][2].weight, way, min_rows)  # checked once, then used
        if not agrees(found[0][2].weight, first):
            log.warning("packed %s sgemm disagrees with F.linear here: weights left unpacked", way)
            return "linear"
        for i, (parent, name, child) in enumerate(found):
            packed = first if i == 0 else pack(child.weight, way, min_rows)
            setattr(parent, name, PackedLinear(child, packed))
        # an untied head was among `found`, and is now a PackedLinear
        if not quant_head:
            model.head_pack = (
                pack(head_weights[0], way, min_rows) if head is None else model.lm_head.packed
            )
    return way
