"""Decode runs (runtime/scheduler/decode_runs.py): several greedy decode steps in one runner
call give the tokens the steps one by one give, and hold no KV past what they keep.

Two levels: the scheduler with the fake KV-checking runner given a steps path (every config:
chunks, pages, preemption, arrivals), and SmolLM2 through the CPU decode loop's steps path
(greedy outputs, EOS, stop strings, max_new_tokens mid-run, 1-4 rows, what is not run).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_scheduler import (
    CONFIGS,
    VOCAB,
    FakeRunner,
    chain,
    expected_output,
    make_req,
    make_scheduler,
    run_all,
    workload,
)

from conftest import CHAT_PROMPTS, chat
from radixflow.runtime.protocol.sampling import SamplingParams
from radixflow.runtime.scheduler import decode_runs
from radixflow.runtime.server.metrics import Metrics


class StepsRunner(FakeRunner):
    """FakeRunner with a steps path: each step of a decode-only plan as its decode rows would
    run, the slots each step writes and reads checked against the store. Every third call
    is declined (the real runner declines what its loop does not take), so the plain step
    runs on pages grown for the run."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward_steps(self, plan, slots: np.ndarray) -> np.ndarray | None:
        assert plan.num_extend_tokens == 0 and slots.shape[1] == plan.num_tokens
        self.calls += 1
        if self.calls % 3 == 0:
            return None
        dkv = plan.decode_kv_indptr
        tokens = np.zeros(slots.shape, dtype=np.int64)
        for r in range(plan.num_tokens):
            own = plan.decode_kv_indices[dkv[r] : dkv[r + 1]]
            assert int(own[-1]) == int(slots[0, r]) == int(plan.out_slots[r])
            token, position = int(plan.input_ids[r]), int(plan.positions[r])
            for j in range(len(slots)):
                kv = np.concatenate([own, slots[1 : j + 1, r]])
                h = chain(self._chain_hash(kv[:-1]), token)
                self.store[int(slots[j, r])] = (position + j, h)
                self.tokens_computed += 1
                token = 1 + h % (VOCAB - 1)
                tokens[j, r] = token
        return tokens


def scheduler_with_steps(**config):
    sched, _ = make_scheduler(**config)
    sched.runner = StepsRunner()
    return sched


@pytest.mark.parametrize("config", CONFIGS, ids=[str(c) for c in CONFIGS])
def test_runs_give_the_steps_tokens_under_every_config(config: dict) -> None:
    sched = scheduler_with_steps(**config)
    reqs = []
    for i, (prompt, n) in enumerate(workload(seed=2, num=10)):
        req = make_req(f"r{i}", prompt, n, ignore_eos=True)
        reqs.append(req)
        sched.add_request(req)
        sched.step()  # arrivals while earlier requests decode
        if i % 3 == 2:
            for _ in range(12):  # few enough running for runs between arrivals
                sched.step()
    run_all(sched)
    for req in reqs:
        assert req.error is None, req.error
        assert req.output_ids == expected_output(req.input_ids, req.sampling.max_new_tokens)
    assert sched.counters["decode_runs"] > 0
    assert sched.counters["decode_run_tokens"] > sched.counters["decode_runs"]
    assert sched.counters["decode_tokens"] == sum(len(r.output_ids) - 1 for r in reqs)
    lines = Metrics(sched.stats).render().decode().splitlines()
    assert f"radixflow:decode_runs_total {sched.counters['decode_runs']}" in lines
    assert f"radixflow:decode_run_tokens_total {sched.counters['decode_run_tokens']}" in lines
    sched.tree.flush()
    assert sched.pool.num_free_pages == sched.pool.capacity_pages  # nothing held past the end


