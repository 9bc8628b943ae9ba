"""Draft-model speculative decoding (runtime/scheduler/draft_model.py): outputs are exactly
those without it.

Three levels: the rejection sampler as a pure function against the target distribution
(total variation and chi-square over many draws; a sampler whose residual is p instead of
norm(max(p - q, 0)) fails the same check); the scheduler with the fake KV-checking runner as
target and a second, noisy fake as draft (every config: chunked prefill, pages, preemption,
no radix cache; the draft's own pool and tree leak nothing); SmolLM2 dequantized to fp32
drafted by its own Q4_1 GGUF (greedy and constrained outputs equal the target alone, a draft
with another tokenizer refused at start).
"""

from __future__ import annotations

import numpy as np
import pytest
from family_models import one_thread, save_family
from scipy.stats import chi2_contingency, chisquare
from test_scheduler import (
    CONFIGS,
    VOCAB,
    FakeRunner,
    chain,
    make_req,
    make_scheduler,
    run_all,
    workload,
)
from test_speculative import RepetitiveRunner

from conftest import CHAT_PROMPTS, chat
from radixflow.runtime import Engine
from radixflow.runtime.cache.kv_pool import KVPool
from radixflow.runtime.protocol.plan import BatchPlan, StepResult
from radixflow.runtime.scheduler import draft_model
from radixflow.runtime.scheduler.draft_model import (
    DraftMismatchError,
    DraftSpeculator,
    best_draft_length,
    rejection_sample,
)
from radixflow.runtime.server.metrics import Metrics

DRAFT = {"speculative_algorithm": "draft", "speculative_draft_model_path": "smollm2"}

# ---- the rejection sampler ----------------------------------------------------------------


def residual_is_p(p, q, drafts, rng) -> list[int]:
    """A broken sampler: after a rejection it draws from p instead of the residual."""
    out = []
    for j, x in enumerate(drafts):
        if rng.random() * q[j, x] < p[j, x]:
            out.append(int(x))
            continue
        return [*out, int(rng.choice(len(p[j]), p=p[j]))]
    return [*out, int(rng.choice(len(p[-1]), p=p[-1]))]


