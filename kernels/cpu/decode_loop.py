"""The CPU decode loop: a decode-only step's decoder layers in one compiled call
(`kernels/cpu/decode_loop.cpp`, a torch C++ extension), instead of the Python layer loop.

On CPU, a decode step's matmuls and native kernels are separated by Python: wrappers,
checks, tensor bookkeeping and the layer code, about 300 us a layer when run cold after a
matmul has streamed its weights through the caches. The loop makes the same calls in the
same order (so the same bits come out) with none of that between them: SmolLM2, 64 streams,
2 threads, a decode step took 124 ms against 130 ms, alternating steps in one engine.

- It serves the plain pre-norm decoder: fused qkv and gate_up projections without biases,
  each prepacked for oneDNN (`runtime/models/prepack.py`), RMSNorm without offset, SiLU,
  no q/k norm, no sliding window, no soft-capping, fp32 weights (KV pools fp32, bf16,
  fp16 or int8 with scales), the native kernels built. `build` returns None for any other
  model (Llama and SmolLM2 qualify; so does Mistral without its window), and
  `DecodeLoop.run` returns None for a step it does not take (too few rows for the packs,
  shared prefixes too long to read row by row: `SHARED_ATTENTION_MACS`): the layers then run
  in Python.
- A step of 1-4 rows on more than one thread, its projections all quantized ranges on the
  exact fused path, takes the team path (`kernels/cpu/decode_team.h`): the whole step in one
  OpenMP parallel region, each projection's output rows shared by the threads, a barrier
  where one call's output is the next one's input, instead of a parallel region (fork and
  join) per call; the same kernels on the same sums, so the same bits.
- `DecodeLoop.run_steps` runs several greedy steps of 1-4 rows in one call on the team path
  (`kernels/cpu/decode_steps.h`): after the layers, the final norm, the LM head's rows and
  each row's argmax in the same region, then the next tokens' embeddings, so the host's
  work between steps (about 0.8 ms of a 6 ms SmolLM2 step) is spent once a run; the
  scheduler's decode runs (`runtime/scheduler/decode_runs.py`) call it. The final norm,
  head and embedding reach it once, as its `Tail`.
- The layers' weights reach the extension once, as its `Weights` (their pointers taken
  then), and the runner's pool lists once per list, as its `Pools`: converting some 400
  tensors and reading their pointers on every call cost about 170 us of a SmolLM2 step.
- Built once per machine into `RADIXFLOW_CACHE/decode_loop` (about 30 s, at model load);
  where it cannot be built (no C++ compiler, ninja or torch headers) it is off, with a log
  line. `RADIXFLOW_DECODE_LOOP=0` turns it off; so does `--disable-cpu-decode-loop`.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from radixflow.kernels.cpu import native
from radixflow.kernels.cpu import quant as native_quant
from radixflow.kernels.cpu.decode_layout import DecodeLayout, run_table
from radixflow.kernels.kv_int8 import Int8KV
from radixflow.kernels.quant import QuantWeight

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("decode_loop.cpp")
HEADERS = [
    Path(__file__).with_name(name) for name in ("decode_team.h", "decode_steps.h")
]  # in the key
_state: dict[str, Any] = {}
TEAM_FUNCTIONS = (
    "rf_team_run", "rf_team_barrier", "rf_team_thread", "rf_qteam_takes", "rf_qteam_linear",
)  # fmt: skip
TEAM_ATTENTION = ("rf_rope_store", "rf_team_attention")  # native.c's, for the same path
_lock = threading.Lock()
# A step whose rows share cached keys (a system prompt, a fork's branches, the rows one
# jump-forward appends to a request) runs in the loop with each row reading the shared keys
# itself, while that attention (multiply-adds per layer) stays under this: the Python layers
# would read each shared run once for all its rows (one dense product, merged by lse), but
# cost their per-layer overhead. SmolLM2, 2 threads, AMD EPYC, ms a decode step (Python
# shared merge / loop): 300 shared keys: 25 / 10 at 2 rows, 33 / 16 at 4, 71 / 56 at 16,
# 165 / 152 at 64; 2,000 shared keys: 45 / 21 at 2 rows, 115 / 100 at 16, 179 / 182 at 32,
# 279 / 323 at 64. Even at about 60 M a layer (55,000 row-keys of SmolLM2's 9 x 64 query
# dims); half of that taken. A 7B Q4_K_M (32 x 128): 1.18x and 1.34x at 2 rows behind 300
# and 1,000 keys, 1.04x and 1.12x at 4, even at 8 behind 300 (19.7 M, taken).
SHARED_ATTENTION_MACS = 32 << 20


def extension() -> Any | None:
    """The compiled loop, built on the first call; None where it cannot be had."""
    if "ext" not in _state:
        with _lock:
            if "ext" not in _state:
                _state["ext"] = _load()
    return _state["ext"]


def _load() -> Any | None:
    if os.environ.get("RADIXFLOW_DECODE_LOOP", "1") == "0" or native.library() is None:
        return None
    try:
        from torch.utils import cpp_extension  # noqa: PLC0415 (slow import: only when the extension is built)

        texts = "\0".join(p.read_text() for p in [SOURCE, *HEADERS])
        key = hashlib.sha256(f"{texts}\0{torch.__version__}".encode()).hexdigest()
        root = Path(os.environ.get("RADIXFLOW_CACHE") or Path.home() / ".cache" / "radixflow")
        build = root / "decode_loop" / key[:16]
        build.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load(
            f"radixflow_decode_loop_{key[:16]}", [str(SOURCE)], extra_cflags=["-O2"],
            build_directory=str(build), verbose=False,
        )  # fmt: skip
    except Exception as e:  # noqa: BLE001 (a compiler's or ninja's failure, whatever its type)
        log.warning("CPU decode loop unavailable (%s): decode layers run in Python", e)
        return None


@dataclass(frozen=True)
class DecodeLoop:
    """One model's layer weights and packs, gathered once for `decode_layers`."""

    ext: Any
    weights: tuple[list[Any], ...]  # input norms, post norms, 4 projections per layer, metas
    min_rows: int  # fewer rows go through F.linear in the Python path: not taken
    max_rows: int  # from here quantized projections dequantize into sgemm: not taken
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    eps: float
    fns: list[int]  # rf_rms_norm, rf_silu_mul, rf_rope_decode_attention
    prepared: Any = None  # `weights` as the extension's Weights: converted once, not per call
    tail: Any = None  # the final norm, LM head and embedding as its Tail (`run_steps`), or None
    # the runner's pool lists as the extension's Pools, with the lists they were made from
    pools: list[tuple[Any, Any, Any]] = field(default_factory=list)

    def run(
        self,
        batch: Any,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        k_layers: Any,
        v_layers: Any,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(mlp, residual) of the last layer for a decode-only step from its embeddings
        `hidden`, as the Python layer loop returns them; None where not taken."""
        layout, rows = self._layout(batch, hidden.shape[0], self.max_rows)
        if layout is None:
            return None
        cos, sin = rope
        slots = batch.out_slots
        if not (cos.is_contiguous() and sin.is_contiguous() and slots.dtype == torch.int64):
            return None
        mlp, residual, status, _team = self.ext.decode_layers(
            hidden, self.prepared, self._pools(k_layers, v_layers), cos, sin,
            slots.contiguous(), *layout.runs, self.num_heads, self.num_kv_heads, self.head_dim,
            self.scale, self.eps, self.fns, torch.get_num_threads(),
        )  # fmt: skip
        if status in (-3, -4):  # refused (-4 after storing some layers' K/V, which the
            # Python layers store again, the same values): the Python layers take the step
            return None
        _raise_for(status, rows)
        return mlp, residual

    def run_steps(
        self,
        batch: Any,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        k_layers: Any,
        v_layers: Any,
        slots: torch.Tensor,
    ) -> torch.Tensor | None:
        """Up to `len(slots)` greedy decode steps of a decode-only batch of 1-4 rows in one
        call (decode_steps.h), from step 0's embeddings `hidden` (B, hidden): rope's cos/sin
        hold every step's rows (steps x B, rotary), `slots` (steps, B) int64 each step's KV
        slots. -> the tokens of the steps done (done, B) int64, fewer than asked where one
        stopped; None where not taken (the caller runs the step as one). Raises as `run`."""
        layout, rows = self._layout(batch, hidden.shape[0], min(4, self.max_rows))
        if self.tail is None or layout is None:
            return None
        cos, sin = rope
        tokens, done, status = self.ext.decode_steps(
            hidden, self.prepared, self._pools(k_layers, v_layers), self.tail, cos, sin,
            slots.contiguous(), *layout.runs, len(slots), self.num_heads, self.num_kv_heads,
            self.head_dim, self.scale, self.eps, self.fns, torch.get_num_threads(),
        )  # fmt: skip
        if status in (-3, -5):  # not taken, nothing touched
            return None
        _raise_for(status, rows)
        return tokens[:done]

    def _layout(self, batch: Any, rows: int, max_rows: int) -> tuple[Any, int]:
        """(the step's decode layout, rows) where the loop takes `rows` rows of it (its runs
        known, the native kernels on; shared prefixes within `SHARED_ATTENTION_MACS`, then
        a layout of each row's keys whole), else (None, rows)."""
        layout = batch.layouts.get(("decode", 0))
        if layout is None or layout.runs is None:
            return None, rows
        if not self.min_rows <= rows <= max_rows:
            return None, rows
        if native.library() is None:  # switched off since the build (tests do): Python's
            return None, rows
        if layout.shared:  # each row reads its shared keys itself, where that stays small
            row_keys = sum(len(p.q_rows) * len(p.slots) for p in layout.shared)
            if 2 * row_keys * self.num_heads * self.head_dim > SHARED_ATTENTION_MACS:
                return None, rows
            runs = run_table(batch.decode_kv_indptr, batch.decode_kv_indices)
            layout = DecodeLayout([], runs=runs)
        return layout, rows

    def _pools(self, k_layers: Any, v_layers: Any) -> Any:
        """The extension's Pools of these pool lists: made at their first step and kept
        while the runner passes the same lists (it makes them once)."""
        for k, v, pools in self.pools:
            if k is k_layers and v is v_layers:
                return pools
        pools = self.ext.Pools(*_pool_lists(k_layers, v_layers))
        self.pools[:] = [(k_layers, v_layers, pools)]  # the lists held: no id reused
        return pools


def _raise_for(status: int, rows: int) -> None:
    """Raise for a failed loop call's status (0: nothing): a slot outside the pool (> 0), the
    attention's task list not allocated (-2), a greedy token outside the embedding (-6)."""
    if status > 0:
        raise IndexError(f"{status} of {rows} slots outside the pool")
    if status == -2:
        raise MemoryError("native decode attention could not allocate its task list")
    if status == -6:
        raise RuntimeError("a decode step's greedy token fell outside the embedding")
    if status != 0:
        raise RuntimeError(f"native decode attention refused the step ({status})")


def _pool_lists(k_layers: Any, v_layers: Any) -> tuple[list[torch.Tensor], ...]:
    """(k pools, v pools, k scales, v scales) per layer for `decode_layers`: an int8 pool
    (Int8KV) as its data and its scales, the scale lists empty for the other dtypes."""
    k_layers, v_layers = list(k_layers), list(v_layers)
    if k_layers and isinstance(k_layers[0], Int8KV):
        return (
            [p.data for p in k_layers], [p.data for p in v_layers],
            [p.scale for p in k_layers], [p.scale for p in v_layers],
        )  # fmt: skip
    return k_layers, v_layers, [], []


def _projection(p: Any) -> tuple[list[torch.Tensor], list[int], int, int] | None:
    """(tensors, meta, min_rows, max_rows) of one projection for `decode_layers`: a oneDNN
    pack (`.packed` from radixflow.runtime.models.prepack), or quantized row ranges (`.parts`
    from radixflow.runtime.models.quantized, with each range's blocks and per-row scale);
    None for anything else (a bias, an fp32 range, an MKL pack)."""
    if getattr(p, "bias", None) is not None:
        return None
    packed = getattr(p, "packed", None)
    if getattr(packed, "way", None) == "onednn":
        return [packed.tensor], [], packed.min_rows, 1 << 62
    parts = getattr(p, "parts", None)
    if not parts or not all(
        isinstance(w, QuantWeight) and w.qtype != 0 and w.data.is_contiguous() for w in parts
    ):
        return None
    tensors: list[torch.Tensor] = []
    meta: list[int] = []
    for w in parts:
        tensors += [w.data, w.scale if w.scale is not None else torch.empty(0)]
        mode = native_quant.activations_for(w.qtype, getattr(p, "activations", None))
        flag = native_quant.ACTIVATION_FLAGS[mode]
        meta += [w.qtype | flag, w.shape[0], w.row_bytes]
    dense_from = getattr(p, "dense_from", 0)
    return tensors, meta, 1, (dense_from - 1) if dense_from else 1 << 62


def build(model: Any) -> DecodeLoop | None:
    """The loop for `model` (a CausalLM after prepacking or with quantized projections) when
    it qualifies and the extension builds; else None. Every projection must be a oneDNN pack
    or quantized ranges the native kernel takes (`_projection`), without bias."""

    c = model.config
    param = model.norm
    plain = (
        param.device.type == "cpu"
        and param.dtype == torch.float32
        and not (c.sandwich_norm or c.qk_norm or c.norm_offset or c.attn_logit_cap)
        and not any(layer.window for layer in model.layers)
        and model.gather_logits is None
        and c.head_dim % 16 == 0  # the native attention's shapes (rf_rope_decode_attention)
        and c.head_dim <= 256
        and c.num_heads % c.num_kv_heads == 0
        and c.num_heads // c.num_kv_heads <= 8
    )
    projections = [
        getattr(layer, name)
        for layer in model.layers
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    ]
    plain = plain and all(layer.act is F.silu for layer in model.layers)
    described = [_projection(p) for p in projections]
    plain = plain and all(d is not None for d in described)
    ext = extension() if plain else None  # None too where the native kernels are not built
    if ext is None:
        return None
    lib = native.library()
    fns = [
        ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
        for name in ("rf_rms_norm", "rf_silu_mul", "rf_rope_decode_attention")
    ]
    if any(d[1] for d in described):  # quantized ranges: the kernel by its address
        qlinear = native_quant.address("rf_qlinear")
        if qlinear is None:
            return None
        fns.append(qlinear)
        # the team path's (kernels/cpu/decode_team.h): a step of 1-4 rows in one parallel region
        team = [native_quant.address(name) for name in TEAM_FUNCTIONS]
        team += [ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in TEAM_ATTENTION]
        fns += team if all(team) else []
    layers = model.layers
    weights = (
        [layer.input_norm.detach() for layer in layers],
        [layer.post_attention_norm.detach() for layer in layers],
        [d[0] for d in described],
        [d[1] for d in described],
    )
    tail = _tail(model, ext, fns)
    return DecodeLoop(
        ext, weights, max(d[2] for d in described), min(d[3] for d in described),
        c.num_heads, c.num_kv_heads, c.head_dim, c.attn_scale or 1.0 / math.sqrt(c.head_dim),
        c.rms_norm_eps, fns, ext.Weights(*weights), tail,
    )  # fmt: skip


def _tail(model: Any, ext: Any, fns: list[int]) -> Any | None:
    """The extension's Tail for `run_steps` (appending rf_qget_rows' and rf_argmax's
    addresses to `fns`): a plain final norm, an LM head in quantized ranges the team takes,
    and an embedding of quantized rows or an fp32 table, no scale on either end; else None."""
    c = model.config
    head = _projection(model.quant_head) if model.quant_head is not None else None
    if len(fns) != 11 or head is None or not head[1] or c.embed_scale != 1.0:
        return None
    if c.final_logit_cap or c.norm_offset or model.gather_logits is not None:
        return None
    embed = model.embed_tokens
    weight = getattr(embed, "weight_q", None)
    if isinstance(weight, QuantWeight) and weight.data.is_contiguous():
        scale = weight.scale if weight.scale is not None else torch.empty(0)
        table = (weight.data, scale, weight.qtype, weight.shape[0], weight.row_bytes)
    elif isinstance(embed, torch.nn.Embedding) and embed.weight.dtype == torch.float32:
        rows = embed.weight.shape[0]
        table = (embed.weight.detach().contiguous(), torch.empty(0), -1, rows, 0)
    else:
        return None
    get_rows = native_quant.address("rf_qget_rows")
    argmax = ctypes.cast(native.library().rf_argmax, ctypes.c_void_p).value
    if get_rows is None or not argmax:
        return None
    fns += [get_rows, argmax]
    return ext.Tail(model.norm.detach().contiguous(), head[0], head[1], *table)
