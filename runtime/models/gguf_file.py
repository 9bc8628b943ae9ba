"""A GGUF file's tensors under Hugging Face names, the matrices kept in their quantized blocks.

llama.cpp's files store each weight matrix row by row (one row per output feature, each row
whole blocks of its type), which is the layout the quantized kernels read
(`radixflow.kernels.quant.QuantWeight`): the file's bytes are the weights, with no
conversion and no fp32 copy. So a 98 MB SmolLM2 file is about 98 MB of weights in memory,
not the 540 MB of its fp32 form, and a 4.4 GB 7B file fits a 24 GiB machine.

- Kept as blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16 (`KEPT`). Any
  other type is dequantised here with gguf's reference, with a log line naming the type and
  what the fp32 copy costs. F32 matrices stay fp32 and take the plain fp32 path.
- Vectors (norms, biases) become fp32 tensors.
- The names are mapped back through gguf's own table (`gguf.get_tensor_name_map`), and the
  two changes llama.cpp's converter makes are undone as transformers' GGUF loader undoes
  them: q and k rows of the `llama` architecture are permuted for its rope layout (undone on
  whole rows, so on quantized rows too), and Gemma's norm weights are stored plus one.
- Matrices used as stored are mapped from the file, as llama.cpp does (`map_file`): no copy,
  pages shared with the page cache (and with another server on the same file), 2 MiB
  mappings where the kernel keeps the file in large folios. Under memory pressure the kernel
  may drop clean file pages and read them back mid-step; --disable-mmap reads every tensor
  into process memory instead. Projections joined at load (q, k, v; gate, up) and converted
  tensors are read, not mapped, so no range is held twice.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from radixflow.kernels import quant
from radixflow.runtime.models import joined
from radixflow.runtime.models.progress import Progress

log = logging.getLogger(__name__)

T = gguf.GGMLQuantizationType
KEPT = frozenset(
    int(T[name])
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16")
)
SPLIT = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
FUSED = ("self_attn.qkv_proj", "mlp.gate_up_proj")  # Phi-3 stores these fused
LAYER_MODULES = (
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "mlp.down_proj",
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
Weight = quant.QuantWeight | torch.Tensor
# llama.cpp's precomputed rope factors (Llama 3's `rope_freqs`, Phi-3's LongRoPE pair): the
# rope is built from the config, as transformers' GGUF loader does, so they are not weights
ROPE_TABLES = ("rope_freqs", "rope_factors_long", "rope_factors_short")


SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
STRING, ARRAY = 8, 9
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: the innermost (row length) first
    qtype: int
    offset: int  # bytes from the start of the file


class Layout:
    """A GGUF file's metadata and tensor table, read in one pass with `struct`.

    gguf's GGUFReader builds numpy views for every metadata value, about 500,000 of them for a
    49,152-token vocabulary (seconds per start); the weights need only the architecture and
    the tensor table, so the tokenizer's arrays are skipped over."""

    def __init__(self, path: Path) -> None:
        self._path, self._size = path, path.stat().st_size
        with path.open("rb") as f:
            self._data, self._pos, self._base, self._file = f.read(1 << 20), 0, 0, f
            magic, version = self._read("<4sI")
            if magic != b"GGUF" or version < 2:
                raise ValueError(f"{path}: not a GGUF file of version 2 or later")
            n_tensors, n_kv = self._read("<QQ")
            if n_tensors > self._size or n_kv > self._size:  # each takes bytes of the file
                raise ValueError(
                    f"{path}: its header counts {n_tensors:,} tensors and {n_kv:,} metadata "
                    "entries, more than the file could hold (a damaged file)"
                )
            self.fields: dict[str, Any] = {}
            for _ in range(n_kv):
                key = self._string()
                (kind,) = self._read("<I")
                self.fields[key] = self._value(kind, keep=not key.startswith("tokenizer."))
            tensors = []
            for _ in range(n_tensors):
                name = self._string()
                (n_dims,) = self._read("<I")
                if not 1 <= n_dims <= MAX_DIMS:
                    raise ValueError(f"{path}: tensor {name} has {n_dims} dimensions")
                dims = self._read(f"<{n_dims}Q")
                qtype, offset = self._read("<IQ")
                tensors.append((name, tuple(dims), qtype, offset))
            align = int(self.fields.get("general.alignment", 32))
            start = (self._base + self._pos + align - 1) // align * align
        self.tensors = [TensorInfo(n, d, q, start + o) for n, d, q, o in tensors]
        self._data = b""  # the header's bytes: parsed, not kept (read_layout caches layouts)

    def _need(self, n: int) -> None:
        if self._base + self._pos + n > self._size:
            raise ValueError(
                f"{self._path}: its metadata runs past the end of the file (cut short or damaged)"
            )
        if self._pos + n > len(self._data):
            rest = self._data[self._pos :]
            self._base += self._pos
            self._data, self._pos = rest + self._file.read(max(n, 1 << 20)), 0

    def _read(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        self._need(size)
        values = struct.unpack_from(fmt, self._data, self._pos)
        self._pos += size
        return values

    def _string(self) -> str:
        (n,) = self._read("<Q")
        self._need(n)
        text = self._data[self._pos : self._pos + n]
        self._pos += n
        return text.decode("utf-8", "replace")

    def _skip_strings(self, count: int) -> None:
        length = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if self._pos + 8 > len(self._data):
                self._need(8)
            (n,) = length(self._data, self._pos)
            self._pos += 8
            if self._pos + n > len(self._data):
                self._need(n)
            self._pos += n

    def _value(self, kind: int, keep: bool) -> Any:
        if kind in SCALARS:
            return self._read("<" + SCALARS[kind])[0]
        if kind == STRING:
            return self._string()
        if kind != ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, count = self._read("<IQ")
        if item in SCALARS and not keep:  # skipped in one step
            size = struct.calcsize(SCALARS[item]) * count
            self._need(size)
            self._pos += size
            return None
        if item == STRING and not keep:  # a vocabulary: lengths read, text never decoded
            self._skip_strings(count)
            return None
        values = [self._value(item, keep) for _ in range(count)]
        return values if keep else None


def read_layout(path: Path) -> Layout:
    """`Layout(path)`, parsed once while the file's header stays as it is: a start asks for
    the layout of its GGUF from several places (memory plan, card, sampling defaults,
    weights), and parsing a 7B file's header (its 49,152-entry vocabulary skipped over) took
    0.13 s each time. A layout depends only on the file's size and its bytes up to the first
    tensor, so those are compared (a read of the header, about a millisecond): a rewritten
    file, even one of the same size and time stamp, is parsed again."""
    key = str(path.resolve())
    size = path.stat().st_size
    cached = _LAYOUTS.get(key)
    if cached is not None and cached[0] == size:
        with path.open("rb") as f:
            if f.read(len(cached[1])) == cached[1]:
                return cached[2]
    layout = Layout(path)
    header = min((t.offset for t in layout.tensors), default=size)
    with path.open("rb") as f:
        _LAYOUTS[key] = (size, f.read(header), layout)
    while len(_LAYOUTS) > 8:  # the oldest first
        _LAYOUTS.pop(next(iter(_LAYOUTS)))
    return layout


_LAYOUTS: dict[str, tuple[int, bytes, Layout]] = {}  # path -> (size, header bytes, layout)


def architecture(layout: Layout) -> str:
    if not isinstance(layout.fields.get("general.architecture"), str):
        raise ValueError("the GGUF file names no general.architecture")
    return layout.fields["general.architecture"]


def _name_map(arch_name: str, num_layers: int, fused: bool) -> dict[str, str]:
    """GGUF tensor base name -> Hugging Face module name, for this architecture's tensors."""
    arch = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}[arch_name]
    table = gguf.get_tensor_name_map(arch, num_layers)
    modules = ["model.embed_tokens", "model.norm", "lm_head"]
    for i in range(num_layers):
        own = (*LAYER_MODULES, *(FUSED if fused else SPLIT))
        modules += [f"model.layers.{i}.{m}" for m in own]
    names = {}
    for module in modules:
        base = table.get_name(module)
        if base is not None:
            names[base] = module
    return names


