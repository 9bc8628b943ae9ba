"""`radixflow simulate`: the real Scheduler and RadixCache driven by a cost model in virtual
time (no torch, no model), to plan a deployment on a laptop.

    radixflow simulate --profile h100-llama-3.3-70b-fp8 --workload long_mix
    radixflow simulate --calibrate prof.json            # measure this machine (loads the model)
    radixflow simulate --profile prof.json --workload long_mix --json out.json

`SimRunner` stands in for the ModelRunner: each forward advances a `VirtualClock` by the
profile's step time and returns deterministic tokens. `drive` replays a bench workload
(rounds of calls; late calls arrive once the round's lead has produced N tokens; static
batching admits waves) on any Scheduler, simulated or real, and measures it as
`radixflow bench` does. The modes are the seeds' three: static batching (waves, no
chunking), continuous batching, continuous + chunked prefill; each with the radix cache on
and off.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from radixflow.bench.workloads import WORDS, WORKLOADS, Codec, best_hit_rate, prompts_of
from radixflow.lab.profiles import LinearProfile, Profile, StepShape
from radixflow.runtime.cache.kv_pool import KVPool
from radixflow.runtime.config import DEFAULT_POOL_TOKENS, ServerConfig
from radixflow.runtime.protocol.plan import BatchPlan, StepResult
from radixflow.runtime.protocol.sampling import SamplingParams
from radixflow.runtime.scheduler.request import Req
from radixflow.runtime.scheduler.scheduler import Scheduler

MODES: dict[str, dict[str, Any]] = {  # as radixflow bench's scheduler-mode comparison
    "static": {"chunked_prefill_size": -1},  # plus waves
    "continuous": {"chunked_prefill_size": -1},
    "continuous+chunked": {},
}
SIM_CONTEXT_LEN = 8192


class VirtualClock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class WordCodec:
    """A torch-free stand-in tokenizer: a word with its leading space, or one punctuation
    mark, is one token (close to BPE counts on the bench's plain-English prompts). Ids are
    given on first sight; `decode(encode(text)) == text`."""

    PATTERN = re.compile(r"\s*\w+|\s*[^\w\s]|\s+")

    def __init__(self, words: list[str]) -> None:
        self.vocab: dict[str, int] = {"<eos>": 0}
        self.pieces = ["<eos>"]
        for w in words:
            self._id(" " + w)
        self.num_words = len(self.pieces) - 1

    def _id(self, piece: str) -> int:
        if piece not in self.vocab:
            self.vocab[piece] = len(self.pieces)
            self.pieces.append(piece)
        return self.vocab[piece]

    def encode(self, text: str) -> list[int]:
        return [self._id(p) for p in self.PATTERN.findall(text)]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in ids if i)


class SimRunner:
    """A Runner whose forward costs `profile.step_time` of virtual time. The sampled token
    is a hash of the row's token and position (greedy-like: equal sequences continue
    equally), always one of the first `num_words` ids, never EOS."""

    def __init__(self, profile: Profile, clock: VirtualClock, num_words: int) -> None:
        self.profile, self.clock, self.num_words = profile, clock, num_words
        self.shapes: list[tuple[StepShape, float]] = []

    def forward(self, plan: BatchPlan) -> StepResult:
        shape = StepShape.of(plan)
        seconds = self.profile.step_time(shape)
        self.clock.advance(seconds)
        self.shapes.append((shape, seconds))
        rows = plan.logit_rows[plan.sample_rows]
        tokens = (plan.input_ids[rows] * 7919 + plan.positions[rows]) % self.num_words + 1
        return StepResult(tokens.tolist(), [0.0] * len(rows), np.zeros(len(plan.logit_rows)))


def sim_scheduler(
    config: ServerConfig, profile: Profile, codec: WordCodec, clock: VirtualClock
) -> Scheduler:
    pool = KVPool(config.max_total_tokens or DEFAULT_POOL_TOKENS, config.page_size)
    runner = SimRunner(profile, clock, codec.num_words)
    return Scheduler(
        config,
        runner,
        pool,
        eos_token_ids=(0,),
        context_len=config.context_length or SIM_CONTEXT_LEN,
        vocab_size=len(codec.pieces) + 1024,
        decode=codec.decode,
        clock=clock.now,
    )


# ---- replaying a workload ------------------------------------------------------------------


@dataclass
class Arrivals:
    """When calls arrive: at the round's start, or once the lead (call 0) has produced
    `after_tokens` tokens (or finished). Mirrors radixflow bench."""

    calls: list[Any]
    start: float

    def __post_init__(self) -> None:
        self.times: dict[int, float] = {}

    def due(self, lead_times: list[float], lead_done: bool) -> list[int]:
        new = []
        for i, call in enumerate(self.calls):
            after = call.after_tokens
            if i in self.times or (after and len(lead_times) < after and not lead_done):
                continue
            late = lead_times[min(after, len(lead_times)) - 1] if lead_times else self.start
            self.times[i] = late if after else self.start
            new.append(i)
        return new


def _reqs(call: Any, rid: str, arrival: float, constrained: bool) -> list[Req]:
    if call.options:  # select: one prefill per option, logprobs of the option's tokens
        params = SamplingParams.from_dict({"max_new_tokens": 0, "temperature": 0.0})
        start = len(call.input_ids)
        return [
            Req(f"{rid}-{k}", [*call.input_ids, *o], params, True, start, arrival=arrival)
            for k, o in enumerate(call.options)
        ]
    params = SamplingParams.from_dict(
        {
            "max_new_tokens": call.max_new_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "json_schema": call.json_schema if constrained else None,
        }
    )
    return [Req(rid, list(call.input_ids), params, arrival=arrival)]


def _percentile(values: list[float], q: float) -> float | None:  # radixflow bench's
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else None


def _choice(reqs: list[Req]) -> int:
    scores = [np.mean([lp for lp in r.input_logprobs if lp is not None] or [0.0]) for r in reqs]
    return int(np.argmax(scores))


def drive(
    scheduler: Scheduler,
    workload: Any,
    clock: Callable[[], float],
    static_waves: bool = False,
    constrained: bool = False,
) -> dict[str, Any]:
    """Run every round of a bench workload on `scheduler`, stepping it here; measure like
    `radixflow bench` (wall = the rounds' time on `clock`)."""

    ttfts: list[float] = []
    itls: list[float] = []
    rounds, wall, output_tokens, errors, count = [], 0.0, 0, [], 0
    before = dict(scheduler.counters)
    calls = next(workload.rounds)
    while True:
        start = clock()
        arrivals = Arrivals(calls, start)
        wave = len(arrivals.due([], False))
        groups: list[list[Req]] = [[] for _ in calls]
        ready = list(arrivals.times)
        while True:
            lead = groups[0][0] if groups[0] else None
            ready += arrivals.due(lead.token_times if lead else [], bool(lead and lead.finished))
            idle = all(r.finished for g in groups for r in g)
            if ready and (idle or not static_waves):
                batch, ready = (ready[:wave], ready[wave:]) if static_waves else (ready, [])
                for i in batch:
                    count += 1
                    groups[i] = _reqs(calls[i], f"lab-{count}", arrivals.times[i], constrained)
                    for req in groups[i]:
                        scheduler.add_request(req)
            elif idle and not ready and len(arrivals.times) == len(calls):
                break
            scheduler.step()
        wall += clock() - start
        outputs: list[Any] = []
        for call, reqs in zip(calls, groups):
            errors += [r.error for r in reqs if r.error]
            if call.options:
                outputs.append(_choice(reqs))
                continue
            req = reqs[0]
            outputs.append(list(req.output_ids))
            output_tokens += len(req.output_ids)
            if req.token_times:
                ttfts.append(req.token_times[0] - req.arrival)
                itls += np.diff(req.token_times).tolist()
        finished = [c.input_ids + tuple(o) for c, o in zip(calls, outputs) if not c.options]
        rounds.append((prompts_of(calls), finished))
        try:
            calls = workload.rounds.send(outputs)
        except StopIteration:
            break
    after = scheduler.counters
    prompt_tokens = sum(len(p) for prompts, _ in rounds for p in prompts)
    wall = wall or 1e-9
    return {
        "workload": workload.name,
        "wall_s": wall,
        "output_tokens": output_tokens,
        "tokens_per_s": output_tokens / wall,
        "ttft_mean_s": float(np.mean(ttfts)) if ttfts else None,
        "ttft_p99_s": _percentile(ttfts, 0.99),
        "itl_p99_s": _percentile(itls, 0.99),
        "prefill_tokens": after["prefill_tokens_computed"] - before["prefill_tokens_computed"],
        "cache_hit_rate": (after["cached_tokens"] - before["cached_tokens"]) / prompt_tokens
        if prompt_tokens
        else 0.0,
        "best_hit_rate": best_hit_rate(rounds),
        "preemptions": after["preemptions"] - before["preemptions"],
        "errors": errors,
    }


# ---- the modes, calibration and the command --------------------------------------------


def bench_workload(name: str, codec: WordCodec, quick: bool) -> Any:

    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; one of {sorted(WORKLOADS)}")
    return WORKLOADS[name](Codec(codec.encode, codec.decode), quick)


def word_codec() -> WordCodec:

    return WordCodec(list(WORDS))


def simulate_modes(
    profile: Profile,
    workload: str,
    config: ServerConfig,
    quick: bool = False,
    modes: tuple[str, ...] = tuple(MODES),
    radix: tuple[bool, ...] = (True, False),
) -> list[dict[str, Any]]:
    """One row per (mode, radix on/off): the workload replayed in virtual time."""
    rows = []
    for mode in modes:
        for on in radix:
            clock, codec = VirtualClock(), word_codec()
            changes = {**MODES[mode], "disable_radix_cache": not on}
            scheduler = sim_scheduler(config.replace(**changes), profile, codec, clock)
            row = drive(
                scheduler, bench_workload(workload, codec, quick), clock.now, mode == "static"
            )
            rows.append({"mode": mode, "radix": on, **row, "steps": len(scheduler.runner.shapes)})
    return rows


class TimedRunner:
    """Wraps the real ModelRunner and records (shape, seconds) of every forward."""

    def __init__(self, inner: Any, clock: Callable[[], float]) -> None:
        self.inner, self.clock = inner, clock
        self.samples: list[tuple[StepShape, float]] = []

    def forward(self, plan: BatchPlan) -> StepResult:
        start = self.clock()
        result = self.inner.forward(plan)
        self.samples.append((StepShape.of(plan), self.clock() - start))
        return result


def calibrate(model: str = "smollm2", **config: Any) -> Any:
    """Measure this machine: prefill (chunked and whole, up to 3,000 tokens), decode (batch
    1..16, short and long KV) and mixed steps on the real model, then fit a LinearProfile.
    Loads the model (torch)."""
    from radixflow.runtime.engine import Engine  # noqa: PLC0415 (torch: only a run on the real model loads it)

    rng = np.random.default_rng(0)
    with Engine(model=model, **config) as engine:
        timed = TimedRunner(engine.scheduler.runner, time.perf_counter)
        engine.scheduler.runner = timed
        # whole prompts (chunking off), as the static and continuous modes prefill them
        whole = engine.with_config(chunked_prefill_size=-1)
        whole.scheduler.runner = TimedRunner(whole.scheduler.runner, time.perf_counter)
        whole.scheduler.runner.samples = timed.samples

        def run(lengths: list[int], new: int, late: list[int] = (), on: Any = engine) -> None:
            ids = [rng.integers(100, 20000, n).tolist() for n in lengths]
            params = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
            on.submit(input_ids=ids, sampling_params=params)
            for _ in range(3):
                on.step()
            if late:
                on.submit(
                    input_ids=[rng.integers(100, 20000, n).tolist() for n in late],
                    sampling_params={**params, "max_new_tokens": 1},
                )
            while on.step():
                pass
            on.flush_cache()

        run([64], 2)  # warm-up, dropped below
        timed.samples.clear()
        for n in (32, 128, 512):
            run([n], 1)
        for batch in (1, 4, 16):
            run([16] * batch, 6)
        run([400] * 2, 6)  # decodes over longer KV
        run([24] * 4, 10, late=[700])  # chunks mixed with decodes
        # long prompts, whole and in chunks: a whole one costs its padded attention area,
        # twice its causal pairs, which short prompts alone cannot tell apart
        run([3000], 1)
        for n in (1500, 3000):
            run([n], 1, on=whole)
        run([24] * 4, 10, late=[3000], on=whole)  # a whole long prompt beside decodes
        shapes, times = zip(*timed.samples)
    notes = (
        f"measured {time.strftime('%Y-%m-%d %H:%M')} on {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}, {len(times)} steps"
    )
    return LinearProfile.fit(f"measured-{model}", list(shapes), list(times), notes)
