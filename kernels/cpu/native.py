"""Native CPU kernels (`kernels/cpu/native.c`), built at first use with the system C compiler and
called through ctypes: decode attention over keys read in place, RMSNorm with its residual
add, silu·up, rotary embedding, KV stores and the greedy argmax, each one pass over fp32
tensors.

Why: at 64 decode streams, torch's fused attention runs each (request, KV head) as tiny
matmuls (3 query rows) and spent 515 us a layer at 85 keys where this loop takes 262 us
(2 threads, SmolLM2's shapes); eager RMSNorm, rope and silu·up are 4-6 passes of small
ops each, 50-90 us a layer at 64 rows, where one loop takes a few.

- Built once per machine into a cache directory (`RADIXFLOW_CACHE`, else ~/.cache/radixflow),
  keyed by the source (and the files it includes), the compiler, its flags and the CPU's
  flags (-march=native). A missing compiler, a failed build or `RADIXFLOW_NATIVE=0` leaves
  `library()` None, and every caller keeps its torch path: the torch ops stay the reference,
  and the tests (tests/kernels/cpu/test_native.py) hold these to them.
- Threads: linked against the OpenMP runtime torch has loaded (libgomp, found by its
  soname), so both share one pool; each call passes torch's thread count. A torch without
  libgomp gets a single-threaded build.
- Every wrapper takes fp32 CPU tensors whose innermost dims are contiguous, and returns
  None (the caller's cue to use torch) for anything else; KV pools may also be bf16
  or fp16 (--kv-cache-dtype): loaded widened to fp32, stored rounded to nearest even; or
  int8 with per-(slot, head) scales (`kernels/kv_int8.py`'s Int8KV): stored quantized,
  loaded as int8 * scale.
- A decode-only step's rope, KV store and attention are one call
  (`rope_decode_attention`, taken by the layer through `AttentionOps`): the per-call
  Python and ctypes work and the rotated copy of q and k are paid once a layer, not twice.
  Its two halves, `rf_rope_store` and `rf_team_attention` (the tasks shared by an OpenMP team
  that is already running), are called only by the compiled decode loop's team path
  (kernels/cpu/decode_team.h), whose tests hold them to this call bit for bit.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from radixflow.kernels.kv_int8 import Int8KV

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("native.c")
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-shared", "-fPIC"]
_P, _I, _F, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
SIGNATURES = {  # name: (restype, argtypes)
    "rf_decode_attention": (
        _C,
        [_P, _I, _P, _P, _P, _P, _P, _C, _C, _C, _C, _F, _F, _P, _P, _C, _C, _P, _P],
    ),
    "rf_rms_norm": (None, [_P, _I, _P, _I, _P, _F, _I, _I, _P, _P, _C]),
    "rf_silu_mul": (None, [_P, _I, _I, _I, _P, _C]),
    "rf_rope": (
        _I,
        [_P, _I, _P, _P, _I, _I, _I, _I, _P, _P, _P, _I, _P, _I, _P, _I, _C, _C, _P, _P],
    ),
    "rf_store_kv": (_I, [_P, _P, _I, _P, _P, _I, _P, _I, _I, _I, _C, _P, _P, _I]),
    "rf_rope_decode_attention": (
        _I,
        [_P, _I, _P, _P, _I, _P, _P, _I, _P, _P, _P, _P, _C, _C, _C, _C, _F, _F, _P, _P, _C, _C]
        + [_P, _P],
    ),
    "rf_argmax": (None, [_P, _I, _I, _I, _P, _P, _C]),
    "rf_run_table": (_I, [_P, _I, _P, _C, _P, _P, _P]),
}
_state: dict[str, ctypes.CDLL | None] = {}
_lock = threading.Lock()


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on the first call; None where they cannot be had."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"] = _load()
    return _state["lib"]


def _openmp_flag() -> list[str]:
    """-fopenmp where torch runs on libgomp (already mapped: our library binds to that copy
    by soname), else OpenMP's simd pragmas only, single-threaded."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        maps = ""
    return ["-fopenmp"] if "libgomp" in maps else ["-fopenmp-simd"]