def _unpermuted(rows: int, heads: int) -> np.ndarray:
    """Where each of a q or k matrix's rows goes to undo llama.cpp's rope permutation: row
    (head h, i, parity p) of the file is row (h, p, i) of the model (whole rows: any type)."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, 2, half).transpose(0, 2, 1).reshape(-1)


def _rope_heads(
    tensor: TensorInfo, names: dict[str, str], arch: str, heads: tuple[int, int]
) -> int:
    """The heads of a llama q or k matrix, whose rows `_pread` puts back in order; else 0."""
    base = tensor.name.rpartition(".")[0]
    if arch != "llama" or base not in names or len(tensor.dims) != 2:
        return 0
    return heads[0] if base.endswith(".attn_q") else heads[1] if base.endswith(".attn_k") else 0


def read_state(path: Path, hf_config: Any, mapped: bool = True) -> dict[str, Weight]:
    """Hugging Face name -> weight: a QuantWeight for each matrix of a kept type, else an
    fp32 tensor. With `mapped`, a matrix used as the file stores it is a view of the file's
    memory map (`map_file`); the rest (matrices joined or permuted at load, vectors, types
    without a kernel) are read into process memory. Raises ValueError for a file whose table
    does not fit the file (`check_table`) or a tensor it cannot place, before any weight is
    read."""
    layout = read_layout(path)
    arch = architecture(layout)
    fused = "phi3" in arch
    names = _name_map(arch, hf_config.num_hidden_layers, fused)
    check_table(layout, path)
    state: dict[str, Weight] = {}
    costs: dict[str, int] = {}
    total = sum(_tensor_bytes(t)[1] for t in layout.tensors)
    whole = map_file(path) if mapped else None
    verb = "mapping" if mapped else "reading"
    with (
        path.open("rb", buffering=0) as file,
        Progress(f"{verb} the weights of {path.name}", total, "B") as bar,
        ThreadPoolExecutor(READERS) as readers,
    ):
        # read, not mapped: joined, permuted or converted, so the copy is what is kept. The
        # reads run on READERS threads at once (a read copies from the page cache and faults
        # in its fresh pages, in the kernel, without the GIL: a 7B file's 2.7 GB of joined
        # projections took 1.3 s on one thread)
        pending = [
            (tensor, None if whole is None or not _used_as_stored(tensor, names, arch)
             else whole[tensor.offset : tensor.offset + _tensor_bytes(tensor)[1]])
            for tensor in layout.tensors
        ]  # fmt: skip
        fd, rope = file.fileno(), (hf_config.num_attention_heads, hf_config.num_key_value_heads)
        targets = _join_targets([t for t, data in pending if data is None], names)
        reads = {
            tensor.name: readers.submit(
                _pread,
                fd,
                tensor,
                path,
                _rope_heads(tensor, names, arch, rope),
                targets.get(tensor.name),
            )  # fmt: skip
            for tensor, data in pending
            if data is None
        }
        for tensor, data in pending:
            rows, size = _tensor_bytes(tensor)
            data = reads[tensor.name].result() if data is None else data
            bar.update(size)
            _read_tensor(
                tensor, data.reshape(rows, -1), path, names, arch, state, costs,
                targets.get(tensor.name),
            )  # fmt: skip
    for type_name, cost in costs.items():
        log.warning(
            "%s: %s matrices have no quantized kernel: dequantised to fp32 at load (%.1f MiB)",
            path.name, type_name, cost / 2**20,
        )  # fmt: skip
    return state


READERS = 2  # threads reading the tensors that are copied into memory
IOV_MAX = 1024  # buffers one preadv takes (Linux)


def _join_targets(tensors: list[TensorInfo], names: dict[str, str]) -> dict[str, torch.Tensor]:
    """tensor name -> the rows of the joined matrix it is read into (`joined.join_targets`:
    the kept matrices among the projections a model joins at load)."""
    matrices, tensor_of = {}, {}
    for t in tensors:
        base = t.name.rpartition(".")[0]
        if len(t.dims) == 2 and T(t.qtype) in KEPT and base in names:
            rows, size = _tensor_bytes(t)
            matrices[names[base]] = (t.qtype, int(t.dims[0]), rows, size // rows)
            tensor_of[names[base]] = t.name
    return {tensor_of[m]: rows for m, rows in joined.join_targets(matrices).items()}


def _pread(
    fd: int, tensor: TensorInfo, path: Path, rope_heads: int = 0, into: torch.Tensor | None = None
) -> np.ndarray:
    """The tensor's bytes read from the file at its offset (any thread: no shared position),
    into `into` where given. With `rope_heads`, a q or k matrix's rows land where
    `_unpermuted` puts them: one copy from the page cache, in the kernel (a permutation after
    the read took a 7B file 1.8 s on one thread)."""
    rows, size = _tensor_bytes(tensor)
    data = np.empty(size, dtype=np.uint8) if into is None else into.numpy().reshape(-1)
    if rope_heads:
        width = size // rows
        whole = memoryview(data)  # sliced per row (numpy slicing per row cost 4 us a row)
        pending = [
            whole[d * width : (d + 1) * width] for d in _unpermuted(rows, rope_heads).tolist()
        ]
    else:
        pending = [memoryview(data)]
    offset, at = tensor.offset, 0  # pending[at:] is what is left to fill
    while at < len(pending):
        got = os.preadv(fd, pending[at : at + IOV_MAX], offset)
        if got == 0:
            raise ValueError(f"{path}: tensor {tensor.name} is cut short (the file ends)")
        offset += got
        while got:  # the buffers filled dropped, one filled in part cut
            if got >= len(pending[at]):
                got, at = got - len(pending[at]), at + 1
            else:
                pending[at], got = pending[at][got:], 0
    return data


def map_file(path: Path) -> np.ndarray:
    """The whole file as a uint8 array over a private (copy-on-write) memory map: its pages
    are the page cache's, shared with every process mapping the file, and where the kernel
    holds the file in large folios (ext4, XFS on Linux 6.x) they are mapped 2 MiB at a time."""
    with path.open("rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    return np.frombuffer(mapping, dtype=np.uint8)


def _used_as_stored(tensor: TensorInfo, names: dict[str, str], arch: str) -> bool:
    """Whether `_read_tensor` keeps the tensor's bytes as they are: a matrix of a kept type
    that is not one of the projections joined at load (SPLIT) nor a permuted q or k."""
    base = tensor.name.rpartition(".")[0]
    if len(tensor.dims) != 2 or tensor.qtype not in KEPT or base not in names:
        return False
    if arch == "llama" and base.endswith((".attn_q", ".attn_k")):
        return False
    return not names[base].endswith(SPLIT)


def check_table(layout: Layout, path: Path) -> None:
    """Every tensor's type known, its row length whole blocks of its type, and its bytes
    inside the file: checked before anything is read or allocated, so a damaged or truncated
    file is refused with the tensor's name instead of failing (or faulting) mid-load."""
    file_size = path.stat().st_size
    for tensor in layout.tensors:
        try:
            qtype = T(tensor.qtype)
            block, _ = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ValueError(
                f"{path}: tensor {tensor.name} has type {tensor.qtype}, which this GGUF reader "
                "does not know"
            ) from None
        if not tensor.dims or any(d <= 0 for d in tensor.dims) or tensor.dims[0] % block:
            raise ValueError(
                f"{path}: tensor {tensor.name} ({qtype.name}) has shape {list(tensor.dims)}: "
                f"its rows must be whole blocks of {block}"
            )
        _, size = _tensor_bytes(tensor)
        if tensor.offset + size > file_size:
            raise ValueError(
                f"{path}: tensor {tensor.name} is cut short: its {size:,} bytes at offset "
                f"{tensor.offset:,} run past the end of the file ({file_size:,} bytes)"
            )


