"""Native matmul, dequantize and row gather from quantized weight blocks (`kernels/cpu/quant.c`),
built at first use like `native` and called through ctypes; `radixflow.kernels.quant` is the
reference they are tested against, and what a caller falls back to where these return None.

Why: decode reads every weight once a token, so a 4-bit weight read in place (0.56-0.63 bytes
a weight) instead of its fp32 copy (4 bytes) streams about 80 MB a token for SmolLM2-135M
instead of 540 MB.

Two modes, per call (`linear(..., activations=)`) or the process default (`set_activations`,
RADIXFLOW_QUANT_ACTIVATIONS):
- "int8" (default): x quantized per block to 8 bits and multiplied with integer dot products
  (qdot.c: AVX512-VNNI / AVX-VNNI / AVX2 maddubs, `set_int_isa`) up to `set_int_rows`' rows,
  AMX-INT8 tile products above (qdot_amx.c, `set_amx_int_rows`), one bf16 tile pass from
  `set_amx_bf16_rows` (64) rows; the reference is `quant.linear_int8`. On a 7B Q4_K weight at
  one row (2 threads of this project's Xeon) the integer path ran 2.5-3x the fp32 one. On
  AVX512-VNNI the K types from `set_int_gemm_rows` (5) rows unpack 16-feature panels once for
  all rows (qdot_gemm.c) and take the integer path up to 63 rows where AMX is (1.1-1.55x
  AMX-INT8's speed), at every row count without AMX-INT8 (AMD Zen 4, RADIXFLOW_QUANT_AMX=0): a
  7B layer at 16 / 64 / 256 rows in 30 / 80 / 289 ms of one thread, against 63 (the row
  kernels) / 208 / 697 ms (the fp32 panels) before. The 32-block types take such panels too
  (qdot_gemm32.c) from 5 rows: up to 40 (Q4_0, Q5_0, Q8_0) or 63 (Q4_1, Q5_1) where AMX is,
  at every row count without (a 7B Q4_0
  layer on one thread: 2.5-3x the exact paths' speed, which they took above 4 rows before).
  Below AVX512-VNNI (AVX2, AVX-VNNI) the K types take 8-feature panels with maddubs
  (qdot_gemm8.c) from 8 rows, the row kernels below, the integer path at every row count:
  a 7B Q4_K projection at 16 / 32 / 256 rows 1.3x / 1.4x / 1.8x the row kernels'
  speed (2 threads of an AMD EPYC, Zen 3), which had stopped at 16 rows. The 32-block
  types with 4- or 5-bit quants (Q4_0, Q4_1, Q4_1R, Q5_0, Q5_1) take such panels there too
  (qdot_gemm8_32.c) from 4 rows, at every row count the int8 mode (or `auto-big`'s
  batches) gives them (a 7B Q4_0 projection at 16 rows 2.3x the row kernels, 1.9x the
  exact panels); Q8_0 keeps the row kernels up to 4 rows.
- "fp32" (exact): the weight dequantized in registers against fp32 x, described below.

- ISA: AVX-512, AVX2+FMA+F16C and a baseline path in one library, picked at run time;
  `RADIXFLOW_QUANT_ISA=avx2|scalar` (read by the C library at first use) or `set_isa` lower
  it; `isa()` says which.
- Many rows (from `set_panel_rows`' threshold, 16 on AVX-512, 12 on AVX2) take a GEMM-style
  path: 16 or 32 output rows dequantized and transposed once, then an outer-product
  micro-kernel over all rows of x. On SmolLM2's shapes at 64 and 256 rows (Q4_1, Q8_0; one
  thread of this project's AMD EPYC, loaded) it took about the time of oneDNN's packed fp32
  sgemm (0.84-1.05x; the micro-kernel alone runs at ~100 GFLOP/s, near the core's peak) and
  0.45-0.85x that of F.linear on fp32. At 8-16 rows it is still 1.1-1.6x oneDNN's time: the
  dequantization and transposition (~0.14 ns a weight) are then a third of the call.
- Decode, one thread, 48 distinct 576 -> 1536 weights cycled (out of cache, as a model's are):
  96 us a call at one row for Q4_1, 132 us for Q8_0, 390-460 us for F.linear on fp32; at 16
  rows 500-550 us against 740-770 us. The 49152 x 576 Q8_0 head: 3.2-4.0 ms, fp32 12-13 ms.
- AMX (`quant_amx.c`, CPUs with AMX-BF16, from 32 rows: `set_amx_rows`): x and the weight,
  dequantized a chunk of 64 output features at a time, are split into bf16 high and low parts
  and multiplied as hi*hi + hi*lo + lo*hi on tile registers with fp32 accumulation, within a
  few 1e-6 of the fp32 result. SmolLM2's Q4_1 shapes, 2 threads of this project's Xeon:
  1.3x the panel path at 32 rows, 2.0x at 1,024.
- One row of Q4_1 on AVX-512 runs on Q4_1R (`radixflow.kernels.quant.repack`, done by the
  model at load): 11.8-13.2 GB/s a thread against Q4_1's 10.5-10.8.
- x24 (`quant_x24.c`, AVX512-VNNI, `set_x24`): 1-4 rows of x against Q4_1R or Q8_0R in the
  modes that allow the tiles (`auto`'s "fp32-tiles"), not in the explicit exact mode: each
  block of 32 of x in fixed point (24 bits; 22 against Q8_0R) as three signed bytes, the
  products by vpdpbusd, exact in int32, one conversion and fma a group of blocks. Its error is
  that of fp32's rounding of x (~1e-6 of the largest output); SmolLM2's 30 layers of one-row
  projections ran 1.37x the fp32 kernel on one thread, its tied Q8_0 head 1.5x. On the AVX2
  path (no AVX-512) `quant_x24_avx2.c` does the same for Q4_1R with maddubs (the model then
  holds Q4_1 as Q4_1R under `auto`): SmolLM2's K = 576 rows 1.1x the fp32 Q4_1 kernel on an
  AMD Zen 3, K = 1536-4096 1.2-1.35x.
- `address("rf_qlinear")` gives the C entry point for the C++ decode loop (the ABI in quant.c).
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from radixflow.kernels.cpu import native
from radixflow.kernels.quant import F32, QuantWeight

SOURCE = Path(__file__).with_name("quant.c")
# no -march=native: the baseline copy must run on any x86-64; the fast ones are chosen at run
# time. -ffp-contract=off keeps d * q + m two roundings, as the reference's.
FLAGS = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC"]
_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
SIGNATURES = {
    "rf_qlinear": (_C, [_P, _I, _I, _I, _P, _I, _I, _C, _P, _P, _P, _I, _C]),
    "rf_qdequantize": (_C, [_P, _I, _I, _I, _C, _P, _P, _C]),
    "rf_qget_rows": (_C, [_P, _I, _I, _C, _P, _P, _I, _P, _C]),
    "rf_qset_isa": (_C, [_C]),
    "rf_qset_panel_rows": (_C, [_C]),
    "rf_qset_fused_split": (_I, [_I]),
    "rf_qset_amx_rows": (_C, [_C]),
    "rf_qset_activations": (_C, [_C]),
    "rf_qset_int_isa": (_C, [_C]),
    "rf_qset_int_rows": (_C, [_C]),
    "rf_qset_int_gemm_rows": (_C, [_C]),
    "rf_qset_amx_int_rows": (_C, [_C]),
    "rf_qset_amx_bf16_rows": (_C, [_C]),
    "rf_qset_x24": (_C, [_C]),
    "rf_qquantize_acts": (_C, [_P, _I, _I, _I, _C, _P, _P]),
    # the team (called from the C++ decode loop by address): see quant.c
    "rf_team_run": (None, [_C, _P, _P]),
    "rf_team_barrier": (None, []),
    "rf_team_thread": (_C, []),
    "rf_qteam_takes": (_C, [_I, _I, _C, _I, _P]),
    "rf_qteam_linear": (None, [_P, _I, _I, _I, _P, _I, _I, _C, _P, _P, _I]),
}
ISAS = ("scalar", "avx2", "avx512")  # rf_qset_isa's levels 0, 1, 2
INT_ISAS = ("avx2", "avx-vnni", "avx512-vnni")  # rf_qset_int_isa's levels 0, 1, 2
ACTIVATIONS = ("fp32", "int8", "auto")  # rf_qset_activations's modes 0, 1, 2
# or'ed into rf_qlinear's qtype; "fp32-tiles": fp32 x, AMX bf16x3 tiles allowed (quant.c)
ACTIVATION_FLAGS = {
    "fp32": 0x10000, "int8": 0x20000, "fp32-tiles": 0x40000, "int8-batch": 0x80000, None: 0
}  # fmt: skip
K_TYPES = (12, 13, 14)  # Q4_K, Q5_K, Q6_K


def activations_for(qtype: int, mode: str | None) -> str | None:
    """The activations a call on a `qtype` weight uses under a model's mode: "auto" is int8
    for the K types (their one-row integer path runs 2.5-3x the fp32 one) and fp32 for the
    rest (their one-row integer path measured no faster, and exact keeps a small model's
    replies: docs/models.md), there with the AMX bf16x3 tiles from 32 rows ("fp32-tiles",
    within a few 1e-6 a matmul); "auto-big" (`auto` for a model of BIG_MODEL_PARAMS or more)
    the same but int8 for the rest's calls of more than 4 rows ("int8-batch": batches and
    prefill, where the integer products run ~2x the exact ones) and for one row of Q4_0,
    Q4_1, Q5_0 or Q5_1 (1.3-2x the exact kernel; the C library decides by rows and
    instruction set: `acts_for_rows`); "fp32" is exact throughout
    (no tiles), "int8" as named; None the process default."""
    if mode in ("auto", "auto-big"):
        if qtype in K_TYPES:
            return "int8"
        return "int8-batch" if mode == "auto-big" else "fp32-tiles"
    return mode


_state: dict[str, ctypes.CDLL | None] = {}
_lock = threading.Lock()


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on the first call; None where they cannot be had."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"] = native.build(SOURCE, "quant", FLAGS, SIGNATURES)
    return _state["lib"]


def isa() -> str:
    """The path the kernels take: "avx512", "avx2" or "scalar" (also without the library)."""
    lib = library()
    return "scalar" if lib is None else ISAS[lib.rf_qset_isa(-1)]


def set_isa(name: str) -> str:
    """Force the path ("avx512", "avx2", "scalar"; a faster one than the CPU has is lowered to
    the best it has) for every caller in this process; returns the path taken."""
    lib = library()
    return "scalar" if lib is None else ISAS[lib.rf_qset_isa(ISAS.index(name))]


def set_panel_rows(rows: int) -> int:
    """From how many rows of x `linear` takes the panel path (AVX2, AVX-512) instead of the
    decode path, for every caller in this process: `rows` > 0 sets it, 0 restores the measured
    default, -1 only asks; returns the current ISA's (0 where it has no panel path)."""
    lib = library()
    return 0 if lib is None else lib.rf_qset_panel_rows(rows)


