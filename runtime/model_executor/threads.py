"""`--num-threads auto` (the default on CPU): as many compute threads as the machine has cores
free, re-read while serving.

Every matmul, norm and attention call of a step splits its work over the OpenMP threads and
ends at a barrier. When another program takes a core, one of our threads is descheduled for a
whole time slice (milliseconds) while the rest wait at that barrier, for each of the hundreds
of calls of a step: with 2 threads on 2 cores and one busy neighbour, throughput fell to a
tenth (issue 35; llama.cpp collapses the same way). With one thread fewer there is no one to
wait for, and the step runs at the speed of the cores actually left to it.

`ThreadGovernor.tick()`, called by the model runner before each step (on the thread that
runs the model, since OpenMP's thread count is a per-thread setting), reads the machine's
busy time (/proc/stat) and this process's own (/proc/self/stat) about once a second; what
other processes used is the difference. The thread count follows the cores they leave free,
smoothed so one burst does not flip it, never below one nor above the configured maximum.
A thread is dropped only while our own steps show the contention: the runner reports each
step's wall and CPU time (`stepped`), and their threads must have run under 80% of the time.
On a quiet machine it stays at the maximum (the reading costs a few microseconds a second).
Where /proc cannot be read it stays at the maximum.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)
INTERVAL_S = 1.0  # seconds between readings
SMOOTHING = 0.5  # weight of the newest reading of the neighbours' load
# Threads = int(cores - others + SLACK): on 2 cores, 2 while other processes use at most half
# a core. A busy process beside our two threads shows about 0.6-0.7 of a core (the three
# share two); the clients of a busy server, less.
SLACK = 0.5
# A reading over more than this many intervals (the server sat idle, so no step ticked) says
# what others did while we were not running: it starts a new window instead of setting the
# count. Without this, a server idle while another one worked started its next burst on one
# thread.
STALE_INTERVALS = 3
# A thread is dropped only while our steps' threads are not getting their cores: over the
# steps since the last reading, CPU time / (wall time x threads) below this. The /proc reading
# says how busy others were over the whole interval, not whether they ran while we did: in a
# benchmark alternating systems (or beside any program that works while we wait), others'
# bursts fall between our steps. Measured on 2 cores with 2 threads: 0.98-1.00 quiet, 0.51-0.52
# beside one busy process (whose steps then took 12-27 times as long).
CONTENDED_SHARE = 0.8
# Steps that show contention bring the next reading forward to this many seconds after the
# last: with 2 threads beside a busy process a single stream's steps took 27 times as long,
# so a second's wait cost a stream about as many tokens as the rest of its run.
EARLY_S = 0.2


def _machine_jiffies() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (not guests)
    return total - idle, total


def _process_jiffies(pid: str) -> int:
    """Clock ticks one process (all its threads) has run, user + system; 0 once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of the file)


def _own_jiffies() -> int:
    """Clock ticks this process and its parent have run. The scheduler's parent is the server
    process, whose HTTP, tokenizer and detokenizer work rises with our own throughput: counted
    as a neighbour's, it took a thread from a quiet server under heavy traffic."""
    return _process_jiffies("self") + _process_jiffies(str(os.getppid()))


class ThreadGovernor:
    """Keeps torch's (and so OpenMP's and the native kernels') thread count at the cores
    other processes leave free, between 1 and `max_threads`."""

    def __init__(self, max_threads: int, interval_s: float = INTERVAL_S) -> None:
        self.max_threads = max(1, max_threads)
        self.interval_s = interval_s
        self.cores = os.cpu_count() or 1
        self.others = 0.0  # cores other processes use, smoothed
        self.threads = self.max_threads
        self._last: tuple[float, int, int, int] | None = None
        self.changes = 0
        self._cpu = self._wall = 0.0  # our steps since the last reading: CPU, wall x threads
        try:
            self._last = (time.monotonic(), *_machine_jiffies(), _own_jiffies())
        except (OSError, ValueError, IndexError):
            log.info("--num-threads auto: /proc unreadable, keeping %d threads", self.max_threads)

    def stepped(self, wall_s: float, cpu_s: float) -> None:
        """A step took `wall_s` seconds and this process `cpu_s` seconds of CPU (all threads)."""
        self._wall += wall_s * torch.get_num_threads()
        self._cpu += cpu_s

    def _contended(self) -> bool:
        """Steps of at least EARLY_S (threads x wall) since the last reading, whose threads ran
        under CONTENDED_SHARE of it: a reading is due now, not at the end of the interval."""
        return self._wall >= EARLY_S and self._cpu < CONTENDED_SHARE * self._wall

    def share(self) -> float:
        """The share of their time our steps' threads ran since the last reading (1.0 when no
        step was timed); starts a new count."""
        share = self._cpu / self._wall if self._wall > 0 else 1.0
        self._cpu = self._wall = 0.0
        return share

    def tick(self, now: float | None = None) -> int:
        """Re-read the load when a reading is due, set the thread count; -> the count."""
        if self._last is None:
            return self.threads
        now = time.monotonic() if now is None else now
        since = now - self._last[0]
        if since < self.interval_s and not (since >= EARLY_S and self._contended()):
            return self.threads
        try:
            busy, total, own = *_machine_jiffies(), _own_jiffies()
        except (OSError, ValueError, IndexError):
            return self.threads
        last_now, last_busy, last_total, last_own = self._last
        self._last = (now, busy, total, own)
        share = self.share()
        if now - last_now > STALE_INTERVALS * self.interval_s:
            return self.threads  # we were idle: what others did then is not the cores left now
        elapsed = total - last_total
        if elapsed <= 0:
            return self.threads
        others = max(0.0, (busy - last_busy) - (own - last_own)) / elapsed * self.cores
        self.others = SMOOTHING * others + (1 - SMOOTHING) * self.others
        if share < CONTENDED_SHARE:  # our steps show it: act on this reading, not the average
            self.others = max(self.others, others)
        free = self.cores - self.others
        want = max(1, min(self.max_threads, int(free + SLACK)))
        if want < self.threads and share >= CONTENDED_SHARE:
            want = self.threads  # our threads ran whenever they were ready: nothing to drop
        if want != self.threads:
            log.info(
                "other processes use %.1f of %d cores: %d compute threads (was %d)",
                self.others, self.cores, want, self.threads,
            )  # fmt: skip
            self.threads = want
            self.changes += 1
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        return self.threads
