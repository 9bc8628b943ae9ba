"""--num-threads auto: the governor follows the cores other processes leave free."""

from __future__ import annotations

import pytest
import torch

from radixflow.runtime.config import ServerConfig, fixed_threads
from radixflow.runtime.model_executor import threads


class FakeProc:
    """/proc readings: `others` and `ours` cores busy over each interval of 1 s (100 ticks
    a core), on a 2-core machine."""

    def __init__(self) -> None:
        self.busy = self.total = self.own = 0
        self.others, self.ours = 0.0, 2.0

    def advance(self) -> None:
        self.busy += int(100 * (self.others + self.ours))
        self.own += int(100 * self.ours)
        self.total += 200


@pytest.fixture
def proc(monkeypatch):
    fake = FakeProc()
    monkeypatch.setattr(threads, "_machine_jiffies", lambda: (fake.busy, fake.total))
    monkeypatch.setattr(threads, "_own_jiffies", lambda: fake.own)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    before = torch.get_num_threads()
    yield fake
    torch.set_num_threads(before)


def run(
    governor, proc, others: float, ours: float, seconds: int, stepping: float = 1.0
) -> list[int]:
    """Each second: others and we use those cores; our steps fill `stepping` of the second
    (the rest we wait), their threads running `ours` cores' worth of it."""
    counts = []
    for _ in range(seconds):
        proc.others, proc.ours = others, ours
        proc.advance()
        governor.stepped(stepping, ours)
        governor.now += 1.0
        counts.append(governor.tick(governor.now))
    return counts


def test_a_busy_neighbour_takes_a_thread_and_gives_it_back(proc):
    governor = threads.ThreadGovernor(2)
    governor.now = governor._last[0]
    assert run(governor, proc, others=0.0, ours=2.0, seconds=3) == [2, 2, 2]  # quiet: all
    busy = run(governor, proc, others=1.0, ours=1.0, seconds=4)  # a hog on one core
    assert busy[-1] == 1 and torch.get_num_threads() == 1
    quiet = run(governor, proc, others=0.0, ours=1.0, seconds=4)  # the hog ends
    assert quiet[-1] == 2 and torch.get_num_threads() == 2
    assert governor.changes == 2


def test_our_own_busy_threads_are_not_mistaken_for_a_neighbour(proc):
    governor = threads.ThreadGovernor(2)
    governor.now = governor._last[0]
    assert run(governor, proc, others=0.1, ours=1.9, seconds=6) == [2] * 6


def test_between_readings_nothing_is_read(proc):
    governor = threads.ThreadGovernor(2)
    proc.others, proc.ours = 2.0, 0.0
    proc.advance()
    assert governor.tick(governor._last[0] + 0.2) == 2  # not due yet: the count stands


def test_num_threads_accepts_auto_or_a_count():
    assert ServerConfig().num_threads == "auto" and fixed_threads(ServerConfig()) == 0
    assert fixed_threads(ServerConfig(num_threads=0)) == 0
    assert fixed_threads(ServerConfig(num_threads="auto")) == 0
    assert fixed_threads(ServerConfig(num_threads=3)) == 3
    with pytest.raises(ValueError, match="num_threads"):
        ServerConfig(num_threads="many")


def test_a_busy_servers_clients_keep_both_threads_a_busy_process_takes_one(proc):
    """The clients of a busy server use a fraction of a core (0.4 here): both threads stay.
    A busy process beside our two threads gets about two thirds of a core: one is dropped."""
    governor = threads.ThreadGovernor(2)
    governor.now = governor._last[0]
    assert run(governor, proc, others=0.4, ours=1.6, seconds=6) == [2] * 6
    assert run(governor, proc, others=0.67, ours=1.33, seconds=4)[-1] == 1


def test_the_server_process_counts_as_ours(monkeypatch):
    """The scheduler's parent is its server process (HTTP, tokenizer): its CPU is ours."""
    ticks = {"self": 700, str(threads.os.getppid()): 300}
    monkeypatch.setattr(threads, "_process_jiffies", lambda pid: ticks.get(pid, 10_000))
    assert threads._own_jiffies() == 1000


def test_a_reading_across_an_idle_spell_sets_nothing(proc):
    """No step ticks while the server is idle; a reading spanning that spell measures what
    others did meanwhile (another server's burst), not the cores free now: it only starts a
    new window, and the next reading decides."""
    governor = threads.ThreadGovernor(2)
    governor.now = governor._last[0]
    assert run(governor, proc, others=0.0, ours=2.0, seconds=2) == [2, 2]
    for _ in range(10):  # ten idle seconds while another process uses both cores
        proc.others, proc.ours = 2.0, 0.0
        proc.advance()
    governor.now += 10.0
    assert governor.tick(governor.now) == 2
    assert run(governor, proc, others=0.0, ours=2.0, seconds=3) == [2, 2, 2]
    assert governor.changes == 0
    # a neighbour that is still busy once we work again is seen within two readings
    assert run(governor, proc, others=1.0, ours=1.0, seconds=2)[-1] == 1


def test_others_busy_only_between_our_steps_take_nothing(proc):
    """Another program that works while we wait (a benchmark alternating systems): over each
    second others used a core and a half, but our steps' threads always ran, so no thread is
    dropped; the same load while our steps' threads wait for their cores takes one."""
    governor = threads.ThreadGovernor(2)
    governor.now = governor._last[0]
    assert run(governor, proc, others=1.5, ours=0.5, seconds=4, stepping=0.25) == [2] * 4
    assert governor.changes == 0
    assert run(governor, proc, others=1.0, ours=1.0, seconds=2)[-1] == 1  # share 0.5


def test_the_share_is_each_steps_cpu_over_its_threads_time(proc):
    governor = threads.ThreadGovernor(2)
    torch.set_num_threads(2)
    governor.stepped(0.010, 0.020)
    governor.stepped(0.010, 0.010)
    assert governor.share() == pytest.approx(0.75)
    assert governor.share() == 1.0  # counted anew; no steps: no sign of contention


def test_steps_that_show_contention_bring_the_reading_forward(proc):
    """A reading is due a second after the last, or from EARLY_S once the steps since then
    ran their threads under CONTENDED_SHARE of the time."""
    governor = threads.ThreadGovernor(2)
    start = governor._last[0]
    torch.set_num_threads(2)
    proc.others, proc.ours = 1.0, 1.0
    proc.advance()
    governor.stepped(0.3, 0.6)  # threads ran the whole time: not early
    assert governor.tick(start + 0.3) == 2 and governor._last[0] == start
    governor.stepped(0.3, 0.3)  # now 0.9 of 1.2 thread-seconds: 0.75
    assert governor.tick(start + 0.6) == 1 and governor._last[0] == start + 0.6


def test_what_loading_made_is_frozen_out_of_the_collector(engine) -> None:
    """The model (and what else loading made) is out of the cyclic collector's generations,
    so its full collections, every few hundred serving steps, do not walk it."""
    import gc  # noqa: PLC0415

    model = engine.scheduler.runner.model
    assert gc.get_freeze_count() > 10_000
    assert not any(o is model for o in gc.get_objects())