def set_fused_split(work: int) -> int:
    """The work a thread (N * K * (M + 4)) from which a call of 1-4 rows splits over threads,
    for every caller in this process: `work` > 0 sets it, 0 restores the default, -1 only
    asks; returns the current one (0 without the library). Splitting changes no result: each
    output is one thread's sum either way."""
    lib = library()
    return 0 if lib is None else lib.rf_qset_fused_split(work)


def set_amx_rows(rows: int) -> int:
    """From how many rows of x `linear` takes the AMX path (bf16x3 tile products, on CPUs
    with AMX-BF16: quant_amx.c), for every caller in this process: `rows` > 0 sets it (a
    huge value turns it off), 0 restores the measured default, -1 only asks; returns it, or 0
    where the path is not available (no library, no AMX, RADIXFLOW_QUANT_AMX=0, or an ISA
    lowered below AVX-512)."""
    lib = library()
    if lib is None or isa() != "avx512":
        return 0
    return lib.rf_qset_amx_rows(rows)


def set_activations(mode: str | None) -> str:
    """The activations a call without its own choice uses: "auto" (the default: int8 for the
    K types, fp32 for the rest, as `activations_for`), "int8" (8-bit integer dot products
    where the type and CPU allow: qdot.c) or "fp32" (exact); None only asks. Read at first use
    from RADIXFLOW_QUANT_ACTIVATIONS; "fp32" without the library."""
    lib = library()
    if lib is None:
        return "fp32"
    return ACTIVATIONS[lib.rf_qset_activations(-1 if mode is None else ACTIVATIONS.index(mode))]


