"""Decode runs: several greedy decode steps of the running requests in one runner call
(`ModelRunner.forward_steps`: the CPU decode loop's steps path), where nothing the
scheduler does between two steps would change them.

Why: a one-stream decode step of a small model on a CPU is a few milliseconds, of which the
host's part (the plan, the step's tensors, the sampler, the request's bookkeeping, about
0.8 ms of a 6 ms SmolLM2 step on 2 threads) is spent again for every token. SGLang's
`--num-continuous-decode-steps` runs several decode steps before scheduling again; here the
steps also stay inside one compiled call, each picking its tokens there.

A run takes a decode step's place when: `--num-continuous-decode-steps` is above 1, the
runner has the steps path (the decode loop's team: a model it serves, two threads or more,
the split tuner done), 1-4 requests decode and nothing else is in the step (no request
waiting or mid-chunk, no verify or jumped rows), and each request picks greedily with
nothing between its logits and its pick (no penalties, logit bias, banned tokens, grammar,
logprobs, LoRA, thinking budget). Its length is the least of the knob, each request's
remaining new tokens and context, what the free pages hold (a run never evicts), and about
RUN_BUDGET_S of steps at the last decode step's time a token (a long step gains nothing
from a run, and its tokens would stream seconds apart). Tokens are appended one by one as
a step's would be, so EOS, stop strings and max_new_tokens end a request at the same token;
its stream gets the run's tokens together.

KV: a request grows by the run's length at once (`RequestKV.grow`), so one that finishes
inside the run has KV for positions past its end. As with rejected drafts (speculative.py),
kv_len covers the tokens kept, whole pages past it are freed, and the tree only ever
receives slots[:kv_len]. Where the runner declines the batch after all, the step runs as a
plain decode step and the extra pages go back the same way.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from radixflow.runtime.scheduler.request import Req
    from radixflow.runtime.scheduler.scheduler import Scheduler

MAX_ROWS = 4  # the decode loop's team path: 1-4 rows
# A run lasts at most about this long: its tokens stream together and a request that
# arrives waits for it (SmolLM2 on 2 cores: 8 steps of ~6 ms; a 7B's ~180 ms steps: none)
RUN_BUDGET_S = 0.05


def plain_greedy(req: Req) -> bool:
    """Whether the request's next tokens are its logits' argmax and nothing else."""
    p = req.sampling
    return (
        p.greedy
        and not req.return_logprob
        and req.grammar is None
        and not req.lora
        and not req.draft_ids
        and not p.logit_bias
        and not (p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0)
        and len(req.output_ids) >= p.min_new_tokens
        and p.max_thinking_tokens is None
    )


def run_length(sched: Scheduler, decodes: list[Req], others: bool) -> int:
    """The steps this step's decodes run at once (1: a plain decode step); `others`: the
    step has verify or jumped rows too."""
    limit = min(sched.config.num_continuous_decode_steps, _budget_steps(sched))
    if limit <= 1 or others or not 1 <= len(decodes) <= MAX_ROWS:
        return 1
    if getattr(sched.runner, "forward_steps", None) is None:
        return 1
    if sched.waiting or sched.chunked is not None or not all(map(plain_greedy, decodes)):
        return 1
    for req in decodes:
        limit = min(limit, req.remaining_new_tokens(), sched.context_len - req.kv_len)
    size = sched.pool.page_size
    while limit > 1:
        pages = sum(-(-(r.kv_len + limit) // size) - -(-r.kv_len // size) for r in decodes)
        if pages <= sched.pool.num_free_pages:
            break
        limit //= 2
    return max(limit, 1)


def start(sched: Scheduler, decodes: list[Req], others: bool) -> Run | None:
    """A run of this step's decodes with their pages grown (`run_length`), or None for a
    plain decode step."""
    steps = run_length(sched, decodes, others)
    return Run(sched, decodes, steps) if steps > 1 else None


def _budget_steps(sched: Scheduler) -> int:
    """Steps within RUN_BUDGET_S at the time a token of the last decode-only step (a run's
    wall over its tokens a row, `decode_run_steps`), kept across prefill steps; no bound
    before one has run. A step is read once: idle steps record nothing."""
    steps = sched.metrics.steps
    last = steps[-1] if steps else None
    if last is not None and last is not getattr(sched, "decode_timed_step", None):
        sched.decode_timed_step = last
        per_row, sched.decode_run_steps = getattr(sched, "decode_run_steps", 1), 1
        if not last[2] and last[1]:  # no extend rows, some decode rows
            sched.decode_token_s = last[0] / per_row
    per_token = getattr(sched, "decode_token_s", 0.0)
    return int(RUN_BUDGET_S / per_token) if per_token > 0 else 1 << 30


class Run:
    """The KV a run's requests held before it, to give back what the run did not keep."""

    def __init__(self, sched: Scheduler, decodes: list[Req], steps: int) -> None:
        self.steps = steps
        self.before = {id(r): (r.kv_len, len(r.own_pages)) for r in decodes}
        for req in decodes:
            grown = sched.kv.grow(req, steps)
            assert grown, f"{req.rid}: no room for a decode run, free={sched.pool.num_free_pages}"

    def slots(self, decodes: list[Req]) -> np.ndarray:
        """(steps, B) int64: each step's KV slot of each request."""
        return np.stack([r.slots[r.kv_len : r.kv_len + self.steps] for r in decodes], axis=1)

    def keep(self, sched: Scheduler, decodes: list[Req], tokens: np.ndarray) -> list[Req]:
        """Append each request's tokens of the run (done, B) as its steps would have, up to
        where it finishes; free the pages past what it kept; -> the requests."""
        now = sched.clock()
        appended = 0
        for r, req in enumerate(decodes):
            start = req.kv_len
            for j in range(len(tokens)):
                req.kv_len = start + j + 1  # the KV of its pending token and j run tokens
                sched._append_token(req, int(tokens[j, r]), math.nan, now)
                appended += 1
                if req.finished:
                    break
        sched.decode_run_steps = len(tokens)  # read by the next step's _budget_steps
        sched.counters["decode_tokens"] += appended
        sched.counters["decode_runs"] += 1
        sched.counters["decode_run_tokens"] += appended
        self.give_back(sched, decodes)
        for req in decodes:
            if req.finished and req in sched.running:
                sched.running.remove(req)
        return list(decodes)

    def give_back(self, sched: Scheduler, decodes: list[Req]) -> None:
        """Free each unfinished request's pages that hold no position below its kv_len (own
        pages are position-aligned: the run's first new page starts at the boundary after
        its kv_len before the run; a page starting at kv_len goes too, the next decode slot
        takes a new one there); a finished one gave back everything already."""
        size = sched.pool.page_size
        for req in decodes:
            if req.finished:
                continue
            kv_before, pages_before = self.before[id(req)]
            first_start = -(-kv_before // size) * size
            new = req.own_pages[pages_before:]
            keep = [p for i, p in enumerate(new) if first_start + i * size < req.kv_len]
            if len(keep) < len(new):
                sched.pool.decref(new[len(keep) :])
                req.own_pages = req.own_pages[:pages_before] + keep
