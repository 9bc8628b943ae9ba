"""Speculative decoding (runtime/scheduler/speculative.py): outputs are exactly those without it.

Three levels: the scheduler with the fake KV-checking runner (every config, preemption,
aborts), a tiny torch "model" whose logits are known exactly through the real sampler (seeded
outputs equal token for token; unseeded token frequencies equal by a chi-square test), and
SmolLM2 (greedy, constrained, stops, logprobs, streaming, mixed batches).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from family_models import COMMON, one_thread, tiny_tokenizer
from scipy.stats import chi2_contingency
from test_scheduler import CONFIGS, VOCAB, FakeRunner, make_req, make_scheduler, run_all, workload

from conftest import CHAT_PROMPTS, chat
from radixflow.runtime import Engine
from radixflow.runtime.cache.kv_pool import KVPool
from radixflow.runtime.config import ServerConfig
from radixflow.runtime.model_executor.sampler import sample
from radixflow.runtime.protocol.plan import BatchPlan, StepResult
from radixflow.runtime.protocol.sampling import SamplingParams
from radixflow.runtime.scheduler import speculative
from radixflow.runtime.scheduler.request import Req
from radixflow.runtime.scheduler.scheduler import Scheduler
from radixflow.runtime.scheduler.speculative import NgramTable, best_num_drafts

# exactness is checked at every batch size, above the default batch limit too
NGRAM = {"speculative_algorithm": "ngram", "speculative_disable_by_batch_size": 0}


# ---- drafting --------------------------------------------------------------------------------


def test_ngram_table_most_recent_continuation_within_its_sequence() -> None:
    table = NgramTable()
    table.add_sequence([1, 2, 3, 4, 1, 2, 3, 5, 6])
    table.add_sequence([7, 8, 9])
    assert table.continuation([9, 2, 3], 2, 4) == [5, 6]  # the latest "2 3", cut at its end
    assert table.continuation([1, 2, 3], 3, 1) == [5]
    assert table.continuation([7, 8], 2, 5) == [9]
    assert table.continuation([6, 7], 2, 5) == []  # no key spans two sequences
    assert table.continuation([8, 9], 2, 5) == []  # the last n-gram has no continuation yet
    table.append([7, 8])
    assert table.continuation([8, 9], 2, 5) == [7, 8]


def test_number_of_drafts_follows_acceptance() -> None:
    assert best_num_drafts(0.0, 8, 1) == 0
    assert best_num_drafts(0.9, 8, 1) >= 6
    assert 0 < best_num_drafts(0.5, 8, 1) < best_num_drafts(0.8, 8, 1)
    # in a big batch a draft row costs the whole batch: fewer drafts pay
    assert best_num_drafts(0.5, 8, 64) < best_num_drafts(0.5, 8, 1)


# ---- scheduler with the fake KV-checking runner ------------------------------------------------


class RepetitiveRunner(FakeRunner):
    """FakeRunner (checks every KV read), but four tokens in five are a function of the last
    token, so n-gram drafts are often right; the fifth still hashes the whole sequence."""

    def forward(self, plan: BatchPlan) -> StepResult:
        res = super().forward(plan)
        ids = []
        for i, token in zip(plan.sample_rows.tolist(), res.next_token_ids):
            last = int(plan.input_ids[int(plan.logit_rows[i])])
            ids.append(token if token % 5 == 0 else (last * 3 + 1) % (VOCAB - 1) + 1)
        return StepResult(ids, res.next_logprobs, res.target_logprobs)


def run_fake(config: dict, speculate: bool) -> tuple[list[list[int]], Scheduler]:
    sched, _ = make_scheduler(**config, **(NGRAM if speculate else {}))
    sched.runner = RepetitiveRunner()
    reqs = []
    for i, (prompt, n) in enumerate(workload(seed=1)):
        reqs.append(make_req(f"r{i}", prompt, n, ignore_eos=True))
        sched.add_request(reqs[-1])
        if i % 6 == 5:
            sched.step()  # arrivals during decoding
    run_all(sched)  # self_check after every step
    assert all(r.error is None for r in reqs)
    return [r.output_ids for r in reqs], sched


@pytest.mark.parametrize("config", CONFIGS, ids=[str(c) for c in CONFIGS])
def test_fake_outputs_equal_with_and_without_speculation(config: dict) -> None:
    plain, _ = run_fake(config, False)
    spec, sched = run_fake(config, True)
    assert spec == plain
    stats = sched.stats()
    assert stats["spec_accepted"] > 0 and stats["spec_proposed"] > stats["spec_accepted"]
    assert stats["forward_steps"] < run_fake(config, False)[1].stats()["forward_steps"]


def test_no_drafts_while_the_batch_is_above_the_limit() -> None:
    """--speculative-disable-by-batch-size 3: while more than three requests decode none
    gets drafts; with three or fewer left they draft again. Outputs stay those without."""

    def run(**config) -> tuple[list[list[int]], Scheduler, list[tuple[int, int]]]:
        sched, _ = make_scheduler(**config)
        sched.runner = RepetitiveRunner()
        seen: list[tuple[int, int]] = []  # (decoding requests, verifying requests) per step
        propose = sched.spec.propose
        sched.spec.propose = lambda running, *a: (
            seen.append((len(running), len(out := propose(running, *a)))) or out
        )
        reqs = [
            make_req(f"r{i}", p, 10 + 10 * i, ignore_eos=True)
            for i, (p, _) in enumerate(workload(3, 6))
        ]
        for req in reqs:
            sched.add_request(req)
        run_all(sched)
        return [r.output_ids for r in reqs], sched, seen

    plain, _, _ = run()
    limited, sched, seen = run(speculative_algorithm="ngram", speculative_disable_by_batch_size=3)
    assert limited == plain
    assert all(verifying == 0 for decoding, verifying in seen if decoding > 3)
    assert any(verifying > 0 for decoding, verifying in seen if decoding <= 3)
    assert any(decoding > 3 for decoding, _ in seen)
    assert sched.stats()["spec_batch_off_steps"] > 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_abort_while_speculating_frees_everything(page_size: int) -> None:
    sched, _ = make_scheduler(page_size=page_size, **NGRAM)
    sched.runner = RepetitiveRunner()
    reqs = [make_req(f"r{i}", p, 60, ignore_eos=True) for i, (p, _) in enumerate(workload(2, 6))]
    for req in reqs:
        sched.add_request(req)
    verified = 0
    for _ in range(40):
        sched.step()
        verified += len(sched.spec.verifying)
        if verified > 6:
            break
    assert verified > 6, "nothing speculated"
    for req in reqs[::2]:
        sched.abort(req.rid)
    sched.check_invariants()
    run_all(sched)
    for req in reqs:
        sched.abort(req.rid)
    assert sched.tree.protected_size == 0
    assert sched.pool.num_free_pages + int((sched.tree.check()[1:] > 0).sum()) == (
        sched.pool.capacity_pages
    )


def test_stops_and_max_tokens_hold_while_speculating() -> None:
    """A stop id or max_new_tokens inside an accepted run of drafts ends the request there."""
    plain, _ = make_scheduler()
    spec, _ = make_scheduler(**NGRAM)
    for sched in (plain, spec):
        sched.runner = RepetitiveRunner()
    outs = {}
    for name, sched in (("plain", plain), ("spec", spec)):
        reqs = [
            make_req(f"{name}{i}", p, n, ignore_eos=True, stop_token_ids=stop)
            for i, ((p, _), n, stop) in enumerate(
                zip(workload(3, 12), [1, 2, 3, 5, 9, 40] * 2, [[], [], [], [7], [11], [13]] * 2)
            )
        ]
        for req in reqs:
            sched.add_request(req)
        run_all(sched)
        outs[name] = [(r.output_ids, r.finish_reason) for r in reqs]
    assert outs["spec"] == outs["plain"]
    assert spec.stats()["spec_accepted"] > 0


# ---- the real sampler on a tiny model with known logits ---------------------------------------

TINY_VOCAB = 8


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch):
    """Draft the most, even in a big batch; tiny tensors run fastest on one thread."""
    monkeypatch.setattr(speculative, "ROW_COST", 0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class TinyLM:
    """Logits depend on the row's input token only (a fixed random table, peaked enough that
    n-gram drafts are right about half the time); sampling is radixflow's own sampler."""

    def __init__(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.randn(TINY_VOCAB, TINY_VOCAB, generator=gen) * 1.5
        self.generator = torch.Generator().manual_seed(seed + 1)

    def forward(self, plan: BatchPlan) -> StepResult:
        inputs = torch.from_numpy(plan.input_ids[plan.logit_rows[plan.sample_rows]])
        logits = self.table[inputs].clone()  # (S, V)
        ids, logprobs = sample(logits, plan, self.generator)
        return StepResult(ids, logprobs, np.full(len(plan.logit_rows), np.nan))


def run_tiny(speculate: bool, num: int, seeded: bool, **sampling) -> tuple[np.ndarray, Scheduler]:
    cfg = ServerConfig(self_check=True, max_total_tokens=2048, max_running_requests=64)
    if speculate:
        cfg = cfg.replace(**NGRAM, speculative_num_draft_tokens=4)
    sched = Scheduler(
        cfg,
        TinyLM(),
        KVPool(cfg.max_total_tokens, cfg.page_size),
        eos_token_ids=(0,),
        context_len=4096,
        vocab_size=TINY_VOCAB,
        decode=lambda ids: "",
    )
    prompt = [3, 5, 1, 3, 5, 2, 6, 3, 5, 1, 7, 4, 3, 5]
    reqs = []
    for i in range(num):
        params = {"max_new_tokens": 6, "ignore_eos": True, **sampling}
        params["seed"] = 1000 + i if seeded else None
        reqs.append(Req(f"t{i}", list(prompt), SamplingParams.from_dict(params)))
        sched.add_request(reqs[-1])
    run_all(sched)
    return np.array([r.output_ids for r in reqs]), sched


@pytest.mark.parametrize(
    "sampling", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 4, "frequency_penalty": 0.5}]
)
def test_seeded_sampling_is_token_exact(sampling: dict, tiny: None) -> None:
    plain, _ = run_tiny(False, 200, True, **sampling)
    spec, sched = run_tiny(True, 200, True, **sampling)
    assert sched.stats()["spec_accepted"] > 100
    assert (spec == plain).all()


