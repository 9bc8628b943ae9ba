"""Projections, embeddings and LM heads multiplied from quantized weights.

A decode step at a few rows reads every weight once, so its speed is the bytes it reads: a
4-bit weight is an eighth of an fp32 one. `QuantLinear` keeps the weight in its blocks
(`radixflow.kernels.quant.QuantWeight`: GGUF's types, int8 per channel, 4-bit groups) and
multiplies with the native kernel (`radixflow.kernels.cpu.quant`) in the mode
--quantized-activations names (`set_activations`): int8 (x quantized per block, integer dot
products and tile products: llama.cpp's accuracy, docs/models.md) or fp32 (dequantized in
registers against fp32 x: the fp32 reference's result up to the order of the additions).

- A fused projection (q, k and v; gate and up) is one module over row ranges that may have
  different types (a Q4_K_M file keeps v in Q6_K): same-typed neighbours are joined into one
  weight, and each range writes its own columns of the output.
- Many rows (prefill): the kernel works per row, so from `dense_from` rows on the weight is
  dequantized into a scratch fp32 matrix and multiplied by the CPU's sgemm instead.
  `choose_dense_rows` times both on the model's own first layer at load, as `prepack` does
  for fp32 weights, and the choice is logged.
- `QuantEmbedding` looks rows up from the same blocks; a tied LM head multiplies from them.
- Q4_1 projections are held as Q4_1R (`quant.repack`: a row's d's, m's and nibbles apart, the
  same bytes) where the kernel runs AVX-512: its one-row kernel reads that 1.1-1.2x faster.
  Under a small model's `auto` on AVX512-VNNI, Q8_0 weights (SmolLM2's tied head) are held
  as Q8_0R (d's and bytes apart) for the x24 kernels (`set_activations`).
- Where the native library cannot be built, each call takes the reference (dequantize +
  F.linear): slower, same numbers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from radixflow.kernels import quant
from radixflow.kernels.cpu import quant as native
from radixflow.kernels.cpu.native import cpuinfo
from radixflow.runtime.models.joined import adjacent_rows, huge_empty
from radixflow.runtime.models.loader import cache_root
from radixflow.runtime.models.progress import Progress
from radixflow.runtime.models.weights import CheckpointError, checkpoint_names

log = logging.getLogger(__name__)
Part = quant.QuantWeight | torch.Tensor  # a quantized row range, or an fp32 (rows, K) one
DENSE_CANDIDATES = (16, 32, 64, 128, 256)  # row counts from which dequantize + sgemm may win


def _joinable(a: Part, b: Part) -> bool:
    return (
        isinstance(a, quant.QuantWeight)
        and isinstance(b, quant.QuantWeight)
        and a.qtype == b.qtype
        and a.scale is None
        and b.scale is None
        and a.shape[1] == b.shape[1]
    )


def _join(parts: Sequence[Part]) -> list[Part]:
    """Neighbouring row ranges of one block type (and no per-row scale) joined into one, each
    group copied once into memory advised for huge pages (`huge_empty`), unless it was read
    there (`joined.adjacent_rows`); fp32 neighbours concatenated."""
    groups: list[list[Part]] = []
    for part in parts:
        last = groups[-1][-1] if groups else None
        both_fp32 = isinstance(part, torch.Tensor) and isinstance(last, torch.Tensor)
        if last is not None and (_joinable(last, part) or both_fp32):
            groups[-1].append(part)
        else:
            groups.append([part])
    out: list[Part] = []
    for group in groups:
        if len(group) == 1:
            out.append(group[0])
        elif isinstance(group[0], torch.Tensor):
            out.append(torch.cat(group))
        else:
            rows = sum(p.shape[0] for p in group)
            data = adjacent_rows([p.data for p in group])  # read in place (joined.py)
            if data is None:
                data = huge_empty((rows, group[0].data.shape[1]))
                at = 0
                for p in group:  # copy_ spreads over torch's threads (cat(out=) ran on one)
                    data[at : at + p.shape[0]].copy_(p.data)
                    at += p.shape[0]
            out.append(quant.QuantWeight(group[0].qtype, data, (rows, group[0].shape[1])))
    return out


def _for_kernel(part: Part) -> Part:
    """Q4_1 as Q4_1R where the kernel runs AVX-512 (same values; its one-row kernel is
    1.1-1.2x faster on Q4_1R's layout); everything else as it is."""
    q4_1 = isinstance(part, quant.QuantWeight) and part.qtype == quant.Q4_1
    if q4_1 and native.isa() == "avx512":
        return quant.repack(part)
    return part


def _rows(part: Part) -> int:
    return part.shape[0]


class QuantLinear(nn.Module):
    """`x @ W.T + bias` with W's row ranges quantized (or fp32 where the file stores fp32)."""

    def __init__(self, parts: Sequence[Part], bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.parts = [_for_kernel(p) for p in _join(parts)]
        self.in_features = self.parts[0].shape[1]
        self.out_features = sum(_rows(p) for p in self.parts)
        self.offsets = [0]
        for part in self.parts:
            self.offsets.append(self.offsets[-1] + _rows(part))
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())
        self.dense_from = 0  # 0: the kernel at any row count (set by choose_dense_rows)
        # "auto", "int8" (8-bit integer dot products: kernels/cpu/qdot.c), "fp32" (exact) or
        # None (the kernels' process default); from --quantized-activations (`set_activations`)
        self.activations: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(
            p.nbytes if isinstance(p, quant.QuantWeight) else p.numel() * 4 for p in self.parts
        )

    @property
    def types(self) -> list[str]:
        """The block types as the file stores them (Q4_1R and Q8_0R are Q4_1's and Q8_0's
        values, rearranged)."""
        names = [p.name if isinstance(p, quant.QuantWeight) else "F32" for p in self.parts]
        return [{"Q4_1R": "Q4_1", "Q8_0R": "Q8_0"}.get(name, name) for name in names]

    def dequantized(self) -> torch.Tensor:
        """The fp32 (out, in) weight: the reference's matrix."""
        return torch.cat(
            [quant.dequantize(p) if isinstance(p, quant.QuantWeight) else p for p in self.parts]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.float().contiguous()
        rows = flat.shape[0]
        if self.dense_from and rows >= self.dense_from:
            out = F.linear(flat, self._dense(), self.bias)
        else:
            out = flat.new_empty(rows, self.out_features)
            for part, start, end in zip(self.parts, self.offsets, self.offsets[1:]):
                bias = None if self.bias is None else self.bias[start:end]
                columns = out[:, start:end] if len(self.parts) > 1 else out
                _multiply(flat, part, bias, columns, self.activations)
        return out if flat is x else out.reshape(*x.shape[:-1], self.out_features)

    def _dense(self) -> torch.Tensor:
        pieces = []
        for part in self.parts:
            if isinstance(part, torch.Tensor):
                pieces.append(part)
                continue
            dense = native.dequantize(part)
            pieces.append(quant.dequantize(part) if dense is None else dense)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _multiply(
    x: torch.Tensor,
    part: Part,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    activations: str | None,
) -> None:
    """out (a column range of the output, rows at its stride) = x @ part.T + bias."""
    if isinstance(part, torch.Tensor):
        out.copy_(F.linear(x, part, bias))
        return
    if native.linear(x, part, bias, out=out, activations=activations) is None:
        out.copy_(quant.linear(x, part, bias))


class QuantEmbedding(nn.Module):
    """Token embeddings looked up from quantized rows."""

    def __init__(self, weight: quant.QuantWeight) -> None:
        super().__init__()
        self.weight_q = weight
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = native.embedding(flat, self.weight_q)
        if rows is None:
            rows = quant.embedding(flat, self.weight_q)
        return rows.reshape(*ids.shape, self.embedding_dim)


def quant_layers(model: nn.Module) -> list[QuantLinear]:
    return [m for m in model.modules() if isinstance(m, QuantLinear)]


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as held: blocks, fp32 tensors and buffers, each once."""
    seen: set[int] = set()
    total = 0

    def count(t: torch.Tensor | None) -> None:
        nonlocal total
        if t is not None and t.data_ptr() not in seen and t.numel():
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()

    for module in model.modules():
        for p in module.parameters(recurse=False):
            count(p)
        if isinstance(module, QuantLinear):
            for part in module.parts:
                count(part.data if isinstance(part, quant.QuantWeight) else part)
                count(part.scale if isinstance(part, quant.QuantWeight) else None)
        if isinstance(module, QuantEmbedding):
            count(module.weight_q.data)
    return total


# From this many quantized weights, "auto" takes int8 activations for batches of every type
# (`activations_for`'s "auto-big"): a 7B's exact batches ran below llama.cpp's int8 ones, and
# the replies the 8-bit activations change were a small model's (docs/models.md)
BIG_MODEL_PARAMS = 10**9


def set_activations(model: nn.Module, mode: str) -> None:
    """Every QuantLinear's activations: "int8" (integer dot products where the CPU and the
    block type allow them), "fp32" (exact: within 1e-4 of the dequantized reference) or
    "auto" (per part's type and the model's size: `kernels.cpu.quant.activations_for`)."""
    layers = list(quant_layers(model))
    if mode == "auto" and sum(m.in_features * m.out_features for m in layers) >= BIG_MODEL_PARAMS:
        mode = "auto-big"
    # the layouts of the fixed-point one-row kernels under a small model's `auto` (a copy of
    # the file's blocks): Q8_0R where AVX512-VNNI runs quant_x24.c (SmolLM2's tied head 1.5x
    # the fp32 kernel; no other mode has a Q8_0R kernel, and a big model would hold a copy of
    # its Q8_0 weights); Q4_1R on the AVX2 path (quant_x24_avx2.c; its exact mode keeps Q4_1,
    # whose fp32 kernel runs 1.4x faster than on Q4_1R there; the AVX-512 path holds Q4_1R
    # in every mode: `_for_kernel`)
    repacked = {quant.Q8_0: mode == "auto" and _x24_kernels()}
    if native.isa() == "avx2":
        repacked[quant.Q4_1] = mode == "auto" and native.set_x24(None)
    # a part another module holds in the file's blocks too (a tied head's, the embedding's):
    # kept beside its repacked copy, so that going back to the file's blocks shares it again
    # instead of unpacking a second copy
    embedded = {id(e.weight_q) for e in model.modules() if isinstance(e, QuantEmbedding)}
    for m in layers:
        m.activations = mode
        kept = getattr(m, "file_parts", {})
        held = [_held(p, repacked, kept.get(i)) for i, p in enumerate(m.parts)]
        m.file_parts = {i: p for i, p in kept.items() if held[i] is not p}
        m.file_parts.update(
            {i: p for i, p in enumerate(m.parts) if id(p) in embedded and held[i] is not p}
        )
        m.parts = held


def _x24_kernels() -> bool:
    """Whether the 24-bit fixed-point one-row kernels run here (`native.set_x24`: AVX-512
    with VNNI, not turned off)"""
    return (
        native.isa() == "avx512"
        and native.set_int_isa(None) == "avx512-vnni"
        and native.set_x24(None)
    )


def _held(part: Part, repacked: dict[int, bool], original: Part | None = None) -> Part:
    """A part of a file type in `repacked` as its repacked layout (`quant.repack`) where the
    flag says so, else in the file's blocks (`original` where given, else `quant.unpack`);
    any other part as it is."""
    if not isinstance(part, quant.QuantWeight):
        return part
    file_type = quant.UNPACKED.get(part.qtype, part.qtype)
    if file_type not in repacked or repacked[file_type] == (part.qtype != file_type):
        return part
    if repacked[file_type]:
        return quant.repack(part)
    return original if original is not None else quant.unpack(part)


def choose_dense_rows(model: nn.Module, rounds: int = 3) -> int:
    """The row count from which a layer's projections run faster dequantized into sgemm than
    in the kernel, timed on the first layer's projections (0: the kernel always), or read
    from the tuning cache, which keeps it per machine, shapes and build (`tuning_key`). Set
    on every QuantLinear; returned for the log."""
    layers = quant_layers(model)
    if not layers or native.library() is None:
        return 0
    first = [m for m in layers if m.in_features == layers[0].in_features][:4] or layers[:4]
    key = tuning_key(first)
    cached = read_tuning(key)
    if cached is not None:
        chosen = int(cached)
        log.info(
            "quantized matmuls: %s (the tuning cached for this machine, model and build in %s)",
            f"dequantize + sgemm from {chosen} rows" if chosen else "the kernel at every row "
            f"count up to {DENSE_CANDIDATES[-1]}", tuning_file(),
        )  # fmt: skip
    else:
        with Progress("tuning quantized matmuls", len(DENSE_CANDIDATES), "row counts") as bar:
            chosen = _time_dense_rows(first, rounds, bar)
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
        if load <= cores:
            write_tuning(key, chosen)
        else:  # timings taken beside other work mislead (dense won at 16 rows, 3x too slow)
            log.warning(
                "quantized matmuls: tuned with the load average at %.1f on %d cores: the "
                "choice holds for this start only; a start on a quieter machine tunes again",
                load, cores,
            )  # fmt: skip
    for m in layers:
        m.dense_from = chosen
    return chosen


def _time_dense_rows(first: list[QuantLinear], rounds: int, bar: Progress) -> int:
    generator = torch.Generator().manual_seed(0)
    for rows in DENSE_CANDIDATES:
        bar.update()
        inputs = {
            m.in_features: torch.randn(rows, m.in_features, generator=generator) for m in first
        }
        times: dict[str, list[float]] = {"kernel": [], "dense": []}
        for round_ in range(rounds + 1):
            for way in times:
                start = time.perf_counter()
                for m in first:
                    m.dense_from = 1 if way == "dense" else 0
                    m(inputs[m.in_features])
                if round_:
                    times[way].append(time.perf_counter() - start)
        for m in first:
            m.dense_from = 0
        kernel, dense = (statistics.median(times[w]) for w in ("kernel", "dense"))
        if dense < kernel:
            log.info(
                "quantized matmuls: dequantize + sgemm from %d rows (%.2f ms against the "
                "kernel's %.2f ms)", rows, dense * 1e3, kernel * 1e3,
            )  # fmt: skip
            return rows
    log.info("quantized matmuls: the kernel at every row count up to %d", DENSE_CANDIDATES[-1])
    return 0


def tuning_file() -> Path:
    return cache_root() / "tuning.json"


def tuning_key(first: list[QuantLinear]) -> str:
    """What the timing depends on: the CPU, the native library's build (its file name keys
    the source, compiler, flags and CPU flags), torch, the thread count, the candidates and
    the timed projections' shapes and types."""
    lib = native.library()
    cpu = next((line for line in cpuinfo() if line.startswith("model name")), "")
    shapes = [(m.in_features, m.out_features, sorted(m.types), m.activations) for m in first]
    parts = [cpu, Path(getattr(lib, "_name", "")).name, torch.__version__]
    parts += [str(torch.get_num_threads()), str(DENSE_CANDIDATES), json.dumps(shapes)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def read_tuning(key: str) -> int | None:
    try:
        entry = json.loads(tuning_file().read_text()).get(key)
    except (OSError, ValueError):
        return None
    return entry.get("dense_from") if isinstance(entry, dict) else None


def write_tuning(key: str, dense_from: int) -> None:
    """Add the result to the cache file (atomically: a concurrent start sees all or none)."""
    path = tuning_file()
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        entries = {}
    entries[key] = {"dense_from": dense_from, "measured": time.strftime("%Y-%m-%d %H:%M")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_suffix(f".{os.getpid()}.tmp")
        staging.write_text(json.dumps(entries, indent=1))
        staging.replace(path)
    except OSError as e:
        log.warning("the tuning cache %s is not writable (%s): the next start tunes again", path, e)


PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def install(model: nn.Module, state: dict[str, Part]) -> None:
    """Fill a decoder built on the meta device from `state` (Hugging Face names, as
    `gguf_file.read_state` gives them): quantized matrices become QuantLinear /
    QuantEmbedding, fp32 ones plain modules, vectors parameters. Raises CheckpointError
    naming what is missing or left over, as `load_weights` does for safetensors."""
    used: set[str] = set()

    def take(name: str) -> list[Part] | None:
        for names in checkpoint_names(name):
            if all(n in state for n in names):
                used.update(names)
                # popped: once a fused projection has joined its parts, they are freed at
                # once (held to the end, a 7B load peaked at twice the weights)
                return [state.pop(n) for n in names]
        return None

    def bias_of(name: str) -> torch.Tensor | None:
        found = take(name)
        return None if found is None else torch.cat([torch.as_tensor(b) for b in found])

    def linear(parts: list[Part], bias: torch.Tensor | None) -> nn.Module:
        if all(isinstance(p, torch.Tensor) for p in parts):
            weight = torch.cat(parts) if len(parts) > 1 else parts[0]
            module = nn.Linear(weight.shape[1], weight.shape[0], bias is not None)
            module.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
            if bias is not None:
                module.bias = nn.Parameter(bias, requires_grad=False)
            return module
        return QuantLinear(parts, bias)

    missing: list[str] = []
    for i, layer in enumerate(model.layers):
        for proj in PROJECTIONS:
            parts = take(f"layers.{i}.{proj}.weight")
            if parts is None:
                missing.append(f"layers.{i}.{proj}.weight")
                continue
            bias = (
                bias_of(f"layers.{i}.{proj}.bias")
                if getattr(layer, proj).bias is not None
                else None
            )
            setattr(layer, proj, linear(parts, bias))
    embed = take("embed_tokens.weight")
    if embed is None:
        raise CheckpointError("checkpoint has no token embedding (model.embed_tokens.weight)")
    if isinstance(embed[0], quant.QuantWeight):
        model.embed_tokens = QuantEmbedding(embed[0])
    else:
        model.embed_tokens = nn.Embedding.from_pretrained(embed[0].contiguous(), freeze=True)
    if model.lm_head is None:  # tied: the head multiplies from the embedding's blocks
        model.quant_head = (
            QuantLinear([embed[0]]) if isinstance(embed[0], quant.QuantWeight) else None
        )
    else:
        head = take("lm_head.weight")
        if head is None:
            missing.append("lm_head.weight")
        else:
            model.lm_head = linear(head, None)
            model.quant_head = model.lm_head if isinstance(model.lm_head, QuantLinear) else None
    for name, param in list(model.named_parameters()):
        if not param.is_meta:
            continue
        found = take(name)
        if found is None:
            missing.append(name)
            continue
        owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        value = torch.cat(found) if len(found) > 1 else found[0]
        if tuple(value.shape) != tuple(param.shape):
            raise CheckpointError(
                f"weight {name}: shape {tuple(value.shape)}, the config implies "
                f"{tuple(param.shape)}"
            )
        setattr(
            owner,
            name.rpartition(".")[2],
            nn.Parameter(value.float().contiguous(), requires_grad=False),
        )
    unexpected = sorted(set(state) - used)
    if missing or unexpected:
        raise CheckpointError(
            "GGUF does not match its config: "
            + (f"missing {missing[:8]}" if missing else "")
            + (f" unexpected {unexpected[:8]}" if unexpected else "")
        )