def _load() -> ctypes.CDLL | None:
    return build(SOURCE, "kernels", FLAGS, SIGNATURES)


def build(
    source: Path, name: str, flags: list[str], signatures: dict[str, tuple[object, list[object]]]
) -> ctypes.CDLL | None:
    """`source` compiled (with `flags` and the OpenMP flag) into `name`-<key>.so in the cache
    directory, keyed by the source and every file it includes (`sources`), the compiler, its
    flags and the CPU's flags, and loaded with `signatures` ({function: (restype, argtypes)})
    set; None where `RADIXFLOW_NATIVE=0`, no compiler or a failed build (logged)."""
    if os.environ.get("RADIXFLOW_NATIVE", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("no C compiler found: native CPU kernels off, torch ops used")
        return None
    flags = flags + _openmp_flag()
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
        cpu = next((line for line in cpuinfo() if line.startswith("flags")), "")
        texts = sources(source)
        key = hashlib.sha256("\0".join([*texts, compiler, version, *flags, cpu]).encode())
        key = key.hexdigest()[:16]
        root = Path(os.environ.get("RADIXFLOW_CACHE") or Path.home() / ".cache" / "radixflow")
        target = root / "native" / f"{name}-{key}.so"
        if not target.exists():
            log.info("compiling %s for this CPU (once per machine and build)", source.name)
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                result = subprocess.run(
                    [compiler, *flags, str(source), "-o", str(built), "-lm"],
                    capture_output=True, text=True, timeout=300,
                )  # fmt: skip
                if result.returncode != 0:
                    log.warning("%s failed to build: %s", source.name, result.stderr[-2000:])
                    return None
                os.replace(built, target)  # atomic: other processes see all of it or none
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("native CPU kernels of %s unavailable (%s): torch ops used", source.name, e)
        return None
    for function_name, (restype, argtypes) in signatures.items():
        function = getattr(lib, function_name)
        function.restype, function.argtypes = restype, argtypes
    return lib


def sources(source: Path) -> list[str]:
    """The text of `source` and of every file it includes (`#include "name"` at the start of a
    line, found beside the including file), followed to any depth, each file once: what a build
    is keyed by, so that an edit to any of them builds anew. Raises OSError where one cannot
    be read."""
    texts: list[str] = []
    seen: set[Path] = set()
    pending = [source]  # a stack: depth first, in include order
    while pending:
        path = pending.pop()
        if path.resolve() in seen:
            continue
        seen.add(path.resolve())
        texts.append(path.read_text())
        included = re.findall(r'^#include "([^"]+)"', texts[-1], re.MULTILINE)
        pending.extend(path.parent / name for name in reversed(included))
    return texts


def cpuinfo() -> list[str]:
    """/proc/cpuinfo's lines (none where it cannot be read)."""
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def _fits(*tensors: torch.Tensor) -> bool:
    for t in tensors:
        if t.dtype is not torch.float32 or not t.is_cpu:
            return False
    return True


def _pool_kind(k_pool: torch.Tensor | Int8KV, v_pool: torch.Tensor | Int8KV) -> int | None:
    """The kernels' kv_type for a pair of contiguous CPU pools of one shape: 0 fp32, 1 bf16,
    2 fp16, 3 int8 (an Int8KV pair, scales (num_slots, Hkv) fp32); None for anything else."""
    if isinstance(k_pool, Int8KV) or isinstance(v_pool, Int8KV):
        quantized = isinstance(k_pool, Int8KV) and isinstance(v_pool, Int8KV)
        fits = quantized and all(
            p.is_cpu
            and p.is_contiguous()
            and p.data.dtype == torch.int8
            and p.scale.dtype == torch.float32
            and p.scale.shape == p.shape[:-1]
            and p.shape == k_pool.shape
            for p in (k_pool, v_pool)
        )
        return 3 if fits else None
    if not (
        k_pool.is_cpu
        and k_pool.dtype == v_pool.dtype
        and k_pool.shape == v_pool.shape
        and k_pool.is_contiguous()
        and v_pool.is_contiguous()
    ):
        return None
    return {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}.get(k_pool.dtype)


def _pointers(pool: torch.Tensor | Int8KV) -> tuple[int, int | None]:
    """(data address, scales' address or None) of a pool the kernels take."""
    if isinstance(pool, Int8KV):
        return pool.data.data_ptr(), pool.scale.data_ptr()
    return pool.data_ptr(), None


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor | Int8KV,
    v_pool: torch.Tensor | Int8KV,
    runs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scale: float,
    logit_cap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """q (B, H, D) (rows any stride, heads contiguous) over pooled keys (num_slots, Hkv, D)
    (fp32, bf16, fp16, or an Int8KV: int8 with scales),
    request b reading the runs run_indptr[b] .. run_indptr[b + 1] - 1 of consecutive slots
    (first slot, count), `runs` = (run_indptr, first, count) -> out (B, H, D), lse (B, H);
    a request with no runs gets zeros and lse -inf. `logit_cap` > 0 soft-caps the scaled
    scores (cap * tanh(s / cap)), as the reference does. The torch twin is the gathering path
    of cpu_attention (and reference.decode_attention the spec). None where not taken."""
    lib = library()
    b, h, d = q.shape
    hkv = k_pool.shape[1]
    kind = _pool_kind(k_pool, v_pool)
    if (
        lib is None
        or kind is None
        or not _fits(q)
        or q.stride()[1:] != (d, 1)
        or k_pool.shape[2] != d
        or h % hkv
    ):
        return None
    run_indptr, first, count = runs
    out = torch.empty((b, h, d))
    lse = torch.empty((b, h))
    (k_data, k_scale), (v_data, v_scale) = _pointers(k_pool), _pointers(v_pool)
    status = lib.rf_decode_attention(
        q.data_ptr(), q.stride(0), k_data, v_data, run_indptr.data_ptr(),
        first.data_ptr(), count.data_ptr(), b, hkv, h // hkv, d, scale, logit_cap, out.data_ptr(),
        lse.data_ptr(), torch.get_num_threads(), kind, k_scale, v_scale,
    )  # fmt: skip
    return (out, lse) if status == 0 else None


def rope_decode_attention(
    qkv: torch.Tensor,
    num_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pool: torch.Tensor | Int8KV,
    v_pool: torch.Tensor | Int8KV,
    slots: torch.Tensor,
    runs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scale: float,
    logit_cap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A decode step's attention from its fused projection, in one call: `rope` with its
    store, then `decode_attention`, on qkv (B, (H + 2 Hkv) * D) (rows any stride) whose query
    and key heads are rotated in place (the caller's q is then qkv's first H heads). cos/sin
    (B, 1, R) contiguous; k_pool, v_pool, slots, runs, scale, logit_cap as in those two.
    -> (out (B, H, D), lse (B, H)); None (nothing touched) where not taken. Raises IndexError
    for a slot outside the pool (keys then partly stored, nothing attended), MemoryError
    when the kernel cannot allocate."""
    lib = library()
    b, hkv, d = qkv.shape[0], k_pool.shape[1], k_pool.shape[2]
    kind = _pool_kind(k_pool, v_pool)
    if (
        lib is None
        or kind is None
        or qkv.dim() != 2
        or qkv.shape[1] != (num_heads + 2 * hkv) * d
        or qkv.stride(1) != 1
        or num_heads % hkv
        or not _fits(qkv, cos, sin)
        or not (cos.is_contiguous() and sin.is_contiguous() and cos.numel() == sin.numel())
        or cos.numel() != b * cos.shape[-1]
        or slots.dtype != torch.int64
        or not slots.is_contiguous()
        or len(slots) != b
    ):
        return None
    out = torch.empty((b, num_heads, d))
    lse = torch.empty((b, num_heads))
    run_indptr, first, count = runs
    (k_data, k_scale), (v_data, v_scale) = _pointers(k_pool), _pointers(v_pool)
    status = lib.rf_rope_decode_attention(
        qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), cos.shape[-1],
        k_data, v_data, k_pool.shape[0], slots.data_ptr(),
        run_indptr.data_ptr(), first.data_ptr(), count.data_ptr(), b, hkv, num_heads // hkv, d,
        scale, logit_cap, out.data_ptr(), lse.data_ptr(), torch.get_num_threads(), kind,
        k_scale, v_scale,
    )  # fmt: skip
    if status > 0:
        raise IndexError(f"{status} of {b} slots outside the pool of {k_pool.shape[0]}")
    if status == -2:  # qkv is rotated and the keys stored by now: no torch path can follow
        raise MemoryError("native decode attention could not allocate its task list")
    return (out, lse) if status == 0 else None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(hidden, weight * RMSNorm(hidden)) for hidden = x + residual (x itself when residual
    is None) over x's rows (T, dim); the torch twin is layers.rms_norm. None where not
    taken."""
    lib = library()
    if lib is None or x.dim() != 2 or not _fits(x, weight) or x.stride(-1) != 1:
        return None
    if residual is not None and (
        not _fits(residual) or residual.shape != x.shape or residual.stride(-1) != 1
    ):
        return None
    rows, dim = x.shape
    out = torch.empty((rows, dim))
    hidden = torch.empty((rows, dim)) if residual is not None else x
    lib.rf_rms_norm(
        x.data_ptr(), x.stride(0),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        weight.contiguous().data_ptr(), eps, rows, dim,
        None if residual is None else hidden.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return hidden, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of gate_up (T, 2 * inter), its two halves; None where not taken."""
    lib = library()
    if lib is None or gate_up.dim() != 2 or not _fits(gate_up) or gate_up.stride(-1) != 1:
        return None
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inter))
    lib.rf_silu_mul(
        gate_up.data_ptr(), gate_up.stride(0), rows, inter, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """`rope.rope_qk`: x (T, heads, D) (rows any stride, heads contiguous) rotated by cos
    and sin (T, 1, R) -> (T, heads, D) contiguous; None where not taken. With `store` =
    (k_pool, v_pool, slots, v), the rotated keys (the last Hkv heads of each row, Hkv the
    pools' heads) and v (T, Hkv, D) are also written at `slots` of the pools, as `store_kv`
    does, in the same pass; None (nothing stored) where that is not taken. Raises IndexError
    for a slot outside the pool."""
    lib = library()
    t, heads, d = x.shape
    if lib is None or not _fits(x, cos, sin) or x.stride()[1:] != (d, 1):
        return None
    k_pool = v_pool = slots = v = None
    if store is not None:
        k_pool, v_pool, slots, v = store
        if not _store_fits(k_pool, v_pool, slots, v) or k_pool.shape[1] > heads:
            return None
    rotary = cos.shape[-1]
    cos, sin = cos.reshape(t, rotary).contiguous(), sin.reshape(t, rotary).contiguous()
    out = torch.empty((t, heads, d))
    bad = lib.rf_rope(
        x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), t, heads, d, rotary,
        out.data_ptr(),
        *((None, None, 0, None, 0, None, 0) if store is None else (
            _pointers(k_pool)[0], _pointers(v_pool)[0], k_pool.shape[0], slots.data_ptr(),
            k_pool.shape[1], v.data_ptr(), v.stride(0),
        )),
        torch.get_num_threads(), 0 if store is None else _pool_kind(k_pool, v_pool),
        *((None, None) if store is None else (_pointers(k_pool)[1], _pointers(v_pool)[1])),
    )  # fmt: skip
    if bad:
        raise IndexError(f"{bad} of {t} slots outside the pool of {k_pool.shape[0]}")
    return out


def _store_fits(
    k_pool: torch.Tensor | Int8KV,
    v_pool: torch.Tensor | Int8KV,
    slots: torch.Tensor,
    v: torch.Tensor,
) -> bool:
    """Whether the native store takes these: fp32, bf16, fp16 or int8 (Int8KV) contiguous
    pools (num_slots, Hkv, D)
    of one shape and dtype, int64 contiguous slots, one fp32 row of v per slot (rows any
    stride, heads contiguous)."""
    return (
        _pool_kind(k_pool, v_pool) is not None
        and _fits(v)
        and slots.dtype == torch.int64
        and slots.is_contiguous()
        and len(slots) == v.shape[0]
        and v.shape[1:] == k_pool.shape[1:]
        and v.stride()[1:] == (v.shape[2], 1)
    )


def store_kv(
    k_pool: torch.Tensor | Int8KV,
    v_pool: torch.Tensor | Int8KV,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> bool:
    """`reference.store_kv` (rows (n, Hkv, D) into pools (num_slots, Hkv, D) at slots) as
    one copy loop; False where not taken. Raises IndexError for a slot outside the pool."""
    lib = library()
    if (
        lib is None
        or not _store_fits(k_pool, v_pool, slots, v)
        or k.shape != v.shape
        or not _fits(k)
        or k.stride()[1:] != (k.shape[2], 1)
    ):
        return False
    width = k_pool.shape[1] * k_pool.shape[2]
    (k_data, k_scale), (v_data, v_scale) = _pointers(k_pool), _pointers(v_pool)
    bad = lib.rf_store_kv(
        k_data, v_data, k_pool.shape[0], slots.data_ptr(),
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), len(slots), width,
        _pool_kind(k_pool, v_pool), k_scale, v_scale, k_pool.shape[2],
    )  # fmt: skip
    if bad:
        raise IndexError(f"{bad} of {len(slots)} slots outside the pool of {k_pool.shape[0]}")
    return True


def argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(values, indices) of each row's maximum of (S, V) fp32 logits, the first index on
    ties: `logits.max(dim=-1)` in one pass (torch's took 3 ms for 64 x 49152 on 2 threads).
    None where not taken."""
    lib = library()
    if lib is None or logits.dim() != 2 or not _fits(logits) or logits.stride(-1) != 1:
        return None
    rows, cols = logits.shape
    top = torch.empty(rows)
    index = torch.empty(rows, dtype=torch.int64)
    lib.rf_argmax(
        logits.data_ptr(), logits.stride(0), rows, cols, top.data_ptr(), index.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return top, index


def run_table(
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """decode_layout.run_table of host tensors (int64 kv_indptr, int32 or int64 kv_indices)
    in one pass: (run_indptr, first, count); None where not taken."""
    lib = library()
    if (
        lib is None
        or kv_indptr.dtype != torch.int64
        or kv_indices.dtype not in (torch.int32, torch.int64)
        or not (kv_indptr.is_contiguous() and kv_indices.is_contiguous())
        or len(kv_indptr) < 1
    ):
        return None
    num, total = len(kv_indptr) - 1, int(kv_indptr[-1])
    if total > len(kv_indices):
        return None
    run_indptr = torch.empty(num + 1, dtype=torch.int64)
    first, count = torch.empty(total, dtype=torch.int64), torch.empty(total, dtype=torch.int64)
    runs = lib.rf_run_table(
        kv_indptr.data_ptr(), num, kv_indices.data_ptr(), kv_indices.dtype == torch.int64,
        run_indptr.data_ptr(), first.data_ptr(), count.data_ptr(),
    )  # fmt: skip
    return run_indptr, first[:runs], count[:runs]