def test_run_length_follows_the_batch() -> None:
    sched = scheduler_with_steps(num_continuous_decode_steps=8)
    req = lambda n=100, **kw: SimpleNamespace(
        sampling=SamplingParams.from_dict({"max_new_tokens": n, "temperature": 0, **kw}),
        return_logprob=False, grammar=None, lora=0, draft_ids=[], output_ids=[5], kv_len=30,
        remaining_new_tokens=lambda: n - 1,
    )  # fmt: skip
    assert decode_runs.run_length(sched, [req()], False) == 8
    assert decode_runs.run_length(sched, [req(), req(5)], False) == 4  # 4 tokens left
    assert decode_runs.run_length(sched, [req()] * 5, False) == 1  # past the team's 4 rows
    assert decode_runs.run_length(sched, [req()], True) == 1  # verify or jumped rows too
    assert decode_runs.run_length(sched, [req(temperature=0.7)], False) == 1
    assert decode_runs.run_length(sched, [req(repetition_penalty=1.1)], False) == 1
    assert decode_runs.run_length(sched, [req(logit_bias={"3": 1.0})], False) == 1
    assert decode_runs.run_length(sched, [req(min_new_tokens=4)], False) == 1  # EOS banned
    logprobs = req()
    logprobs.return_logprob = True
    assert decode_runs.run_length(sched, [logprobs], False) == 1
    sched.waiting.append(req())  # a request to admit: schedule it now, not after a run
    assert decode_runs.run_length(sched, [req()], False) == 1
    sched.waiting.clear()
    sched.context_len = 33
    assert decode_runs.run_length(sched, [req()], False) == 3  # positions 30-32
    sched.context_len = 100_000
    # about RUN_BUDGET_S (50 ms) of steps at the last decode step's time a token
    sched.metrics.steps.append((0.03, 1, 0, "nothing_waiting"))  # a 30 ms token
    assert decode_runs.run_length(sched, [req()], False) == 1
    sched.metrics.steps.append((0.01, 1, 0, "nothing_waiting"))
    assert decode_runs.run_length(sched, [req()], False) == 5
    sched.metrics.steps.append((0.05, 1, 0, "nothing_waiting"))
    sched.decode_run_steps = 8  # that step was a run of 8 tokens: 6 ms a token
    assert decode_runs.run_length(sched, [req()], False) == 8
    sched.metrics.steps.append((0.5, 0, 300, "nothing_waiting"))  # a prefill: the last
    assert decode_runs.run_length(sched, [req()], False) == 8  # decode step's time holds
    sched.metrics.steps.append((0.2, 1, 0, "nothing_waiting"))  # a 7B's 200 ms token
    assert decode_runs.run_length(sched, [req()], False) == 1
    sched.metrics.steps.append((3.0, 0, 500, "nothing_waiting"))  # its next prompt
    assert decode_runs.run_length(sched, [req()], False) == 1  # its first decode: no run
    sched.metrics.steps.append((0.04, 1, 0, "nothing_waiting"))  # a run of 8, 5 ms a token
    sched.decode_run_steps = 8
    assert decode_runs.run_length(sched, [req()], False) == 8
    assert decode_runs.run_length(sched, [req()], False) == 8  # read once: idle steps between
    sched.config = sched.config.replace(num_continuous_decode_steps=1)
    assert decode_runs.run_length(sched, [req()], False) == 1


# ---- SmolLM2 through the CPU decode loop -------------------------------------------------------


@pytest.fixture(scope="module")
def single_steps(make_engine):
    return make_engine(num_continuous_decode_steps=1)


@pytest.fixture
def two_threads(engine, single_steps, monkeypatch):
    """Runs take the decode loop's team path: two threads, held while the test runs (the
    `--num-threads auto` governor drops one on a busy machine), and no split tuner still
    timing single steps (runs wait for it)."""
    for eng in (engine, single_steps):
        monkeypatch.setattr(eng.scheduler.runner, "governor", None)
        monkeypatch.setattr(eng.scheduler.runner, "split", None)
    monkeypatch.setattr(decode_runs, "RUN_BUDGET_S", 1e9)  # a busy machine's slow steps
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_runs_keep_the_greedy_tokens_on_smollm2(engine, single_steps, two_threads) -> None:
    """1 and 4 rows, lengths that end mid-run, EOS and a stop string: the same text and finish
    as a step per token, the steps run as fewer calls, every page back at the end."""
    prompts = [chat(p) for p in CHAT_PROMPTS[:4]]
    params = [
        {"max_new_tokens": 37, "temperature": 0, "ignore_eos": True},
        {"max_new_tokens": 300, "temperature": 0},  # to its EOS
    ]
    before = engine.stats()
    for sampling in params:
        for rows in (1, 4):
            got = engine.generate(prompts[:rows], sampling)
            want = single_steps.generate(prompts[:rows], sampling)
            assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
            assert [o["meta_info"]["finish_reason"] for o in got] == [
                o["meta_info"]["finish_reason"] for o in want
            ]
    eos = [o["meta_info"]["finish_reason"]["type"] for o in got]
    assert "stop" in eos, eos  # some ended at EOS, inside a run
    text = single_steps.generate(prompts[0], params[1])["text"]
    stop = text.split()[5]  # a word some tokens in: a stop string that ends a run early
    sampling = {**params[1], "stop": [stop]}
    got, want = (e.generate(prompts[0], sampling) for e in (engine, single_steps))
    assert got["text"] == want["text"] and got["output_ids"] == want["output_ids"]
    assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    after = engine.stats()
    runs = after["decode_runs"] - before["decode_runs"]
    tokens = after["decode_run_tokens"] - before["decode_run_tokens"]
    assert runs > 0 and tokens > 4 * runs, (runs, tokens)
    assert single_steps.stats()["decode_runs"] == 0
    engine.flush_cache()
    assert engine.scheduler.pool.num_free_pages == engine.scheduler.pool.capacity_pages


def test_what_a_run_does_not_take_steps_one_by_one(engine, two_threads) -> None:
    before = engine.stats()["decode_runs"]
    prompt = chat(CHAT_PROMPTS[0])
    engine.generate(prompt, {"max_new_tokens": 24, "temperature": 0.8, "seed": 3})
    engine.generate(prompt, {"max_new_tokens": 24, "temperature": 0}, return_logprob=True)
    engine.generate([prompt] * 5, {"max_new_tokens": 24, "temperature": 0})
    assert engine.stats()["decode_runs"] == before