def set_x24(on: bool | None) -> bool:
    """Whether 1-4 rows of x against Q4_1R (and Q8_0R) take the 24-bit fixed-point integer
    kernels (quant_x24.c: x per block of 32 as three signed bytes, vpdpbusd, on AVX512-VNNI;
    quant_x24_avx2.c: the same with maddubs on the AVX2 path, Q4_1R; near-exact, `auto`'s
    choice) instead of the fp32 fused ones, for every caller in this process; None only asks.
    Read at first use from RADIXFLOW_QUANT_X24 (0: off); False without the library."""
    lib = library()
    return False if lib is None else bool(lib.rf_qset_x24(-1 if on is None else int(on)))


def set_int_isa(name: str | None) -> str | None:
    """The integer path's instructions ("avx512-vnni", "avx-vnni", "avx2"; lowered to the best
    the CPU has), for every caller in this process; None only asks. None where there is no
    integer path (no library, no AVX2)."""
    lib = library()
    level = -1 if lib is None else lib.rf_qset_int_isa(-1 if name is None else INT_ISAS.index(name))
    return None if level < 0 else INT_ISAS[level]


def set_int_rows(rows: int) -> int:
    """Up to how many rows of x the integer path is taken (above, the fp32 panel and AMX
    paths): `rows` > 0 sets it, 0 restores the default, -1 only asks."""
    lib = library()
    return 0 if lib is None else lib.rf_qset_int_rows(rows)