def test_sampled_token_frequencies_unchanged(tiny: None) -> None:
    """Unseeded (the global generator is consumed in another order): per position, the token
    counts with and without speculation pass a chi-square homogeneity test, and so do the
    counts of each pair of consecutive tokens (what follows what)."""
    plain, _ = run_tiny(False, 2000, False, temperature=1.0)
    spec, sched = run_tiny(True, 2000, False, temperature=1.0)
    stats = sched.stats()
    assert 0.2 < stats["spec_acceptance_rate"] < 0.9, stats  # both branches of the rule run

    def columns(out: np.ndarray) -> list[np.ndarray]:
        """Each position's token, then each consecutive pair (the conditionals)."""
        pairs = [out[:, i] * TINY_VOCAB + out[:, i + 1] for i in range(out.shape[1] - 1)]
        return [out[:, i] for i in range(out.shape[1])] + pairs

    for a, b in zip(columns(plain), columns(spec)):
        size = TINY_VOCAB * TINY_VOCAB
        counts = np.stack([np.bincount(a, minlength=size), np.bincount(b, minlength=size)])
        counts = counts[:, counts.sum(0) > 0]
        p_value = chi2_contingency(counts)[1]
        assert p_value > 1e-3, (p_value, counts)


# ---- the real model runner and CPU attention on a tiny random Llama ----------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A 2-layer Llama with SmolLM2's attention shape (3 query heads per KV head, head_dim
    64 -> 32 here) and random weights, saved as a checkpoint the Engine loads."""
    with one_thread():
        config = transformers.LlamaConfig(
            **{**COMMON, "hidden_size": 96, "num_attention_heads": 3, "num_key_value_heads": 1,
               "num_hidden_layers": 2, "max_position_embeddings": 512},
        )  # fmt: skip
        torch.manual_seed(18)
        model = transformers.LlamaForCausalLM(config).float().eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(1.0, 0.3)
        path = tmp_path_factory.mktemp("spec") / "llama"
        model.save_pretrained(path, safe_serialization=True)
        tiny_tokenizer().save_pretrained(path)
        yield path


def oracle_drafts(truth: dict[tuple[int, ...], list[int]], seed: int):
    """Speculator._draft replacement: a random number of the right next tokens (from the run
    without speculation), then random wrong ones, up to the limit: every acceptance length
    0..k occurs, and verify rows mix with prefills, chunks and plain decodes in one step."""
    rng = np.random.default_rng(seed)

    def draft(self, req: Req, limit: int, batch_size: int) -> list[int]:
        done = len(req.output_ids)
        right = truth[tuple(req.input_ids)][done : done + int(rng.integers(0, limit + 1))]
        return (right + rng.integers(0, 256, size=limit).tolist())[:limit]

    return draft


@pytest.mark.parametrize(
    "config",
    [{"page_size": 1}, {"page_size": 16, "chunked_prefill_size": 16, "max_running_requests": 6}],
    ids=["page1", "page16-chunked"],
)
def test_real_kernels_greedy_equal_under_adversarial_drafts(
    tiny_llama, config: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The FakeRunner checks which KV is read, not the attention over it: here the real
    runner and CPU attention (shared-prefix runs of 64+ keys, GQA, verify rows beside
    prefills and decodes, slots of rejected drafts reused) give the plain greedy output."""
    rng = np.random.default_rng(7)
    shared = rng.integers(0, 256, size=80).tolist()  # a run the cascade path reads once
    prompts = [
        (shared[: int(rng.integers(64, 81))] if i % 3 else [])
        + rng.integers(0, 256, 9 + i).tolist()
        for i in range(12)
    ]
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    with one_thread():
        plain = Engine(
            model=str(tiny_llama), device="cpu", dtype="float32", max_total_tokens=2048,
            self_check=True, **config,
        )  # fmt: skip
        try:
            truth = {tuple(p): plain.generate(input_ids=p, sampling_params=params)["output_ids"]
                     for p in prompts}  # fmt: skip
            monkeypatch.setattr(speculative.Speculator, "_draft", oracle_drafts(truth, 3))
            monkeypatch.setattr(speculative, "ROW_COST", 0.0)
            spec = plain.with_config(**NGRAM, speculative_num_draft_tokens=6)
            got = spec.generate(input_ids=prompts, sampling_params=params)
            stats = spec.stats()
            spec.check_idle()
            spec.shutdown()
        finally:
            plain.shutdown()
    assert [o["output_ids"] for o in got] == [truth[tuple(p)] for p in prompts]
    assert stats["spec_accepted"] > 100
    assert stats["spec_proposed"] - stats["spec_accepted"] > 100


