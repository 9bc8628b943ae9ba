"""The driver: runs a workload's rounds on a system, times them, samples memory, and turns what
happened into one result row (the JSON fields `radixflow bench` has always written)."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from radixflow.bench.rounds import RoundResult, System, mean, percentile
from radixflow.bench.workloads import Workload, best_hit_rate, prompts_of

PEER_WORKER = "bench/peers.py"  # in the command line of a peer's worker (baselines.py)


class RssSampler:
    """Peak resident memory of a process tree, sampled every 50 ms while in the block.

    Listing a tree's children scans every process on the machine (about 1 ms of CPU here), so
    the list is refreshed once a second, and a sample in between reads only the known
    processes' memory (tens of microseconds). Sampling every listing took 2% of a core from
    the engine it measured, on a 2-core machine whose both cores the engine's matmuls use."""

    PERIOD_S, LIST_EVERY_S = 0.05, 1.0

    def __init__(self, pid: int) -> None:
        self.pid, self.peak_mb, self._stop = pid, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:

        root, tree, listed = psutil.Process(self.pid), [], -float("inf")
        while True:
            try:
                if time.monotonic() - listed >= self.LIST_EVERY_S:
                    tree, listed = own_tree(root), time.monotonic()
                rss = 0
                for p in tree:
                    try:
                        rss += p.memory_info().rss
                    except psutil.Error:  # exited since the listing: the next one drops it
                        pass
                self.peak_mb = max(self.peak_mb, rss / 2**20)
            except psutil.Error:
                pass  # the root went away: nothing left to sample
            if self._stop.wait(self.PERIOD_S):
                return


def own_tree(root: Any) -> list[Any]:
    """`root` and its descendants, less the peers' workers (bench/peers.py) and theirs: an
    in-process system's root is the bench itself, whose children include every peer it runs
    beside (their memory is theirs, measured from their own pid)."""
    descendants, parent, peers = root.children(recursive=True), {}, set()
    for child in descendants:
        try:
            parent[child.pid] = child.ppid()
            if any(arg.endswith(PEER_WORKER) for arg in child.cmdline()):
                peers.add(child.pid)
        except psutil.Error:
            pass

    def under_a_peer(pid: int) -> bool:
        while pid in parent:
            if pid in peers:
                return True
            pid = parent[pid]
        return False

    return [root, *(c for c in descendants if not under_a_peer(c.pid))]


@dataclass
class Tally:
    """What a workload's rounds did on one system, summed as they run."""

    wall: float = 0.0
    rounds: list[tuple[list[Any], list[Any]]] = field(default_factory=list)  # for best_hit_rate
    lengths: list[list[int]] = field(default_factory=list)  # per round: tokens per call
    outputs: list[list[Any]] = field(default_factory=list)  # per round: text, or option index
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    prefill: int = 0
    cached: int = 0

    def add(self, workload: Workload, calls: list[Any], result: RoundResult) -> None:
        """Count one round; generation outputs may be token ids or (DSL) their text."""
        text = workload.codec.text
        gens = [(c, o) for c, o in zip(calls, result.outputs) if not c.options]
        finished = [c.input_ids + tuple(_ids(workload, o)) for c, o in gens]
        self.rounds.append((prompts_of(calls), finished))
        self.outputs.append([o if c.options else text(o) for c, o in zip(calls, result.outputs)])
        self.ttfts += result.ttfts
        self.itls += result.itls
        self.prefill += result.prefill_tokens
        self.cached += result.cached_tokens

    def row(self, workload: Workload, system: str, peak_rss_mb: float) -> dict[str, Any]:
        prompt_tokens = sum(len(p) for prompts, _ in self.rounds for p in prompts)
        output_tokens = sum(map(sum, self.lengths))
        digest = hashlib.sha256(json.dumps(self.outputs).encode()).hexdigest()[:16]
        return {
            "workload": workload.name,
            "system": system,
            "wall_s": self.wall,
            "output_tokens": output_tokens,
            "tokens_per_s": output_tokens / self.wall,
            "programs_per_s": workload.num_programs / self.wall,
            "ttft_mean_s": mean(self.ttfts),
            "ttft_p99_s": percentile(self.ttfts, 0.99),
            "itl_p99_s": percentile(self.itls, 0.99),
            "prefill_tokens": self.prefill,
            "cache_hit_rate": self.cached / prompt_tokens if prompt_tokens else 0.0,
            "best_hit_rate": best_hit_rate(self.rounds),
            "peak_rss_mb": peak_rss_mb,
            "output_digest": digest,  # equal digests: equal outputs (texts, chosen options)
        }


def _ids(workload: Workload, out: Any) -> list[int]:
    return workload.codec.encode(out) if isinstance(out, str) else list(out)


def run_workload(
    system: System, workload: Workload, references: dict[str, list[list[int]]]
) -> dict[str, Any]:
    """Run every round of `workload` on `system`; wall time counts only the rounds themselves.
    A constrained system records its JSON output lengths; the others generate that many."""
    reference = None if system.constrained else references.get(workload.name)
    tally = Tally()
    system.start_workload()
    calls = next(workload.rounds)
    with RssSampler(system.pid or os.getpid()) as rss:
        for round_index in itertools.count():
            if reference:
                calls = [
                    dataclasses.replace(c, max_new_tokens=max(n, 1)) if c.json_schema else c
                    for c, n in zip(calls, reference[round_index])
                ]
            start = time.perf_counter()
            result = system.run_round(calls)
            tally.wall += time.perf_counter() - start
            tally.add(workload, calls, result)
            tally.lengths.append(
                [0 if c.options else len(o) for c, o in zip(calls, result.outputs)]
            )
            try:
                calls = workload.rounds.send(result.outputs)
            except StopIteration:
                break
    system.end_workload()
    if system.constrained:
        references.setdefault(workload.name, tally.lengths)
    return tally.row(workload, system.name, rss.peak_mb)


QUIET_CORES = 0.1  # machine-wide busy time, in cores, below which a window counts as quiet


def _busy_s() -> float:
    """CPU seconds the whole machine has been busy since boot (all but idle and iowait)."""
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    guests = getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)  # inside user and nice
    return sum(t) - idle - guests


def wait_until_quiet(settle_s: float = 1.0, window_s: float = 0.25, limit_s: float = 15.0) -> float:
    """Before a timed run: sleep `settle_s`, then until one `window_s` window in which the whole
    machine used under QUIET_CORES of a core, at most `limit_s` in all; -> the seconds waited.
    The caller is idle meanwhile, so what it sees is other processes: a peer that just ran
    keeps its workers busy for a while (vLLM-CPU's worker kept about one core busy for about a
    second after each run), and a run started then shares the cores with it (and radixflow's
    `--num-threads auto` may drop a thread for it)."""
    start = time.monotonic()
    time.sleep(settle_s)
    while time.monotonic() - start < limit_s:
        busy, wall = _busy_s(), time.monotonic()
        time.sleep(window_s)
        if (_busy_s() - busy) / (time.monotonic() - wall) < QUIET_CORES:
            break
    return time.monotonic() - start


def warm_up(system: System, call: Any) -> None:
    """One tiny untimed round: first-call costs (kernel selection, allocation) stay out."""
    system.start_workload()
    system.run_round([call])
    system.end_workload()


class Hog:
    """One busy process (`while True: pass`) for the `hog` condition, stopped at exit."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def set(self, on: bool) -> None:
        if on and self.proc is None:
            self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            time.sleep(2.0)  # the governor's readings see it before the timed round
        elif not on and self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            time.sleep(2.0)
