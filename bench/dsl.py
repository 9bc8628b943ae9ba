"""radixflow-dsl: the program workloads end to end as `@function` programs over a live server
(`radixflow.Runtime`, started once per bench run), so the frontend and the wire are measured.

Each program takes one entry of `Workload.programs` and appends exactly the text the
token-level rounds encode (bench/workloads.py), greedy with EOS ignored and the same
`max_new_tokens`, so its outputs can be compared with the Engine's. It returns its outputs
round by round; the workload's own round generator is then replayed on them to count prompt
tokens and the best hit rate. Which workloads have a program form: every one but long_mix,
whose long prompts arrive when the first chat has produced N tokens, a moment only a caller
stepping the scheduler sees.

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
from radixflow.bench.workloads import (
    ACTION,
    APPROACH,
    END_TURN,
    OBSERVATION,
    STEP,
    THOUGHT,
    Workload,
)

GREEDY = {"temperature": 0.0, "ignore_eos": True}
# A program's call waits as long as the work takes: on a loaded machine one few_shot round
# takes minutes, past the endpoint's 60 s default, and the Engine rows never time out either.
CALL_TIMEOUT_S = 3600.0


def output(s: Any, name: str) -> dict[str, Any]:
    """A generation's text and token count (blocks until it finished)."""
    return {"text": s[name], "tokens": s.get_meta_info(name)["completion_tokens"]}


@sgl.function
def one_generation(s: Any, prompt: str, new: int, schema: str | None = None) -> list:
    """few_shot, independent, json_decode: one prompt, one generation."""
    s += prompt
    s += sgl.gen("out", max_tokens=new, json_schema=schema, **GREEDY)
    return [[output(s, "out")]]


@sgl.function
def chat(s: Any, system: str, users: list[str], new: int) -> list:
    """multi_turn: the turns in order, each reply ending its turn."""
    s += system
    replies = []
    for turn, user in enumerate(users):
        s += ("" if turn == 0 else END_TURN) + user
        s += sgl.gen(f"reply{turn}", max_tokens=new, **GREEDY)
        replies.append([output(s, f"reply{turn}")])
    return replies


@sgl.function
def tree(s: Any, root: str, width: int, new: int) -> list:
    """tree_of_thought: fork `width` approaches, then fork each of them `width` ways."""
    s += root
    branches = s.fork(width)
    for i, branch in enumerate(branches):
        branch += APPROACH.format(i + 1)
        branch += sgl.gen("approach", max_tokens=new, **GREEDY)
    first = [output(b, "approach") for b in branches]
    leaves = [leaf for branch in branches for leaf in branch.fork(width)]
    for k, leaf in enumerate(leaves):
        leaf += STEP.format(k % width + 1)
        leaf += sgl.gen("step", max_tokens=new, **GREEDY)
    return [first, [output(leaf, "step") for leaf in leaves]]


@sgl.function
def agent(s: Any, start: str, observations: list[str], choices: list[str], new: int) -> list:
    """agent: think (generation), act (select among the tools), observe; step by step."""
    s += start
    steps = []
    for step, observation in enumerate(observations):
        s += THOUGHT.format(step + 1)
        s += sgl.gen(f"thought{step}", max_tokens=new, **GREEDY)
        s += ACTION
        s += sgl.select(f"action{step}", choices=choices)
        steps += [[output(s, f"thought{step}")], [choices.index(s[f"action{step}"])]]
        s += OBSERVATION.format(observation)
    return steps


PROGRAMS = {
    "few_shot": one_generation,
    "multi_turn": chat,
    "tree_of_thought": tree,
    "json_decode": one_generation,
    "agent": agent,
    "independent": one_generation,
}


class DslSystem:
    """One server for the whole bench run; each workload runs its programs with `run_batch`,
    one thread per program, from a cold cache."""

    name = "radixflow-dsl"

    def __init__(self, model: str, threads: int) -> None:
        options = {"num_threads": threads} if threads else {}
        self.runtime = sgl.Runtime(model_path=model, **options)
        self.endpoint = self.runtime.endpoint
        self.endpoint.timeout = CALL_TIMEOUT_S
        self.pid = self.runtime.process.pid  # its RSS counts the scheduler process too

    def warm_up(self) -> None:
        one_generation.run(prompt="Hello", new=4, backend=self.runtime, chat_template="default")

    def run_workload(self, workload: Workload) -> dict[str, Any]:
        """Run the workload's programs; the row has the Engine rows' fields."""
        program = PROGRAMS[workload.name]
        self.endpoint.flush_cache()
        before = self.endpoint.stats()["prefill_tokens_computed"]
        with RssSampler(self.pid) as rss:
            start = time.perf_counter()
            states = program.run_batch(
                workload.programs,
                backend=self.runtime,
                num_threads=len(workload.programs),
                chat_template="default",  # no stop strings: token counts stay fixed
            )
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
        outputs = [out for program in per_program for out in program[index]]
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
