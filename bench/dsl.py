"""radixflow-dsl: the program workloads end to end through the DSL over a live server
(`radixflow.Runtime`, started once per bench run), so the frontend and the wire are measured.

One `@function`, `program`, runs any workload program: it interprets the program's steps
(bench/workloads.py, the one definition the Engine rows' rounds are derived from too) with
`s += text`, `gen`, `select` and `fork`, greedy with EOS ignored and the same `max_new_tokens`,
so its outputs can be compared with the Engine's. It returns its outputs round by round; the
workload's own round generator is then replayed on them to count prompt tokens and the best
hit rate. Every workload but long_mix has a program form (see bench/workloads.py).

What differs from the Engine rows: TTFT and ITL are not measured (a program sees a whole
generation, not its tokens); the hit rate is the share of the workload's prompt tokens the
server did not compute (its own cached count also holds fork's `cache_prefix` requests).
"""

from __future__ import annotations

import time
from typing import Any

import radixflow as sgl
from radixflow.bench.harness import RssSampler, Tally
from radixflow.bench.rounds import BenchError, RoundResult
from radixflow.bench.workloads import Fork, Gen, Program, Select, Text, Workload

GREEDY = {"temperature": 0.0, "ignore_eos": True}
# A program's call waits as long as the work takes: on a loaded machine one few_shot round
# takes minutes, past the endpoint's 60 s default, and the Engine rows never time out either.
CALL_TIMEOUT_S = 3600.0


@sgl.function
def program(s: Any, steps: Program) -> list:
    """One workload program through the DSL. Each `Gen` or `Select` queues on every live
    branch (the branches run in parallel), then waits for their results: one list per round
    (live branches in order), {"text", "tokens"} per generation, the option's index per select."""
    branches, rounds = [s], []
    for k, step in enumerate(steps):
        if isinstance(step, Text):
            for branch in branches:
                branch += step.text
        elif isinstance(step, Fork):
            branches = [leaf for branch in branches for leaf in branch.fork(step.width)]
            for i, leaf in enumerate(branches):
                leaf += step.label.format(i % step.width + 1)
        else:
            for branch in branches:
                branch += _expr(step, f"out{k}")
            rounds.append([_result(step, branch, f"out{k}") for branch in branches])
    return rounds


def _expr(step: Gen | Select, name: str) -> Any:
    if isinstance(step, Select):
        return sgl.select(name, choices=list(step.choices))
    return sgl.gen(name, max_tokens=step.new, json_schema=step.schema, **GREEDY)


def _result(step: Gen | Select, s: Any, name: str) -> Any:
    """A generation's text and token count, or the chosen option's index (blocks)."""
    if isinstance(step, Select):
        return step.choices.index(s[name])
    return {"text": s[name], "tokens": s.get_meta_info(name)["completion_tokens"]}


def run_programs(programs: list[Program], backend: Any) -> list[Any]:
    """Every program at once, one thread each (`run_batch`) -> their ProgramStates."""
    return program.run_batch(
        [{"steps": p} for p in programs],
        backend=backend,
        num_threads=len(programs),
        chat_template="default",  # no stop strings: token counts stay fixed
    )


class DslSystem:
    """One server for the whole bench run; each workload runs its programs with `run_batch`,
    one thread per program, from a cold cache."""

    def __init__(
        self, model: str, threads: int, name: str = "radixflow-dsl", **options: Any
    ) -> None:
        """`options`: more `radixflow serve` settings (bench/contention.py's pool size)."""
        self.name = name
        if threads:
            options["num_threads"] = threads
        self.runtime = sgl.Runtime(model_path=model, **options)
        self.endpoint = self.runtime.endpoint
        self.endpoint.timeout = CALL_TIMEOUT_S
        self.pid = self.runtime.process.pid  # its RSS counts the scheduler process too

    def warm_up(self) -> None:
        program.run(steps=(Text("Hello"), Gen(4)), backend=self.runtime, chat_template="default")

    def run_workload(self, workload: Workload) -> dict[str, Any]:
        """Run the workload's programs; the row has the Engine rows' fields."""
        self.endpoint.flush_cache()
        before = self.endpoint.stats()["prefill_tokens_computed"]
        with RssSampler(self.pid) as rss:
            start = time.perf_counter()
            states = run_programs(workload.programs, self.runtime)
            wall = time.perf_counter() - start
        failed = [s.error() for s in states if s.error() is not None]
        if failed:
            raise BenchError(f"{self.name}: {failed[0]!r}")
        tally = replay(workload, [s.ret_value for s in states])
        tally.wall = wall
        tally.prefill = self.endpoint.stats()["prefill_tokens_computed"] - before
        prompt_tokens = sum(len(p) for prompts, _ in tally.rounds for p in prompts)
        tally.cached = max(prompt_tokens - tally.prefill, 0)
        return tally.row(workload, self.name, rss.peak_mb)

    def close(self) -> None:
        self.runtime.shutdown()


def replay(workload: Workload, per_program: list[list[list[Any]]]) -> Tally:
    """Feed the programs' outputs, round by round (programs in order), to the workload's own
    rounds, so prompts and token counts are counted as for every other system."""
    tally, calls = Tally(), next(workload.rounds)
    for index in range(len(per_program[0])):
        outputs = [out for rounds in per_program for out in rounds[index]]
        if len(outputs) != len(calls):
            raise BenchError(f"round {index}: {len(outputs)} outputs for {len(calls)} calls")
        results = [out if call.options else out["text"] for call, out in zip(calls, outputs)]
        tally.add(workload, calls, RoundResult(results))
        tally.lengths.append([0 if c.options else o["tokens"] for c, o in zip(calls, outputs)])
        try:
            calls = workload.rounds.send(results)
        except StopIteration:
            break
    return tally
