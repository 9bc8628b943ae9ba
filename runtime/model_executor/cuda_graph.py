"""CUDA graphs for decode: the decode-only forward captured once per batch size, replayed.

A decode step of B requests runs the graph of the smallest captured size >= B (the ladder
1, 2, 4, 8, 16, 24, 32, ... up to `--cuda-graph-max-bs`). Everything a graph reads lives in
static buffers, refilled before each replay: rows past B are padding (token 0 at position 0,
writing its K/V to the dummy slot 0 and reading that one key), and their logits are dropped.
Slot 0 is zeroed again inside the graph, so the dummy page stays as the runner made it.

A graph may hold no host sync and no shape that depends on the step's data, so the decode
layout is fixed-size here: the Triton kernels read the shared-prefix groups through
`pad_layout`'s padded tensors (at most B - 1 groups, ENTRIES_PER_REQUEST entries per
request) and own keys through a buffer of `kv_capacity` slots; a step that does not fit
runs eagerly. The grids depend only on the graph's size.

Two backends share the buffers and the padding: "cuda" (torch.cuda.CUDAGraph, one memory
pool for all sizes, captured largest first) and "record" (CPU tests: capturing runs the
callable once and keeps it; replaying calls it again over the same static buffers), so the
padding, bucketing and buffer logic is tested without a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from radixflow.runtime.config import ServerConfig
from radixflow.runtime.model_executor.step_inputs import supplies_decode_layout
from radixflow.runtime.models.layers import CausalLM, ForwardBatch
from radixflow.runtime.protocol.plan import BatchPlan

log = logging.getLogger(__name__)
ENTRIES_PER_REQUEST = 4  # shared runs one request may merge in a graph (nesting depth)
KV_CAPACITY_LIMIT = 1 << 24  # own-key slots of the static metadata, whatever the ladder
SMALL = (  # static int64 buffers with sizes fixed by max_bs: (name, extra elements)
    ("input_ids", 0),
    ("positions", 0),
    ("out_slots", 0),
    ("kv_indptr", 1),
    ("group_indptr", 1),
    ("prefix_indptr", 1),
    ("row_entry_indptr", 1),
)


def graph_batch_sizes(max_bs: int) -> list[int]:
    """The ladder: 1, 2, 4, 8, then every 8 from 16, and `max_bs` itself as the top rung."""
    assert max_bs >= 1, f"{max_bs=}"
    return sorted({s for s in (1, 2, 4, 8, *range(16, max_bs, 8)) if s < max_bs} | {max_bs})


def graph_max_bs(config: ServerConfig, model: CausalLM) -> int:
    """The largest batch a decode graph takes: min(--cuda-graph-max-bs,
    --max-running-requests) on a CUDA device with the Triton ops, else 0 (graphs off)."""
    device = next(model.parameters()).device
    if config.disable_cuda_graph or device.type != "cuda":
        return 0
    if model.ops.name != "triton":
        log.info("CUDA graphs off: the %r attention ops are not graph-safe", model.ops.name)
        return 0
    if config.tp_size > 1:  # every rank would have to capture the same collectives in step
        log.info("CUDA graphs off: not yet captured under tensor parallelism")
        return 0
    return min(config.cuda_graph_max_bs, config.max_running_requests)


class CudaGraphBackend:
    """Capture with torch.cuda.CUDAGraph after two warm-up runs on a side stream (Triton
    compiles there, and the allocator settles); all graphs share one memory pool."""

    def __init__(self) -> None:
        self.pool = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self.pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class RecordBackend:
    """The CPU stand-in: capture keeps `fn` and a replay calls it (no warm-up run: the
    tests replay an all-padding batch themselves)."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        return fn