def emitted_frequencies(sampler, p, q, draws: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Counts of the first emitted token, and of the second where one follows an accepted
    first draft; each draft is drawn from its q row."""
    rng = np.random.default_rng(seed)
    vocab = p.shape[1]
    first, second = np.zeros(vocab), np.zeros(vocab)
    for _ in range(draws):
        drafts = [int(rng.choice(vocab, p=row)) for row in q]
        out = sampler(p, q, drafts, rng)
        assert 1 <= len(out) <= len(drafts) + 1
        assert out[:-1] == drafts[: len(out) - 1]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    return first, second


def total_variation(counts: np.ndarray, probs: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - probs).sum())


def distributions(seed: int, vocab: int = 6, k: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """A target p (k + 1 rows) and a draft q (k rows) that disagree a lot."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(vocab, 0.7), size=k + 1)
    q = rng.dirichlet(np.full(vocab, 0.7), size=k)
    return p, q


def test_rejection_sampler_emits_the_target_distribution() -> None:
    """Whatever q proposes, each emitted token is distributed as p at its position: the
    first as p[0], the one after an accepted draft as p[1] (chi-square and total variation
    over 20,000 draws); the broken sampler (residual replaced by p) fails the same test."""
    seed = 0
    p, q = distributions(seed)
    draws = 20_000
    first, second = emitted_frequencies(rejection_sample, p, q, draws, seed)
    assert total_variation(first, p[0]) < 0.015
    assert chisquare(first, p[0] * first.sum()).pvalue > 1e-4
    assert total_variation(second, p[1]) < 0.03
    assert chisquare(second, p[1] * second.sum()).pvalue > 1e-4
    broken, _ = emitted_frequencies(residual_is_p, p, q, draws, seed)
    assert total_variation(broken, p[0]) > 0.03
    assert chisquare(broken, p[0] * broken.sum()).pvalue < 1e-6


def test_point_mass_draft_is_the_runtime_rule() -> None:
    """The runtime's draft is the draft model's argmax, q = delta(x): keeping x with
    probability p(x) and otherwise drawing from p without x, the verification rule (sample
    from p, keep the draft if the sample is it) has the same distribution."""
    p, _ = distributions(3, k=1)
    x = 2
    q = np.zeros((1, p.shape[1]))
    q[0, x] = 1.0
    rng = np.random.default_rng(5)
    kept = sum(rejection_sample(p, q, [x], rng)[0] == x for _ in range(20_000))
    assert abs(kept / 20_000 - p[0, x]) < 0.015
    first, _ = emitted_frequencies(rejection_sample, p, q, 20_000, 6)
    assert total_variation(first, p[0]) < 0.02


def test_draft_length_follows_acceptance() -> None:
    assert best_draft_length(0.1, 8, 1) == 0
    assert 0 < best_draft_length(0.6, 8, 1) < best_draft_length(0.95, 8, 1)
    assert best_draft_length(0.8, 8, 64) < best_draft_length(0.8, 8, 1)


# ---- the scheduler with fake runners ------------------------------------------------------


class NoisyDraft(RepetitiveRunner):
    """The target's rule (RepetitiveRunner) on its own KV store, wrong one row in three."""

    def forward(self, plan: BatchPlan) -> StepResult:
        res = super().forward(plan)
        ids = [
            t if self.row_hashes[int(i)] % 3 else (t % (VOCAB - 1)) + 1
            for i, t in zip(plan.sample_rows.tolist(), res.next_token_ids)
        ]
        return StepResult(ids, res.next_logprobs, res.target_logprobs)


def noisy_drafts(sequence: list[int], k: int) -> list[int]:
    """What NoisyDraft drafts after `sequence` when its KV holds exactly that sequence."""
    h = 0
    for token in sequence:
        h = chain(h, token)
    out, last = [], sequence[-1]
    for _ in range(k):
        token = 1 + h % (VOCAB - 1)
        token = token if token % 5 == 0 else (last * 3 + 1) % (VOCAB - 1) + 1
        token = token if h % 3 else (token % (VOCAB - 1)) + 1
        out.append(token)
        h, last = chain(h, token), token
    return out


def checked(spec: DraftSpeculator) -> DraftSpeculator:
    """Every step's drafts must be those of a draft whose KV is its request's own tokens
    (stale KV of rejected drafts, or another request's, would draft something else)."""
    propose = spec.propose

    def proposing(running, *args):
        verifying = propose(running, *args)
        for req in verifying:
            assert req.draft_ids == noisy_drafts(req.fill_ids, len(req.draft_ids)), req.rid
        return verifying

    spec.propose = proposing
    return spec


def run_fake(config: dict, speculate: bool) -> tuple[list[list[int]], object]:
    sched, _ = make_scheduler(**config)
    sched.runner = RepetitiveRunner()
    if speculate:
        cfg = sched.config.replace(**DRAFT, speculative_disable_by_batch_size=0)
        pool = KVPool(1024, 1)
        sched.spec = checked(DraftSpeculator(cfg, (0,), NoisyDraft(), pool, VOCAB, 100_000))
    reqs = []
    for i, (prompt, n) in enumerate(workload(seed=1)):
        reqs.append(make_req(f"r{i}", prompt, n, ignore_eos=True))
        sched.add_request(reqs[-1])
        if i % 6 == 5:
            sched.step()  # arrivals during decoding
    run_all(sched)  # self_check after every step
    assert all(r.error is None for r in reqs)
    return [r.output_ids for r in reqs], sched


@pytest.fixture
def free_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts cost nothing: every request drafts the most tokens at every batch size."""
    monkeypatch.setattr(DraftSpeculator, "cost", lambda self: 0.0)
    monkeypatch.setattr(draft_model, "ROW_COST", 0.0)


@pytest.mark.parametrize("config", CONFIGS, ids=[str(c) for c in CONFIGS])
def test_fake_outputs_equal_with_a_draft_model(config: dict, free_drafts) -> None:
    """Every KV read of both models is checked (FakeRunner); outputs equal those without
    drafts; after the run the draft holds no KV outside its tree, and its tree is sound."""
    plain, base = run_fake(config, False)
    spec, sched = run_fake(config, True)
    assert spec == plain
    stats = sched.stats()
    assert stats["spec_accepted"] > 0 and stats["spec_proposed"] > stats["spec_accepted"]
    assert stats["forward_steps"] < base.stats()["forward_steps"]
    draft = sched.spec
    assert draft.counters["draft_forward_steps"] > 0
    assert not draft.shadows
    assert draft.pool.num_free_slots + draft.tree.total_size == draft.pool.capacity_pages
    assert draft.tree.protected_size == 0
    draft.tree.check()
    if not config.get("disable_radix_cache"):
        assert draft.tree.total_size > 0  # prompts shared through the draft's tree


class FailingOnce(NoisyDraft):
    """A draft whose third forward raises."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, plan: BatchPlan) -> StepResult:
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("draft broke")
        return super().forward(plan)


def test_fake_abort_and_a_failing_draft_step_leak_nothing(free_drafts) -> None:
    """An aborted request's draft KV goes back; a draft forward that raises costs its step
    the drafts (the draft KV of every request is dropped), never a request."""
    sched, _ = make_scheduler()
    sched.runner = RepetitiveRunner()
    cfg = sched.config.replace(**DRAFT, speculative_disable_by_batch_size=0)
    sched.spec = DraftSpeculator(cfg, (0,), FailingOnce(), KVPool(1024, 1), VOCAB, 100_000)
    reqs = [make_req(f"r{i}", p, 40, ignore_eos=True) for i, (p, _) in enumerate(workload(5, 5))]
    for req in reqs:
        sched.add_request(req)
    for _ in range(6):
        sched.step()
    assert "r1" in sched.spec.shadows
    sched.abort("r1")
    run_all(sched)
    draft = sched.spec
    assert draft.runner.calls > 3 and draft.counters["spec_accepted"] > 0
    assert [r.error for r in reqs] == [None, "aborted", None, None, None]
    plain, _ = make_scheduler()
    plain.runner = RepetitiveRunner()
    again = [make_req(f"r{i}", p, 40, ignore_eos=True) for i, (p, _) in enumerate(workload(5, 5))]
    for req in again:
        plain.add_request(req)
    run_all(plain)
    assert [r.output_ids for i, r in enumerate(reqs) if i != 1] == [
        r.output_ids for i, r in enumerate(again) if i != 1
    ]
    assert not draft.shadows and draft.tree.protected_size == 0
    assert draft.pool.num_free_slots + draft.tree.total_size == draft.pool.capacity_pages


def test_fake_acceptance_in_meta_info_and_metrics(free_drafts) -> None:
    """Per request: verify steps and kept drafts in meta_info, summing to the scheduler's
    counters, which /metrics renders."""
    sched, _ = make_scheduler()
    sched.runner = RepetitiveRunner()
    cfg = sched.config.replace(**DRAFT, speculative_disable_by_batch_size=0)
    sched.spec = DraftSpeculator(cfg, (0,), NoisyDraft(), KVPool(1024, 1), VOCAB, 100_000)
    reqs = [make_req(f"r{i}", p, 30, ignore_eos=True) for i, (p, _) in enumerate(workload(4, 4))]
    for req in reqs:
        sched.add_request(req)
    run_all(sched)
    metas = [r.meta_info() for r in reqs]
    stats = sched.stats()
    assert sum(m["spec_verify_ct"] for m in metas) == stats["spec_verify_steps"] > 0
    assert sum(m["spec_accepted_drafts"] for m in metas) == stats["spec_accepted"] > 0
    for m in metas:
        steps = m["spec_verify_ct"]
        assert m["spec_accept_length"] == (m["spec_accepted_drafts"] + steps) / steps
    lines = Metrics(sched.stats).render().decode().splitlines()
    assert f"radixflow:spec_accepted_tokens_total {stats['spec_accepted']}" in lines
    assert f"radixflow:spec_verify_steps_total {stats['spec_verify_steps']}" in lines
    assert f"radixflow:spec_accept_length {stats['spec_accept_length']}" in lines


class DistRunner(FakeRunner):
    """Each sample row draws from a distribution over tokens 1..5 that depends on the row's
    sequence (its chain hash); `salt` makes the draft's q differ from the target's p. Rows
    in `plan.prob_rows` return their distribution."""

    def __init__(self, salt: int, seed: int) -> None:
        super().__init__()
        self.salt, self.rng = salt, np.random.default_rng(seed)

    def dist(self, h: int) -> np.ndarray:
        weights = np.zeros(VOCAB)
        for t in range(1, 6):
            weights[t] = 1 + ((h + self.salt) >> (3 * t)) % 9
        return weights / weights.sum()

    def forward(self, plan: BatchPlan) -> StepResult:
        super().forward(plan)
        dists = [self.dist(self.row_hashes[int(i)]) for i in plan.sample_rows]
        ids = [int(self.rng.choice(VOCAB, p=d)) for d in dists]
        probs = np.stack([dists[int(i)] for i in plan.prob_rows]) if len(plan.prob_rows) else None
        return StepResult(ids, [0.0] * len(ids), np.zeros(len(plan.logit_rows)), probs=probs)


def sampled_outputs(speculate: bool, sampler=None) -> np.ndarray:
    """600 unseeded sampled requests on one prompt, 4 tokens each: their outputs."""
    sched, _ = make_scheduler(max_total_tokens=16384)
    sched.runner = DistRunner(0, seed=1 + speculate)
    if speculate:
        cfg = sched.config.replace(**DRAFT, speculative_disable_by_batch_size=0)
        draft = DistRunner(12345, seed=3)
        sched.spec = DraftSpeculator(cfg, (0,), draft, KVPool(16384, 1), VOCAB, 100_000)
        if sampler is not None:
            draft_model.rejection_sample = sampler
    reqs = [make_req(f"r{i}", [7, 8, 9], 4, temperature=1.0, ignore_eos=True) for i in range(600)]
    for req in reqs:
        sched.add_request(req)
    run_all(sched)
    if speculate:
        stats = sched.stats()
        assert stats["spec_proposed"] > 600 and 0 < stats["spec_accepted"] < stats["spec_proposed"]
    return np.array([r.output_ids for r in reqs])


def test_fake_sampled_outputs_keep_their_distribution(free_drafts, monkeypatch) -> None:
    """Drafts sampled from the draft's q and judged by rejection sampling: each output
    position's token frequencies match those without speculation (chi-square on 600
    requests); with the broken sampler (residual replaced by p) they do not."""
    monkeypatch.setattr(draft_model, "rejection_sample", draft_model.rejection_sample)
    plain = sampled_outputs(False)

    def differs(spec: np.ndarray) -> float:
        pvalues = []
        for pos in range(1, 4):
            table = [np.bincount(out[:, pos], minlength=6)[1:6] for out in (plain, spec)]
            pvalues.append(chi2_contingency(np.array(table)).pvalue)
        return min(pvalues)

    assert differs(sampled_outputs(True)) > 1e-3
    assert differs(sampled_outputs(True, residual_is_p)) < 1e-3


def test_fake_draft_shares_prompt_prefixes_through_its_tree(free_drafts) -> None:
    """Two requests with one long prompt one after the other: the second's draft catch-up
    computes only what the tree lacks."""
    sched, _ = make_scheduler()
    sched.runner = RepetitiveRunner()
    cfg = sched.config.replace(**DRAFT, speculative_disable_by_batch_size=0)
    sched.spec = DraftSpeculator(cfg, (0,), NoisyDraft(), KVPool(1024, 1), VOCAB, 100_000)
    prompt = list(range(1, 41)) * 3
    sched.add_request(make_req("a", prompt, 12, ignore_eos=True))
    run_all(sched)
    first = sched.spec.counters["draft_prefill_tokens"]
    sched.add_request(make_req("b", prompt, 12, ignore_eos=True))
    run_all(sched)
    second = sched.spec.counters["draft_prefill_tokens"] - first
    assert first >= len(prompt)
    assert second < first - len(prompt) + 20


# ---- SmolLM2: fp32 target, its Q4_1 GGUF as draft ---------------------------------------------


@pytest.fixture(scope="module")
def target():
    with Engine(
        model="smollm2", dequantize_weights=True, max_total_tokens=4096, self_check=True
    ) as engine:
        yield engine


@pytest.fixture(scope="module")
def drafted(target):
    engine = target.with_config(**DRAFT, speculative_disable_by_batch_size=0)
    yield engine
    engine.shutdown()


def test_greedy_chats_equal_the_target_alone(target, drafted) -> None:
    """The test chats one by one and as one batch, greedy: the same tokens as the fp32
    target alone; drafts were accepted, and meta_info reports them."""
    prompts = [chat(p) for p in CHAT_PROMPTS[:3]]
    params = {"max_new_tokens": 20, "temperature": 0}
    expected = [o["output_ids"] for o in target.generate(prompts, params)]
    alone = [drafted.generate(p, params) for p in prompts]
    assert [o["output_ids"] for o in alone] == expected
    batch = drafted.generate(prompts, params)
    assert [o["output_ids"] for o in batch] == expected
    stats = drafted.stats()
    assert stats["spec_accepted"] > 20
    meta = alone[0]["meta_info"]
    assert meta["spec_verify_ct"] > 0
    assert meta["spec_accept_length"] == pytest.approx(
        (meta["spec_accepted_drafts"] + meta["spec_verify_ct"]) / meta["spec_verify_ct"]
    )
    drafted.check_idle()


def test_constrained_output_equals_the_target_alone(target, drafted) -> None:
    """A JSON-schema request: the draft proposes under a copy of the grammar."""
    schema = (
        '{"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, '
        '"age": {"type": "integer"}}, "required": ["name", "age"]}'
    )
    prompt = chat("Give a person as JSON.")
    params = {"max_new_tokens": 24, "temperature": 0, "json_schema": schema}
    before = drafted.stats()["spec_accepted"]
    assert (
        drafted.generate(prompt, params)["output_ids"]
        == target.generate(prompt, params)["output_ids"]
    )
    assert drafted.stats()["spec_accepted"] > before
    drafted.check_idle()


def test_a_draft_with_another_tokenizer_is_refused_at_start(target, tmp_path) -> None:
    with one_thread():
        tiny, _ = save_family("llama", tmp_path)
    with pytest.raises(DraftMismatchError, match="tokenizer is not the target's"):
        target.with_config(speculative_algorithm="draft", speculative_draft_model_path=str(tiny))


@pytest.mark.slow
def test_more_prompts_seeded_sampling_and_chunked_prefill_equal(target) -> None:
    """Every test chat, a code prompt and a long one through 16-token prefill chunks (for the
    target and the draft's catch-up), greedy and seeded sampling (a point-mass draft leaves a
    seeded request's tokens as they are), with a stop string: the target alone's outputs."""
    engine = target.with_config(**DRAFT, chunked_prefill_size=16)
    long = chat("Summarise: " + " ".join(CHAT_PROMPTS * 3))
    prompts = [chat(p) for p in CHAT_PROMPTS] + [
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
        long,
    ]
    cases = [
        {"max_new_tokens": 40, "temperature": 0},
        {"max_new_tokens": 24, "temperature": 0.7, "top_p": 0.9, "seed": 11},
        {"max_new_tokens": 24, "temperature": 0, "stop": ["."]},
    ]
    try:
        for params in cases:
            expected = [target.generate(p, params)["output_ids"] for p in prompts]
            got = [engine.generate(p, params)["output_ids"] for p in prompts]
            assert got == expected, params
            batch = [o["output_ids"] for o in engine.generate(prompts, params)]
            assert batch == expected, params
        assert engine.stats()["spec_accepted"] > 100
        engine.check_idle()
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_integer_kernels_target_greedy_equal() -> None:
    """The default SmolLM2 (its Q4_1 blocks on the integer kernels, int8 activations) drafted
    by the same file: the same greedy tokens, every draft kept."""
    prompts = [chat(p) for p in CHAT_PROMPTS[:3]]
    params = {"max_new_tokens": 32, "temperature": 0}
    with Engine(model="smollm2", max_total_tokens=4096) as plain:
        expected = [plain.generate(p, params)["output_ids"] for p in prompts]
        engine = plain.with_config(**DRAFT)
        try:
            assert [engine.generate(p, params)["output_ids"] for p in prompts] == expected
            stats = engine.stats()
            assert stats["spec_accepted"] > 0.9 * stats["spec_proposed"] > 0
        finally:
            engine.shutdown()
