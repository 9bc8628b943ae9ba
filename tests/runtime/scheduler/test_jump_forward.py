"""Jump-forward in the scheduler (runtime/scheduler/jump_forward.py) with the KV-checking fake
model and a fake grammar, no torch: forced tokens are appended without sampling and extended
together, outputs and logprobs equal those of sampling every token under the grammar's mask,
fewer forward steps run, and chunking, preemption, the radix cache and n-gram drafts all see
ordinary KV."""

from __future__ import annotations

import numpy as np
import pytest
from test_scheduler import VOCAB, FakeRunner, chain, make_req, make_scheduler, run_all

from radixflow.runtime.constrained.compiler import GrammarError
from radixflow.runtime.protocol.plan import BatchPlan, StepResult
from radixflow.runtime.scheduler.request import Req
from radixflow.runtime.scheduler.scheduler import Scheduler
from radixflow.runtime.server.metrics import Metrics

WORDS = -(-VOCAB // 32)
NGRAM = {"speculative_algorithm": "ngram", "speculative_disable_by_batch_size": 0}


def forced_token(i: int) -> int:
    return 1 + (7 * i + 3) % (VOCAB - 1)


def logprob_of(row_hash: int) -> float:
    """The fake model's logprob of whatever follows a position: any function of the sequence."""
    return -(row_hash % 97) / 10


class FakeGrammar:
    """Output position i is forced to `forced_token(i)` when i % period < forced, free (any
    token but EOS 0) otherwise; the grammar ends after `length` tokens. With `merge`, a
    sampled token divisible by 4 before a forced run is "retokenized" into itself + 1."""

    def __init__(self, period: int, forced: int, length: int, merge: bool) -> None:
        self.period, self.forced, self.length, self.merge = period, forced, length, merge
        self.i = 0
        self.words = WORDS

    def forced_at(self, i: int) -> int | None:
        return forced_token(i) if i < self.length and i % self.period < self.forced else None

    def fill_mask(self, row: np.ndarray) -> None:
        token = self.forced_at(self.i)
        bits = np.zeros(32 * WORDS, dtype=np.uint8)
        if self.i >= self.length:
            bits[0] = 1
        elif token is not None:
            bits[token] = 1
        else:
            bits[1:VOCAB] = 1
        row[:] = np.packbits(bits, bitorder="little").view(np.int32)

    def accept(self, token: int) -> None:
        expected = self.forced_at(self.i)
        if self.i >= self.length or token == 0 or expected not in (None, token):
            raise GrammarError(f"token {token} at {self.i}")
        self.i += 1

    def is_terminated(self) -> bool:
        return self.i >= self.length

    def forced_tokens(self, last: int | None) -> tuple[int, list[int]]:
        run, i = [], self.i
        while (token := self.forced_at(i)) is not None:
            run.append(token)
            i += 1
        if run and self.merge and last is not None and last % 4 == 0:
            return 1, [last + 1, *run]
        return 0, run

    def rollback(self, num_tokens: int) -> None:
        self.i -= num_tokens

    def copy(self) -> FakeGrammar:
        return FakeGrammar(self.period, self.forced, self.length, self.merge)


class FakeGrammars:
    """Grammar keys ("regex", "period,forced,length[,merge]") to FakeGrammars, at once."""

    def submit(self, key: tuple[str, str]) -> None:
        pass

    def poll(self, key: tuple[str, str]) -> FakeGrammar:
        period, forced, length, *merge = (int(x) for x in key[1].split(","))
        return FakeGrammar(period, forced, length, bool(merge and merge[0]))


class MaskedRunner(FakeRunner):
    """FakeRunner (every KV read checked) whose sampler honours the grammar masks (the hashed
    token, else the next allowed one) and whose logprobs are `logprob_of` the row's hash."""

    def forward(self, plan: BatchPlan) -> StepResult:
        res = super().forward(plan)
        ids = list(res.next_token_ids)
        if plan.vocab_masks is not None:
            for s, token in enumerate(ids):
                bits = np.unpackbits(plan.vocab_masks[s].view(np.uint8), bitorder="little")
                ids[s] = next(t % VOCAB for t in range(token, token + VOCAB) if bits[t % VOCAB])
        rows = [logprob_of(h) for h in self.row_hashes]
        sampled = [rows[int(i)] for i in plan.sample_rows]
        return StepResult(ids, sampled, np.asarray(rows))


def simulate(prompt: list[int], n: int, spec: str | None, jump: bool) -> tuple[list, list]:
    """The output ids and logprobs a request must get: each token sampled under the mask
    (forced ones are the only choice), a merged token replacing a sampled one where a jump
    follows it (jump-forward on, grammar with merge)."""
    h = 0
    for token in prompt:
        h = chain(h, token)
    grammar = FakeGrammars().poll(("regex", spec)) if spec else None
    out: list[int] = []
    logprobs: list[float] = []
    while len(out) < n and not (grammar and grammar.is_terminated()):
        lp = logprob_of(h)
        forced = grammar.forced_at(len(out)) if grammar else None
        token = forced if forced is not None else 1 + h % (VOCAB - 1)
        if grammar:
            grammar.accept(token)
        if jump and grammar and grammar.merge and forced is None and token % 4 == 0:
            if len(out) + 1 < n and grammar.forced_at(len(out) + 1) is not None:
                token += 1  # replaced before its KV exists: the chain sees the merged token
        out.append(token)
        logprobs.append(lp)
        h = chain(h, token)
    return out, logprobs


SPECS = ["6,3,21", "5,4,40,1", "7,2,16", None, "4,3,19,1", "9,1,30"]


def run(config: dict, jump: bool, return_logprob: bool = False) -> tuple[list[Req], object]:
    sched, _ = make_scheduler(**config, disable_jump_forward=not jump)
    sched.runner, sched.grammars = MaskedRunner(), FakeGrammars()
    rng = np.random.default_rng(4)
    stem = rng.integers(1, VOCAB, size=40).tolist()
    reqs = []
    for i in range(18):
        spec = SPECS[i % len(SPECS)]
        prompt = stem[: 10 + 2 * i] + rng.integers(1, VOCAB, size=int(rng.integers(1, 20))).tolist()
        sampling = {"regex": spec} if spec else {"ignore_eos": True}
        req = make_req(f"j{i}", prompt, int(rng.integers(10, 45)), **sampling)
        req.return_logprob = return_logprob
        reqs.append(req)
        sched.add_request(req)
        if i % 5 == 4:
            sched.step()  # arrivals during decoding
    run_all(sched)
    assert sched.tree.flush(), "a lock is still held"
    assert sched.pool.num_free_slots == sched.stats()["total_slots"], "KV pages leaked"
    return reqs, sched


CONFIGS = [
    {},
    {"chunked_prefill_size": 16},
    {"page_size": 4},
    {"page_size": 16, "chunked_prefill_size": 16},
    {"disable_radix_cache": True},
    NGRAM,
]


@pytest.mark.parametrize("config", CONFIGS, ids=[str(c) for c in CONFIGS])
def test_jumped_outputs_equal_sampled_ones_in_fewer_steps(config: dict) -> None:
    reqs, sched = run(config, jump=True)
    for req in reqs:
        assert req.error is None, req.error
        spec = req.sampling.regex
        assert req.output_ids == simulate(req.input_ids, req.sampling.max_new_tokens, spec, True)[0]
        if spec:
            assert req.jump_forward_tokens > 0
            assert req.meta_info()["jump_forward_tokens"] == req.jump_forward_tokens
    _, off = run(config, jump=False)
    assert off.stats()["jump_forward_tokens"] == 0
    assert sched.counters["forward_steps"] < off.counters["forward_steps"]
    stats = sched.stats()
    assert stats["jump_forward_tokens"] == sum(r.jump_forward_tokens for r in reqs)
    assert 0 < stats["jump_forward_steps_saved"] <= stats["jump_forward_tokens"]
    lines = Metrics(sched.stats).render().decode().splitlines()
    assert f"radixflow:jump_forward_tokens_total {stats['jump_forward_tokens']}" in lines
    saved = stats["jump_forward_steps_saved"]
    assert f"radixflow:jump_forward_steps_saved_total {saved}" in lines


def test_every_computed_token_is_counted_once(monkeypatch) -> None:
    """prefill_tokens_computed + decode_tokens count each KV row computed once, a jump's rows
    (run as decode rows) among the decode tokens: without the radix cache or preemption that
    is the KV each request held when it finished, with jump-forward on and off."""
    held: list[int] = []
    real = Scheduler._finish

    def finish(self, req, reason):
        if not req.finished:
            held.append(req.kv_len)
        real(self, req, reason)

    monkeypatch.setattr(Scheduler, "_finish", finish)
    for jump in (True, False):
        held.clear()
        reqs, sched = run({"disable_radix_cache": True}, jump)
        c = sched.counters
        assert len(held) == len(reqs) and c["preemptions"] == 0
        assert c["prefill_tokens_computed"] + c["decode_tokens"] == sum(held)
        assert (sched.stats()["jump_forward_jumps"] > 0) == jump


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("return_logprob", [False, True])
def test_preempted_requests_resume_with_their_jumped_tokens(
    page_size: int, return_logprob: bool
) -> None:
    """A tiny pool and an optimistic decode estimate preempt requests, some between a jump
    and the extend of its tokens; each resumes (recomputing them) with the exact output."""
    sched, _ = make_scheduler(
        max_total_tokens=200, schedule_conservativeness=0.05, page_size=page_size
    )
    sched.runner, sched.grammars = MaskedRunner(), FakeGrammars()
    rng = np.random.default_rng(1)
    reqs = []
    for i in range(8):
        prompt = rng.integers(1, VOCAB, size=8).tolist()
        reqs.append(make_req(f"p{i}", prompt, 70, regex=["6,3,70", "5,3,70,1"][i % 2]))
        reqs[-1].return_logprob = return_logprob
        sched.add_request(reqs[-1])
    run_all(sched)
    assert sched.counters["preemptions"] > 0
    for req in reqs:
        assert req.error is None, req.error
        ids, logprobs = simulate(req.input_ids, 70, req.sampling.regex, not return_logprob)
        assert req.output_ids == ids
        if return_logprob:
            assert req.output_logprobs == pytest.approx(logprobs)
    assert sched.tree.flush() and sched.pool.num_free_slots == 200


@pytest.mark.parametrize("config", [{}, {"chunked_prefill_size": 16}])
def test_jumped_tokens_logprobs_come_from_the_extend(config: dict) -> None:
    """With logprobs, every output token has one (jumped ones from the extend's rows, a jump
    that ends the request waits for them), equal to sampling each token; nothing is merged."""
    reqs, sched = run(config, jump=True, return_logprob=True)
    ended_by_jump = 0
    for req in reqs:
        ids, logprobs = simulate(
            req.input_ids, req.sampling.max_new_tokens, req.sampling.regex, False
        )
        assert req.output_ids == ids
        assert req.output_logprobs == pytest.approx(logprobs)
        grammar = req.grammar
        ended_by_jump += bool(grammar and grammar.forced_at(grammar.length - 1) is not None)
    assert ended_by_jump and sched.stats()["jump_forward_tokens"] > 0


def test_streamed_tokens_wait_for_their_logprobs() -> None:
    sched, _ = make_scheduler()
    sched.runner, sched.grammars = MaskedRunner(), FakeGrammars()
    req = make_req("s", [5, 6, 7], 30, regex="6,3,21")
    req.return_logprob = True
    sched.add_request(req)
    seen_ahead = False
    while sched.has_work:
        sched.step()
        ready = req.num_ready_outputs
        assert ready == len(req.output_logprobs) <= len(req.output_ids)
        seen_ahead |= ready < len(req.output_ids) and not req.finished
    assert seen_ahead, "jumped tokens were never pending"
    assert len(req.output_logprobs) == len(req.output_ids) == 21
    assert req.finish_reason == {"type": "stop", "matched": "grammar"}


@pytest.mark.parametrize("limit", [1, 2, 4, 8])
def test_a_jump_never_runs_past_max_new_tokens(limit: int) -> None:
    sched, _ = make_scheduler()
    sched.runner, sched.grammars = MaskedRunner(), FakeGrammars()
    req = make_req("m", [9, 8, 7], limit, regex="10,9,40")  # nine forced tokens first
    sched.add_request(req)
    run_all(sched)
    assert req.output_ids == [forced_token(i) for i in range(limit)]
    assert req.finish_reason == {"type": "length", "length": limit}


def test_a_stop_token_inside_a_jump_ends_it_there() -> None:
    sched, _ = make_scheduler()
    sched.runner, sched.grammars = MaskedRunner(), FakeGrammars()
    req = make_req("t", [9, 8, 7], 30, regex="10,9,40", stop_token_ids=[forced_token(4)])
    sched.add_request(req)
    run_all(sched)
    assert req.output_ids == [forced_token(i) for i in range(5)]
    assert req.finish_reason == {"type": "stop", "matched": forced_token(4)}


def test_jumped_tokens_found_in_the_tree_are_still_scored() -> None:
    """A second identical request jumps the same text before its prefill, and the tree holds
    that text's KV already (the first one's): its logprobs are computed, not skipped."""
    sched, _ = make_scheduler()
    sched.runner, sched.grammars = MaskedRunner(), FakeGrammars()
    reqs = [make_req(f"twin{i}", [3, 1, 4, 1, 5], 30, regex="8,5,30") for i in range(2)]
    for req in reqs:
        req.return_logprob = True
    sched.add_request(reqs[0])
    for _ in range(3):
        sched.step()
    sched.add_request(reqs[1])
    run_all(sched)
    ids, logprobs = simulate(reqs[0].input_ids, 30, "8,5,30", False)
    for req in reqs:
        assert req.output_ids == ids
        assert req.output_logprobs == pytest.approx(logprobs)
    assert reqs[1].cached_tokens == len(reqs[1].input_ids) - 1