class DecodeGraphs:
    """Captured decode forwards of `model` over `k_caches`/`v_caches`, one per ladder size.

    `replay(plan)` returns the (B, vocab) logits of a decode-only plan, or None when the
    plan is not decode-only or does not fit (too many requests, keys or shared runs): the
    caller then runs the step eagerly. `shared_prefix` False reads every key per request
    (the Triton ablation). Mutates the caches as the eager forward would.
    """

    def __init__(
        self,
        model: CausalLM,
        k_caches: torch.Tensor,
        v_caches: torch.Tensor,
        max_bs: int,
        max_kv_len: int,
        shared_prefix: bool = True,
        backend: str = "cuda",
    ) -> None:
        self.model, self.k_caches, self.v_caches = model, k_caches, v_caches
        self.device = k_caches.device
        if backend == "cuda" and (self.device.type != "cuda" or model.ops.name != "triton"):
            raise ValueError(
                f"CUDA graphs need the Triton ops on a CUDA device, not {model.ops.name!r} "
                f"on {self.device}; pass --disable-cuda-graph"
            )
        self.sizes, self.max_bs = graph_batch_sizes(max_bs), max_bs
        self.supplied = supplies_decode_layout(model)  # the Triton ops: layout from us
        self.padded_layout = self.supplied and shared_prefix
        self.kv_capacity = min(max_bs * max_kv_len, KV_CAPACITY_LIMIT)
        self.num_replays = self.num_eager = 0
        self._make_buffers()
        graph_backend = CudaGraphBackend() if backend == "cuda" else RecordBackend()
        self.graphs: dict[int, Callable[[], torch.Tensor]] = {}
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its pool
            self._fill(None, size)
            self.graphs[size] = graph_backend.capture(lambda size=size: self._forward(size))
        log.info("captured decode graphs for batch sizes %s (%s)", self.sizes, backend)

    # ---- buffers -----------------------------------------------------------------------

    def _make_buffers(self) -> None:
        """One device buffer of the fixed-size metadata (copied whole each replay) and two of
        slot lists (copied as long as they are); host mirrors of each, pinned on CUDA."""
        pin = self.device.type == "cuda"
        max_entries = ENTRIES_PER_REQUEST * self.max_bs
        sizes = [(name, self.max_bs + extra) for name, extra in SMALL]
        sizes += [("entry_rows", max_entries), ("row_entries", max_entries)]
        offsets, total = {}, 0
        for name, size in sizes:
            offsets[name] = (total, size)
            total += -(-size // 2) * 2  # 16-byte aligned starts
        self.small = torch.zeros(total, dtype=torch.int64, device=self.device)
        self.small_host = torch.zeros(total, dtype=torch.int64, pin_memory=pin)
        self.offsets = offsets
        slots = self.kv_capacity + self.max_bs  # own keys, and one dummy key per padded row
        self.kv_indices = torch.zeros(slots, dtype=torch.int64, device=self.device)
        self.kv_indices_host = torch.zeros(slots, dtype=torch.int64, pin_memory=pin)
        self.prefix_slots = torch.zeros(self.kv_capacity, dtype=torch.int64, device=self.device)
        self.prefix_slots_host = torch.zeros(self.kv_capacity, dtype=torch.int64, pin_memory=pin)
        self.logit_rows = torch.arange(self.max_bs, device=self.device)
        self.copied = torch.cuda.Event() if pin else None  # host mirrors are free again

    def _view(self, name: str, length: int | None = None, host: bool = False) -> torch.Tensor:
        start, size = self.offsets[name]
        length = size if length is None else length
        return (self.small_host if host else self.small)[start : start + length]

    def _layout(self, size: int) -> object:
        """The fixed-size DecodeLayout the kernels read in the graph of `size` requests."""
        from radixflow.kernels.triton.shared_prefix_attention import DecodeLayout  # noqa: PLC0415 (triton)

        groups, entries = max(size - 1, 0), ENTRIES_PER_REQUEST * size
        return DecodeLayout(
            kv_indptr=self._view("kv_indptr", size + 1),
            kv_indices=self.kv_indices,
            group_indptr=self._view("group_indptr", groups + 1),
            entry_rows=self._view("entry_rows", entries),
            prefix_indptr=self._view("prefix_indptr", groups + 1),
            prefix_slots=self.prefix_slots,
            row_entry_indptr=self._view("row_entry_indptr", size + 1),
            row_entries=self._view("row_entries", entries),
            max_group_size=size,
        )

    def _forward(self, size: int) -> torch.Tensor:
        """The captured region: the model over the static buffers of `size` requests."""
        batch = ForwardBatch(
            input_ids=self._view("input_ids", size),
            positions=self._view("positions", size),
            out_slots=self._view("out_slots", size),
            num_extend_tokens=0,
            extend_qo_indptr=self._view("kv_indptr", 1),  # unused: no extend rows
            extend_kv_indptr=self._view("kv_indptr", 1),
            extend_kv_indices=self.kv_indices[:0],
            decode_kv_indptr=self._view("kv_indptr", size + 1),
            decode_kv_indices=self.kv_indices,
            logit_rows=self.logit_rows[:size],
        )
        if self.supplied:
            batch.layouts["decode", 0] = self._layout(size) if self.padded_layout else None
        logits = self.model(batch, self.k_caches, self.v_caches)  # (size, vocab) fp32
        self.k_caches[:, 0].zero_()  # padded rows wrote their K/V to the dummy slot
        self.v_caches[:, 0].zero_()
        return logits

    # ---- replay ------------------------------------------------------------------------

    def replay(self, plan: BatchPlan) -> torch.Tensor | None:
        """Logits (R, vocab) of a decode-only `plan`'s logit rows from its graph, or None (run
        eagerly)."""
        num_reqs = plan.num_tokens
        if plan.num_extend_tokens or not 1 <= num_reqs <= self.max_bs:
            return None
        size = next(s for s in self.sizes if s >= num_reqs)
        if not self._fill(plan, size):
            self.num_eager += 1
            return None
        self.num_replays += 1
        logits = self.graphs[size]()[:num_reqs]
        if len(plan.logit_rows) != num_reqs:  # a jump's rows: only its last is a logit row
            logits = logits[torch.from_numpy(plan.logit_rows).to(logits.device)]
        return logits

    def _fill(self, plan: BatchPlan | None, size: int) -> bool:
        """Write `plan` (None: all padding) into the static buffers of the `size` graph;
        False when it does not fit them (nothing is copied then)."""
        num_reqs = 0 if plan is None else plan.num_tokens
        empty = np.zeros(0, dtype=np.int64)
        kv_indptr = np.zeros(1, np.int64) if plan is None else plan.decode_kv_indptr
        kv_indices = empty if plan is None else plan.decode_kv_indices
        arrays: dict[str, np.ndarray] = {}
        if self.padded_layout:
            arrays = self._padded_layout(kv_indptr, kv_indices, size)
            if not arrays:
                return False
        else:
            pad = np.arange(1, size - num_reqs + 1)
            arrays["kv_indptr"] = np.concatenate([kv_indptr, kv_indptr[-1] + pad])
            arrays["kv_indices"] = np.concatenate([kv_indices, np.zeros(len(pad), np.int64)])
        if len(arrays["kv_indices"]) > len(self.kv_indices):
            return False
        for name in ("input_ids", "positions", "out_slots"):
            values = empty if plan is None else getattr(plan, name)
            arrays[name] = np.concatenate([values, np.zeros(size - num_reqs, np.int64)])
        if self.copied is not None:
            self.copied.synchronize()  # the last replay's copies have left the mirrors
        small = self.small_host.numpy()
        for name, values in arrays.items():
            if name in self.offsets:
                start, _ = self.offsets[name]
                small[start : start + len(values)] = values
        lists = [(self.kv_indices, self.kv_indices_host, arrays["kv_indices"])]
        if "prefix_slots" in arrays:
            lists.append((self.prefix_slots, self.prefix_slots_host, arrays["prefix_slots"]))
        for _, host, values in lists:
            host.numpy()[: len(values)] = values
        if self.device.type == "cpu":  # the record backend reads the mirrors' copies
            self.small.copy_(self.small_host)
        else:
            self.small.copy_(self.small_host, non_blocking=True)
        for device_buffer, host, values in lists:
            device_buffer[: len(values)].copy_(host[: len(values)], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        return True

    def _padded_layout(
        self, kv_indptr: np.ndarray, kv_indices: np.ndarray, size: int
    ) -> dict[str, np.ndarray]:
        """The Triton layout of this step, padded to the `size` graph; {} if it does not fit."""
        from radixflow.kernels.triton.shared_prefix_attention import (  # noqa: PLC0415 (triton)
            host_decode_layout,
            pad_layout,
        )

        layout = host_decode_layout(torch.from_numpy(kv_indptr), torch.from_numpy(kv_indices))
        padded = pad_layout(layout, size, max(size - 1, 0), ENTRIES_PER_REQUEST * size)
        if padded is None or len(padded["prefix_slots"]) > self.kv_capacity:
            return {}
        return {name: tensor.numpy() for name, tensor in padded.items()}
