"""The radixflow system: the offline Engine, driven only through its public API
(`submit`, `step`, `EngineRequest`, `stats`, `flush_cache`, `with_config`), so a scheduler
refactor cannot change a published number without changing what users see."""

from __future__ import annotations

import time
from typing import Any

from radixflow.bench.rounds import Arrivals, BenchError, RoundResult, System, argmax, diffs, mean

SCHEDULER_MODES = {
    "static": {"chunked_prefill_size": -1},  # plus waves: a batch is admitted when one ends
    "continuous": {"chunked_prefill_size": -1},
    "continuous+chunked": {},
}


class RadixflowSystem(System):
    """The Engine, stepped here so that late calls join mid-round (`submit` between steps).
    A late call's arrival is the moment its trigger token came out (`Arrivals`), not when
    this loop noticed it, so TTFT is measured from there, as before."""

    constrained = True

    def __init__(self, name: str, engine: Any, owned: bool, static_waves: bool = False) -> None:
        self.name, self.engine, self.owned, self.static_waves = name, engine, owned, static_waves

    def start_workload(self) -> None:
        self.engine.flush_cache()

    def close(self) -> None:
        if self.owned:  # the base engine is shut down by Models.release
            self.engine.shutdown()

    def run_round(self, calls: list[Any]) -> RoundResult:
        before = self.engine.stats()
        groups, arrived = self._drive(calls)
        after = self.engine.stats()
        result = RoundResult(
            outputs=[],
            prefill_tokens=after["prefill_tokens_computed"] - before["prefill_tokens_computed"],
            cached_tokens=after["cached_tokens"] - before["cached_tokens"],
        )
        for i, (call, handles) in enumerate(zip(calls, groups)):
            if call.options:  # select: the best mean logprob of the option's tokens
                scores = [mean(_input_logprobs(h)) for h in handles]
                result.outputs.append(argmax(scores))
                continue
            handle = handles[0]
            _check(handle)
            times = handle.token_times
            result.outputs.append(handle.output_ids)
            result.ttfts.append(times[0] - arrived[i])
            result.itls += diffs(times)
        return result

    def _drive(self, calls: list[Any]) -> tuple[list[list[Any]], dict[int, float]]:
        """Submit calls as they arrive and step until all finish. Static batching: waves as
        large as the set of calls due at the start, each admitted when the last one is done.
        -> (each call's EngineRequests, each call's arrival time)."""
        arrivals = Arrivals(calls, time.monotonic())
        wave = len(arrivals.due([], False))
        groups: list[list[Any]] = [[] for _ in calls]
        ready = list(arrivals.times)
        while True:
            lead = groups[0][0] if groups[0] else None
            ready += arrivals.due(lead.token_times if lead else [], bool(lead and lead.finished))
            idle = all(h.finished for g in groups for h in g)
            if ready and (idle or not self.static_waves):
                batch, ready = (ready[:wave], ready[wave:]) if self.static_waves else (ready, [])
                for i in batch:
                    groups[i] = self._submit(calls[i])
            elif idle and not ready and arrivals.complete:
                return groups, arrivals.times
            self.engine.step()

    def _submit(self, call: Any) -> list[Any]:
        """Queue one call: a generation, or a select as one prefill per option that returns
        the logprobs of the option's tokens (from `logprob_start_len` on)."""
        if call.options:
            return self.engine.submit(
                input_ids=[[*call.input_ids, *o] for o in call.options],
                sampling_params={"max_new_tokens": 0, "temperature": 0.0},
                return_logprob=True,
                logprob_start_len=len(call.input_ids),
            )
        params = {"max_new_tokens": call.max_new_tokens, "temperature": 0.0, "ignore_eos": True}
        if call.json_schema:
            params["json_schema"] = call.json_schema
        return self.engine.submit(input_ids=list(call.input_ids), sampling_params=params)


def _check(handle: Any) -> dict[str, Any]:
    """A finished request's result; raises BenchError if it failed."""
    result = handle.result()
    if "error" in result:
        raise BenchError(f"radixflow: {result['error']}")
    return result


def _input_logprobs(handle: Any) -> list[float]:
    """The prompt logprobs a select asked for (None marks a position without one)."""
    result = _check(handle)
    return [lp for lp, _, _ in result["meta_info"]["input_token_logprobs"] if lp is not None]