# ---- SmolLM2 --------------------------------------------------------------------------------

# SmolLM2 tests: slow here (2 shared cores; the four took 16 min at load 5-8)
SLOW = pytest.mark.slow

REPEATING = [
    chat("Repeat exactly: the red fox jumps over the lazy dog. the red fox jumps over the"),
    chat("Count from 1 to 30, separated by commas."),
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
]


@pytest.fixture(scope="module")
def spec_engine(make_engine):
    return make_engine(**NGRAM, max_total_tokens=16384)


def watch_mixing(engine) -> list[tuple[int, int]]:
    """Record (verifying, running) per step."""
    seen: list[tuple[int, int]] = []
    spec = engine.scheduler.spec
    propose = spec.propose

    def recording(running, *args):
        verifying = propose(running, *args)
        seen.append((len(verifying), len(running)))
        return verifying

    spec.propose = recording
    return seen


BATCH_PROMPTS = [chat(p) for p in CHAT_PROMPTS] + [
    REPEATING[0],
    REPEATING[1],
    chat("Spell the word banana letter by letter, separated by dashes."),
    chat("Repeat the word 'echo' ten times."),
]


def test_one_greedy_batch_of_chats_equals_it_without_speculation(engine, spec_engine) -> None:
    """Nine chats as ONE batch, greedy, with n-gram drafts and without: the same tokens per
    prompt (the slow tests below add constraints, stops, logprobs, streaming)."""
    params = {"max_new_tokens": 24, "temperature": 0}
    before = spec_engine.stats()["spec_accepted"]
    expected = [o["output_ids"] for o in engine.generate(BATCH_PROMPTS, params)]
    got = [o["output_ids"] for o in spec_engine.generate(BATCH_PROMPTS, params)]
    for i, (ours, ref) in enumerate(zip(got, expected)):
        assert ours == ref, f"prompt {i}: {BATCH_PROMPTS[i]!r}"
    assert spec_engine.stats()["spec_accepted"] - before > 0, "no draft was accepted"
    spec_engine.check_idle()