def _tensor_bytes(tensor: TensorInfo) -> tuple[int, int]:
    """(rows, bytes) of a tensor's data in the file."""
    block, size = gguf.GGML_QUANT_SIZES[T(tensor.qtype)]
    rows = math.prod(tensor.dims[1:])  # Python ints: a damaged shape cannot wrap around
    return rows, rows * (tensor.dims[0] // block * size)


def _read_tensor(
    tensor: TensorInfo,
    data: np.ndarray,
    path: Path,
    names: dict[str, str],
    arch: str,
    state: dict[str, Weight],
    costs: dict[str, int],
    target: torch.Tensor | None = None,
) -> None:
    """One tensor (`data`: its rows of bytes as read) into `state` under its Hugging Face
    name: kept block types as QuantWeights over those bytes, the rest dequantized to fp32
    (their bytes added to `costs` by type)."""
    base, _, kind = tensor.name.rpartition(".")
    if base in ROPE_TABLES:
        return
    if base not in names:
        raise ValueError(f"{path}: tensor {tensor.name} has no place in a {arch} model")
    name = f"{names[base]}.{kind}"
    qtype = T(tensor.qtype)
    rows = data.shape[0]
    matrix = len(tensor.dims) == 2
    if matrix and qtype in KEPT:  # `target`: the rows of a joined matrix it was read into
        raw = torch.from_numpy(np.ascontiguousarray(data)) if target is None else target
        state[name] = quant.QuantWeight(int(qtype), raw, (rows, int(tensor.dims[0])))
        return
    shape = [int(d) for d in reversed(tensor.dims)]
    if qtype == T.F32:
        values = np.array(data).view(np.float32).reshape(shape)
    elif qtype == T.F16:
        values = np.array(data).view(np.float16).astype(np.float32).reshape(shape)
    else:
        values = gguf.quants.dequantize(np.array(data), qtype).reshape(shape)
        if matrix and qtype != T.BF16:
            costs[qtype.name] = costs.get(qtype.name, 0) + values.size * 4
    value = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    if arch.startswith("gemma") and kind == "weight" and base.endswith("norm"):
        value = value - 1  # llama.cpp stores Gemma's (1 + w) norms as 1 + w
    state[name] = value
