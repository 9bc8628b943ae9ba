"""What every system under test shares: a round's result, call arrivals, and small statistics.

Only the standard library is imported: bench/peers.py loads this file by path inside a peer's
own interpreter, where radixflow is not installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RoundResult:
    outputs: list[Any]  # per call: generated ids, or the chosen option's index
    ttfts: list[float] = field(default_factory=list)  # seconds, from each call's arrival
    itls: list[float] = field(default_factory=list)  # every gap between consecutive tokens
    prefill_tokens: int = 0  # prompt positions actually computed (padding included)
    cached_tokens: int = 0  # prompt positions reused from a cache


class System:
    """A system under test: `run_round` runs one round's calls; each workload starts cold."""

    name = ""
    constrained = False  # honours json_schema; if not, it generates the reference lengths
    pid = 0  # whose memory counts: 0 = this process; a peer's worker otherwise

    def start_workload(self) -> None:
        pass

    def run_round(self, calls: list[Any]) -> RoundResult:
        raise NotImplementedError

    def end_workload(self) -> None:
        pass

    def close(self) -> None:
        pass


def percentile(values: list[float], q: float) -> float | None:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else None


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def diffs(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def argmax(scores: list[float]) -> int:
    return max(range(len(scores)), key=scores.__getitem__)


class Arrivals:
    """When a round's calls arrive: at its start, or (late calls) once the lead (the first
    call) has produced `after_tokens` tokens, or has finished. `times[i]` is call i's."""

    def __init__(self, calls: list[Any], start: float) -> None:
        assert calls and not calls[0].after_tokens, "a round's first call arrives at its start"
        self.calls, self.start, self.times = calls, start, {}

    def due(self, lead_times: list[float], lead_done: bool) -> list[int]:
        """Calls that arrived since the last look, in call order."""
        new = []
        for i, call in enumerate(self.calls):
            after = call.after_tokens
            if i in self.times or (after and len(lead_times) < after and not lead_done):
                continue
            late = lead_times[min(after, len(lead_times)) - 1] if lead_times else self.start
            self.times[i] = late if after else self.start
            new.append(i)
        return new

    @property
    def complete(self) -> bool:
        return len(self.times) == len(self.calls)


class BenchError(RuntimeError):
    """A system failed a request or its worker died."""