@SLOW
def test_greedy_equal_on_the_test_prompts(engine, spec_engine) -> None:
    prompts = [chat(p) for p in CHAT_PROMPTS] + REPEATING
    params = {"max_new_tokens": 40, "temperature": 0}
    expected = [engine.generate(p, params)["output_ids"] for p in prompts]
    seen = watch_mixing(spec_engine)
    before = spec_engine.stats()["spec_accepted"]
    batched = spec_engine.generate(prompts, params)
    assert [o["output_ids"] for o in batched] == expected
    assert any(0 < v < r for v, r in seen), "no step mixed speculating and plain requests"
    alone = [spec_engine.generate(p, params)["output_ids"] for p in prompts]
    assert alone == expected
    assert spec_engine.stats()["spec_accepted"] - before > 40
    spec_engine.check_idle()


@SLOW
def test_constrained_and_stops_equal(engine, spec_engine) -> None:
    schema = (
        '{"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, '
        '"age": {"type": "integer"}}, "required": ["name", "age"]}'
    )
    cases = [
        (chat("Give a person as JSON."), {"json_schema": schema, "max_new_tokens": 40}),
        (chat("Give two people as JSON."), {"json_schema": schema, "max_new_tokens": 40}),
        (chat("Pick a number."), {"regex": r"([0-9]{2}, ){5}[0-9]{2}", "max_new_tokens": 30}),
        (REPEATING[0], {"stop": [" lazy"], "max_new_tokens": 40}),
        (REPEATING[1], {"stop": ["7,"], "max_new_tokens": 60}),
        (REPEATING[1], {"stop_token_ids": [28], "max_new_tokens": 60}),
        (REPEATING[2], {"max_new_tokens": 3}),
        (REPEATING[2], {"max_new_tokens": 24, "min_new_tokens": 24}),
    ]
    prompts = [p for p, _ in cases]
    params = [{"temperature": 0, **s} for _, s in cases]
    expected = engine.generate(prompts, params)
    got = spec_engine.generate(prompts, params)
    for ours, ref in zip(got, expected):
        assert ours["output_ids"] == ref["output_ids"]
        assert ours["text"] == ref["text"]
        assert ours["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"]
    spec_engine.check_idle()