def set_int_gemm_rows(rows: int) -> int:
    """From how many rows the integer path unpacks panels of the weight once for all rows of
    x (AVX512-VNNI: 16 features, qdot_gemm.c, qdot_gemm32.c; below it the K types' 8,
    qdot_gemm8.c) instead of once per 4 rows: `rows` > 0 sets it for all, 0 restores the
    defaults (AVX512-VNNI's 5 is returned; AVX2's is 8), -1 only asks."""
    lib = library()
    return 0 if lib is None else lib.rf_qset_int_gemm_rows(rows)


def set_amx_int_rows(rows: int) -> int:
    """From how many rows of x an int8 call takes AMX-INT8 tile products (qdot_amx.c) instead
    of the one-row integer path: `rows` > 0 sets it (a huge value turns it off), 0 restores
    the default, -1 only asks; 0 where AMX-INT8 is not usable or the ISA is lowered."""
    lib = library()
    if lib is None or isa() != "avx512":
        return 0
    return lib.rf_qset_amx_int_rows(rows)


def set_amx_bf16_rows(rows: int) -> int:
    """From how many rows of x an int8-mode call takes one bf16 x bf16 pass on AMX tiles (x
    and the dequantized weight rounded to bf16, fp32 sums: quant_amx.c) instead of int8 tile
    products: `rows` > 0 sets it (a huge value turns it off), 0 restores the default, -1 only
    asks; 0 where AMX-BF16 is not usable or the ISA is lowered."""
    lib = library()
    if lib is None or isa() != "avx512":
        return 0
    return lib.rf_qset_amx_bf16_rows(rows)


