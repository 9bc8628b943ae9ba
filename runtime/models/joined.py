"""Weight memory advised for huge pages, and the projections joined at load read straight
into the matrix they join (q, k, v into one; gate and up into one).

A model joins neighbouring projections of one block type into one matrix
(`quantized._join`), so that one kernel call runs them. Read into buffers of their own and
then copied into the joined matrix, a 7B file's 2.7 GB of them cost two passes over fresh
memory (1.2 s of copying alone on an AMD EPYC's 2 cores); `gguf_file.read_state` instead
reads each into its rows of the joined matrix (`join_targets`), and `adjacent_rows` lets
`_join` take those rows as they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Sequence

import torch

MADV_HUGEPAGE, HUGE = 14, 2 << 20
SPLIT_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("mlp.gate_proj", "mlp.up_proj"),
)


def huge_empty(shape: tuple[int, int]) -> torch.Tensor:
    """An uninitialised uint8 tensor whose 2 MiB-aligned interior is advised for transparent
    huge pages before anything touches it (Linux; elsewhere, or where madvise refuses, plain
    pages). A decode step streams every weight: with 4 KiB pages the TLB misses on the way
    cost a 7B Q4_K step about 15% (measured on this project's Xeon)."""
    data = torch.empty(shape, dtype=torch.uint8)
    start = (data.data_ptr() + HUGE - 1) // HUGE * HUGE
    end = (data.data_ptr() + data.numel()) // HUGE * HUGE
    if end > start and _libc() is not None:
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE)
    return data


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def join_targets(matrices: dict[str, tuple[int, int, int, int]]) -> dict[str, torch.Tensor]:
    """module name -> the rows of a joined matrix (`huge_empty`) to read its weight into, for
    each run of neighbours in a SPLIT_GROUPS group that `_join` joins. `matrices`: each
    candidate's (block type, values a row, rows, bytes a row); a group's runs break where
    the type or the values a row change, as `_join`'s do."""
    targets: dict[str, torch.Tensor] = {}
    for name in matrices:
        for group in SPLIT_GROUPS:
            if not name.endswith(group[0]):
                continue
            run: list[str] = []
            for member in [name[: -len(group[0])] + g for g in group] + [""]:
                info = matrices.get(member)
                if run and (info is None or info[:2] != matrices[run[0]][:2]):
                    if len(run) > 1:
                        data = huge_empty((sum(matrices[m][2] for m in run), matrices[run[0]][3]))
                        at = 0
                        for m in run:
                            targets[m], at = data[at : at + matrices[m][2]], at + matrices[m][2]
                    run = []
                if info is not None:
                    run.append(member)
    return targets


def adjacent_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The one matrix `parts` already are (row slices of one 2-D tensor, in order and back
    to back, as `join_targets` lays them out), else None."""
    base = parts[0]._base
    if base is None or base.dim() != 2:
        return None
    for a, b in zip(parts, parts[1:], strict=False):
        if b._base is not base or b.data_ptr() != a.data_ptr() + a.nbytes:
            return None
    if not all(p.is_contiguous() and p.shape[1] == base.shape[1] for p in parts):
        return None
    first = (parts[0].data_ptr() - base.data_ptr()) // base.stride(0)
    return base[first : first + sum(p.shape[0] for p in parts)]