@SLOW
def test_logprobs_seeded_sampling_and_streaming_equal(engine, spec_engine) -> None:
    prompt = REPEATING[0]
    params = {"temperature": 0, "max_new_tokens": 24}
    ref = engine.generate(prompt, params, return_logprob=True, top_logprobs_num=3)
    ours = spec_engine.generate(prompt, params, return_logprob=True, top_logprobs_num=3)
    assert ours["output_ids"] == ref["output_ids"]
    ref_lp, our_lp = (
        ref["meta_info"]["output_token_logprobs"],
        ours["meta_info"]["output_token_logprobs"],
    )
    assert [t[1] for t in our_lp] == [t[1] for t in ref_lp]
    np.testing.assert_allclose([t[0] for t in our_lp], [t[0] for t in ref_lp], atol=2e-3)
    ref_top = ref["meta_info"]["output_top_logprobs"]
    our_top = ours["meta_info"]["output_top_logprobs"]
    assert [[t[1] for t in row] for row in our_top] == [[t[1] for t in row] for row in ref_top]

    seeded = {"temperature": 0.8, "top_p": 0.95, "max_new_tokens": 32}
    for seed in (1, 2, 3):
        a = engine.generate(REPEATING[1], {**seeded, "seed": seed})["output_ids"]
        assert spec_engine.generate(REPEATING[1], {**seeded, "seed": seed})["output_ids"] == a

    chunks = list(spec_engine.generate(prompt, params, stream=True))
    final = chunks[-1]
    assert final["output_ids"] == ref["output_ids"] and final["text"] == ref["text"]
    for chunk in chunks[:-1]:
        assert ref["output_ids"][: len(chunk["output_ids"])] == chunk["output_ids"]
        assert ref["text"].startswith(chunk["text"])
    assert len(chunks) - 1 < len(ref["output_ids"]), "accepted drafts arrive together"
    spec_engine.check_idle()


@SLOW
def test_abort_of_speculating_real_requests_leaks_nothing(spec_engine) -> None:
    sched = spec_engine.scheduler
    reqs = [
        Req(
            f"a{i}",
            spec_engine.tokenizer.encode(p),
            SamplingParams.from_dict({"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}),
        )
        for i, p in enumerate(REPEATING)
    ]
    for req in reqs:
        sched.add_request(req)
    for _ in range(30):
        sched.step()
        if sched.spec.verifying:
            break
    assert sched.spec.verifying, "nothing speculated"
    for req in reqs:
        sched.abort(req.rid)
    spec_engine.check_idle()


def test_speculation_off_by_default() -> None:
    assert ServerConfig().speculative_algorithm == ""
    assert speculative.Speculator(ServerConfig(), (0,)).propose([], 10, 1, 100) == []