def quantize_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x (M, K) fp32 quantized as the integer path does: (q (M, K) int8, d (M, K // block));
    None without it."""
    lib = library()
    if lib is None or x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
        return None
    m, k = x.shape
    q, d = torch.empty((m, k), dtype=torch.int8), torch.empty((m, k // block))
    status = lib.rf_qquantize_acts(
        x.data_ptr(), m, x.stride(0), k, block, q.data_ptr(), d.data_ptr()
    )
    return (q, d) if status == 0 else None


def address(name: str) -> int | None:
    """The C function `name`'s address (rf_qlinear, rf_qdequantize, rf_qget_rows), for
    native callers; None without the library."""
    lib = library()
    if lib is None or name not in SIGNATURES:
        return None
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def _takes(w: QuantWeight) -> bool:
    return (
        w.qtype != F32
        and w.data.is_cpu
        and w.data.is_contiguous()
        and (w.scale is None or (w.scale.dtype == torch.float32 and w.scale.is_contiguous()))
        and (w.scale is None or w.scale.is_cpu)
    )


def _scale(w: QuantWeight) -> int | None:
    return None if w.scale is None else w.scale.data_ptr()


def linear(
    x: torch.Tensor,
    w: QuantWeight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    activations: str | None = None,
) -> torch.Tensor | None:
    """x (M, K) fp32 (rows any stride, inner contiguous) -> (M, N) = x W^T (+ bias), written
    into `out` (M, N) when given (inner contiguous); None where not taken. `activations`:
    "fp32" (exact), "int8" (integer dot products where they apply), "auto"
    (`activations_for`) or None (the process default, `set_activations`)."""
    lib = library()
    n, k = w.shape
    if (
        lib is None
        or not _takes(w)
        or x.dim() != 2
        or x.shape[1] != k
        or x.dtype != torch.float32
        or not x.is_cpu
        or x.stride(1) != 1
        or (bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,)))
        or (bias is not None and not bias.is_cpu)
        or (out is not None and (out.shape != (x.shape[0], n) or out.stride(1) != 1))
        or (out is not None and (out.dtype != torch.float32 or not out.is_cpu))
    ):
        return None
    m = x.shape[0]
    out = torch.empty((m, n)) if out is None else out
    bias = None if bias is None else bias.contiguous()
    status = lib.rf_qlinear(
        x.data_ptr(), m, x.stride(0), k, w.data.data_ptr(), n, w.row_bytes,
        w.qtype | ACTIVATION_FLAGS[activations_for(w.qtype, activations)], _scale(w),
        None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
        torch.get_num_threads(),
    )  # fmt: skip
    if status == -2:
        raise MemoryError("quantized linear could not allocate its scratch")
    return out if status == 0 else None


def dequantize(w: QuantWeight) -> torch.Tensor | None:
    """(N, K) fp32, bit for bit the reference's; None where not taken."""
    lib = library()
    if lib is None or not _takes(w):
        return None
    n, k = w.shape
    out = torch.empty((n, k))
    status = lib.rf_qdequantize(
        w.data.data_ptr(), n, w.row_bytes, k, w.qtype, _scale(w), out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out if status == 0 else None


def embedding(ids: torch.Tensor, w: QuantWeight) -> torch.Tensor | None:
    """Rows `ids` (T,) int64 of the weight -> (T, K) fp32; None where not taken. Raises
    IndexError for an id outside [0, N)."""
    lib = library()
    if lib is None or not _takes(w) or ids.dim() != 1 or ids.dtype != torch.int64:
        return None
    n, k = w.shape
    ids = ids.contiguous()
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= n):
        raise IndexError(f"ids outside [0, {n})")
    out = torch.empty((len(ids), k))
    status = lib.rf_qget_rows(
        w.data.data_ptr(), w.row_bytes, k, w.qtype, _scale(w), ids.data_ptr(), len(ids),
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out if status == 0 else None
