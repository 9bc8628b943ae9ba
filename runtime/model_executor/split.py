"""Whether small quantized matmuls split over the compute threads, chosen from the first decode
steps' own times.

A quantized call of 1-4 rows (`kernels/cpu/quant.c`, the fused path) splits over the OpenMP
threads only from some work a thread, because a split call needs the other threads awake.
Where the OpenMP runtime keeps them spinning between calls (this project's Intel Xeon),
splitting SmolLM2's small projections as well made a single-stream step 7-10% faster; where
they fall asleep between calls (its AMD EPYC), splitting every call made a step 15-30% slower.
Which holds depends on the CPU, the hypervisor and the OpenMP runtime, and a benchmark of the
kernels alone cannot tell (back to back, the threads never sleep), so the runner measures the
model's own steps: decode steps of at most 4 rows, run with more than one thread, alternate the
two thresholds; after `samples` steps of each, the one with the lower median is kept for the
process and logged. Results do not change: each output is one thread's sum either way.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

from radixflow.kernels.cpu import quant as native_quant

log = logging.getLogger(__name__)
FUSED_ROWS = 4  # quant.c's fused path: the calls the threshold governs
# The kernel's default (0: about 50 us a thread, so SmolLM2's qkv and o projections stay on
# one thread), and a threshold that splits every projection of SmolLM2's size.
CANDIDATES = (0, 1 << 20)
SAMPLES = 12


class SplitTuner:
    """Times decode steps under each candidate threshold, then keeps the faster one."""

    def __init__(self, samples: int = SAMPLES) -> None:
        self.samples = samples
        self.times: dict[int, list[float]] = {c: [] for c in CANDIDATES}
        self.chosen: int | None = None
        self._trying: int | None = None
        self._start = 0.0

    def start(self, rows: int, decode_only: bool) -> None:
        """Before a forward pass: set the threshold to try when this step is one to time."""
        self._trying = None
        if self.chosen is not None or not decode_only or rows > FUSED_ROWS:
            return
        if torch.get_num_threads() < 2:  # one thread: nothing splits, nothing to learn
            return
        steps = sum(len(t) for t in self.times.values())
        self._trying = CANDIDATES[steps % len(CANDIDATES)]
        native_quant.set_fused_split(self._trying)
        self._start = time.perf_counter()

    def stop(self) -> None:
        """After the forward pass `start` prepared: record its time; decide once all are in."""
        if self._trying is None:
            return
        self.times[self._trying].append(time.perf_counter() - self._start)
        self._trying = None
        if any(len(t) < self.samples for t in self.times.values()):
            return
        medians = {c: statistics.median(t) for c, t in self.times.items()}
        self.chosen = min(CANDIDATES, key=medians.__getitem__)
        work = native_quant.set_fused_split(self.chosen)
        log.info(
            "quantized matmuls of 1-%d rows split over threads from %d units a thread (decode "
            "steps: %.2f ms from the default, %.2f ms splitting every projection)",
            FUSED_ROWS, work, medians[CANDIDATES[0]] * 1e3, medians[CANDIDATES[1]] * 1e3,
        )  # fmt: skip
