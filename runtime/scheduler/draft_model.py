"""Speculative decoding drafted by a small model (`--speculative-algorithm draft`), torch-free.

A second model with the target's tokenizer (checked at start: `check_same_tokenizer`) runs in
the scheduler's process with its own ModelRunner, KV pool and radix tree (runtime/launch.py
builds them). Each step, `DraftSpeculator.propose` picks a draft length k per decoding request
and runs the draft batched over those requests: one extend that catches the draft's KV up with
the request's tokens (the whole prompt the first time, after the draft tree's cached prefix;
then the one or two tokens verification added), sampling the first draft, then k - 1 decode
steps. The drafts are verified exactly as the n-gram drafts are (runtime/scheduler/
speculative.py): as 1 + k extend rows in the target's normal step, row j sampled as the plain
decode would after j drafts, drafts kept while the target's sample equals them, then the first
sample that differs. For a greedy or seeded request (or one returning logprobs) the draft
proposes its argmax, a point-mass proposal q = delta(x): for it the speculative-sampling rule
(keep x with probability min(1, p(x)/q(x)) = p(x), else draw from norm(max(p - q, 0)) = p
without x) is exactly "sample from p, keep x if the sample is x", so greedy output is token for
token the target's and a seeded request samples what it would without drafts. Any other
sampled request's drafts are drawn from the draft's own distribution q (the request's
temperature, top-k, top-p, min-p), which comes back with them, and the verify rows return the
target's p: `rejection_sample` (the general rule, the bonus token from p) decides, and its
tokens are written over the verify rows' samples before the common acceptance runs.

Grammars: a constrained request is drafted under its own grammar: the shadow holds a copy kept
in step with the request's output (replayed from the start after a rejected draft), which
masks the draft's rows, so the draft proposes only tokens the grammar allows; the verify rows
are masked by the target's grammar as for n-gram drafts.

The draft's KV of a request lives in a shadow Req (its slots, own pages and the lock on the
draft tree's node), so prefixes are shared through the draft tree as the target's are through
its own: a prompt's KV enters the draft tree after its catch-up extend, and a finished,
preempted or no-longer-drafting request's whole verified sequence when its shadow is released.
After verification the shadow keeps the KV of the positions whose tokens survived (the common
prefix of what it computed and the request's tokens) and frees the rest. The draft pool has
one-slot pages. A catch-up longer than the step's draft budget (the chunked prefill size) runs
in chunks over several steps, the request not drafting meanwhile. Out of draft KV memory (after
evicting the draft tree), a request simply gets no drafts that step.

Draft length: each request's decayed acceptance rate (blended with every request's, which
starts at PRIOR_ALPHA) gives the k that maximises tokens per unit of time, each draft costing
a draft decode step (its time relative to a target step, measured as both run; DRAFT_COST
until then) plus ROW_COST (its verify row): low acceptance shrinks k (to 0: no drafting but a
short probe every PROBE_EVERY steps), high acceptance grows it up to
--speculative-num-draft-tokens. Above --speculative-disable-by-batch-size decoding requests
nothing is drafted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from radixflow.runtime.cache.radix_cache import RadixCache
from radixflow.runtime.protocol.plan import I64
from radixflow.runtime.protocol.sampling import SamplingParams
from radixflow.runtime.scheduler.batch import build_plan
from radixflow.runtime.scheduler.request import Req
from radixflow.runtime.scheduler.request_kv import RequestKV
from radixflow.runtime.scheduler.speculative import (
    PROBE_DRAFTS,
    PROBE_EVERY,
    ROW_COST,
    DraftState,
    Rate,
    Speculator,
)
from radixflow.runtime.scheduler.stats import SchedulerStats

if TYPE_CHECKING:
    from radixflow.runtime.cache.kv_pool import KVPool
    from radixflow.runtime.config import ServerConfig

log = logging.getLogger(__name__)
# A draft decode step's time relative to a target step, until both are measured (decayed
# averages: the draft's decode forwards, and the time from one step's drafting to the next's)
DRAFT_COST = 0.35
COST_DECAY = 0.9
MAX_STEP_GAP_S = 5.0  # a longer gap between steps was idle time, not a step
# a draft model's acceptance before any is seen (a same-family draft keeps most drafts)
PRIOR_ALPHA, PRIOR_WEIGHT = 0.8, 4.0
KIND = ("draft", 0)  # the one kind of draft, for the acceptance rates
NO_CHUNK = 1 << 30  # the catch-up budget without chunked prefill
GREEDY = SamplingParams(max_new_tokens=1 << 30, temperature=0.0)


class DraftMismatchError(ValueError):
    """The draft model cannot draft for the target (a different tokenizer)."""


def check_same_tokenizer(
    target: Any, draft: Any, target_vocab: int, draft_vocab: int, draft_name: str
) -> None:
    """Raise DraftMismatchError unless the draft's tokenizer and vocabulary size are the
    target's: the same token -> id map and the same special tokens."""
    problems = []
    if draft_vocab != target_vocab:
        problems.append(f"vocab_size {draft_vocab} against the target's {target_vocab}")
    mine, theirs = target.get_vocab(), draft.get_vocab()
    if mine != theirs:
        differ = len(set(mine.items()) ^ set(theirs.items()))
        problems.append(
            f"{len(theirs)} tokens against the target's {len(mine)}, {differ} entries differ"
        )
    for name in ("bos_token", "eos_token"):
        if getattr(target, name, None) != getattr(draft, name, None):
            problems.append(f"{name} {getattr(draft, name, None)!r} against the target's "
                            f"{getattr(target, name, None)!r}")  # fmt: skip
    if problems:
        raise DraftMismatchError(
            f"--speculative-draft-model-path {draft_name!r}: its tokenizer is not the target's ("
            + "; ".join(problems)
            + "); a draft model must share the target model's tokenizer"
        )


def rejection_sample(
    p: np.ndarray, q: np.ndarray, drafts: Sequence[int], rng: np.random.Generator
) -> list[int]:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): drafts x_j drawn from
    q[j] (k, V) are judged against the target's distributions p (k + 1, V), p[j] at the
    position of x_j. Keep x_j with probability min(1, p[j][x]/q[j][x]); at the first rejection
    emit a draw from norm(max(p[j] - q[j], 0)) and stop; with every draft kept, emit a bonus
    draw from p[k]. Returns the kept drafts and the one token after them: each emitted token
    is distributed exactly as a draw from p."""
    out: list[int] = []
    for j, x in enumerate(drafts):
        if rng.random() * q[j, x] < p[j, x]:
            out.append(int(x))
            continue
        residual = np.maximum(p[j] - q[j], 0.0)
        total = residual.sum()
        out.append(_draw(residual / total if total > 0 else p[j], rng))
        return out
    out.append(_draw(p[len(drafts)], rng))
    return out


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    cdf = np.cumsum(probs, dtype=np.float64)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(cdf) - 1))


def best_draft_length(
    alpha: float, max_drafts: int, batch_size: int, draft_cost: float = DRAFT_COST
) -> int:
    """k maximising the batch's tokens per unit of time: (B - 1 + E[k]) / (1 + c k), each
    draft costing a draft decode step and a verify row (relative to a B-row step)."""
    cost = (ROW_COST + draft_cost) / (1 + ROW_COST * (batch_size - 1))
    gains = [
        (batch_size - 1 + sum(alpha**i for i in range(k + 1))) / (1 + cost * k)
        for k in range(max_drafts + 1)
    ]
    return int(np.argmax(gains))


class DraftSpeculator(Speculator):
    """The Speculator whose drafts come from a draft model (`runner` over `pool`)."""

    def __init__(
        self,
        config: ServerConfig,
        eos_token_ids: tuple[int, ...],
        runner: Any,
        pool: KVPool,
        vocab_size: int,
        context_len: int,  # the draft's positions: longer requests get no drafts
    ) -> None:
        super().__init__(config, eos_token_ids)
        self.draft_context = context_len
        self.enabled = True
        self.runner, self.pool, self.vocab_size = runner, pool, vocab_size
        self.tree = RadixCache(pool, disabled=config.disable_radix_cache)
        self.kv = RequestKV(pool, self.tree, SchedulerStats())
        size = config.chunked_prefill_size
        self.catch_up_budget = size if size > 0 else NO_CHUNK
        self.shadows: dict[str, Req] = {}  # by rid: the draft's KV of each request
        self.owners: dict[str, Req] = {}  # by rid: the request each shadow drafts for
        self.grammar_ids: dict[str, list[int] | None] = {}  # tokens each shadow grammar took
        self.counters.update(draft_forward_steps=0, draft_prefill_tokens=0)
        self.rates[KIND] = Rate(PRIOR_ALPHA * PRIOR_WEIGHT, PRIOR_WEIGHT)
        self.decode_s: float | None = None  # decayed time of one draft decode forward
        self.step_s: float | None = None  # decayed time of a step without its drafting
        self.drafted_at: float | None = None  # when the last step's drafting ended
        self.rng = np.random.default_rng(config.seed)  # rejection sampling's draws
        self.q_rows: dict[str, list[np.ndarray]] = {}  # this step's q of sampled drafts

    # ---- choosing who drafts how much -------------------------------------------------------

    def propose(
        self, running: list[Req], spare_pages: int, page_size: int, context_len: int
    ) -> list[Req]:
        self.verifying = []
        now = time.perf_counter()
        if self.drafted_at is not None and now - self.drafted_at < MAX_STEP_GAP_S:
            self.step_s = _decayed(self.step_s, now - self.drafted_at)
        try:
            return self._propose(running, spare_pages, page_size, context_len)
        finally:
            self.drafted_at = time.perf_counter() if running else None

    def _propose(
        self, running: list[Req], spare_pages: int, page_size: int, context_len: int
    ) -> list[Req]:
        live = {r.rid for r in running}
        for rid in [rid for rid in self.shadows if rid not in live]:
            self._release(rid)  # finished elsewhere, preempted, jumping: its KV to the tree
        for req in running:
            req.draft_ids = []
            if req.spec is not None:
                req.spec.q = None
        self.q_rows = {}
        if self.max_batch and len(running) > self.max_batch:
            self.counters["spec_batch_off_steps"] += 1
            for rid in list(self.shadows):
                self._release(rid)
            return []
        wanted: list[tuple[Req, int]] = []
        for req in running:
            if req.spec is None:
                req.spec = DraftState()
            room = min(context_len, self.draft_context) - req.seq_len
            limit = min(room, req.remaining_new_tokens() - 1)
            k = min(self._length(req, len(running)), limit)
            if k > 0:
                wanted.append((req, k))
        drafted = self._run_draft(wanted)
        for req, _ in wanted:
            spare_pages = self._verify_drafts(req, drafted.get(req.rid, []), spare_pages, page_size)
            if req.draft_ids:
                req.spec.kind = KIND
                if req.rid in self.q_rows:  # sampled from q: judged by rejection sampling
                    req.spec.q = np.stack(self.q_rows[req.rid][: len(req.draft_ids)])
        return self.verifying

    def _length(self, req: Req, batch_size: int) -> int:
        k = best_draft_length(self._alpha(req, KIND), self.max_drafts, batch_size, self.cost())
        if k == 0:  # not paying: probe now and then to keep the rate current
            self.passed_over[KIND] = self.passed_over.get(KIND, 0) + 1
            if self.passed_over[KIND] < PROBE_EVERY:
                return 0
            k = PROBE_DRAFTS
        self.passed_over[KIND] = 0
        return k

    # ---- running the draft model ------------------------------------------------------------

    def _run_draft(self, wanted: list[tuple[Req, int]]) -> dict[str, list[int]]:
        """Draft up to k tokens for each (request, k); a failing draft forward costs the
        step its drafts, never the requests."""
        try:
            return self._draft_batch(wanted)
        except Exception:  # noqa: BLE001 - the target step goes on without drafts
            log.exception("the draft model's step failed; dropping the draft KV")
            for rid in list(self.shadows):
                self.owners.pop(rid)
                self.grammar_ids.pop(rid, None)
                self.kv.release(self.shadows.pop(rid), keep_in_tree=False)
            return {}

    def _draft_batch(self, wanted: list[tuple[Req, int]]) -> dict[str, list[int]]:
        """One catch-up extend (sampling each request's first draft), then decodes."""
        budget = self.catch_up_budget
        extends: list[Req] = []
        goal: dict[str, int] = {}
        for req, k in wanted:
            shadow = self._sync(req)
            if not self._begin(shadow):
                continue
            need = shadow.seq_len - shadow.kv_len
            if need > budget:  # a chunk now, drafts in a later step
                if budget > 0 and self.kv.grow(shadow, budget):
                    extends.append(shadow)
                budget = 0
                continue
            if not self.kv.grow(shadow, need):
                continue
            budget -= need
            goal[shadow.rid] = k
            extends.append(shadow)
            shadow.sampling = _draft_params(req)
            if not shadow.sampling.greedy:
                self.q_rows[req.rid] = []
            if req.grammar is not None:
                self._follow_grammar(req, shadow)
            else:  # unconstrained, or no longer (a triggered structure ended)
                shadow.grammar = None
        if not extends:
            return {}
        tokens = self._forward(extends, [])
        for shadow in extends:
            computed = shadow.extend_target - shadow.kv_len
            self.counters["draft_prefill_tokens"] += computed
            shadow.kv_len = shadow.extend_target
            if computed > self.max_drafts + 1:  # a prompt (not a step's few): share it
                self.kv.cache_computed(shadow)
        active = [s for s in extends if s.rid in goal]
        while active:
            active = [s for s in active if self._take(s, tokens.get(s.rid), goal[s.rid])]
            decodes = [s for s in active if self.kv.grow(s, 1)]
            if not decodes:
                break
            tokens = self._forward([], decodes)
            for shadow in decodes:
                shadow.kv_len += 1
            active = decodes
        drafted = {}
        for shadow in extends:
            if shadow.rid in goal:
                drafted[shadow.rid] = list(shadow.output_ids)
            # the shadow's tokens: what its KV holds, the drafts included (judged next step)
            shadow.input_ids = shadow.fill_ids
            shadow.output_ids = []
        return drafted

    def _take(self, shadow: Req, token: int | None, k: int) -> bool:
        """Append a drafted token; whether the shadow drafts another."""
        if token is None:
            return False
        if token in self.eos_token_ids:
            return False  # a draft never ends the request
        if shadow.grammar is not None:
            try:
                shadow.grammar.accept(token)
            except ValueError:
                self.grammar_ids[shadow.rid] = None  # its state is unknown: replay next time
                return False
            self.grammar_ids[shadow.rid].append(token)
        shadow.output_ids.append(token)
        return len(shadow.output_ids) < k and not (
            shadow.grammar is not None and shadow.grammar.is_terminated()
        )

    def _follow_grammar(self, req: Req, shadow: Req) -> None:
        """The shadow's own copy of the request's grammar, advanced over the request's output:
        step by step while drafts are kept; replayed from the start (copies start fresh)
        after a rejected draft."""
        out, seen = req.output_ids, self.grammar_ids.get(req.rid)
        if shadow.grammar is None or seen is None or seen != out[: len(seen)]:
            shadow.grammar, seen = req.grammar.copy(), []
        for token in out[len(seen) :]:
            shadow.grammar.accept(token)
        self.grammar_ids[req.rid] = list(out)

    def cost(self) -> float:
        """A draft decode's time relative to a target step: measured once both are."""
        if self.decode_s is None or not self.step_s:
            return DRAFT_COST
        return min(max(self.decode_s / self.step_s, 0.01), 4.0)

    def _forward(self, extends: list[Req], decodes: list[Req]) -> dict[str, int]:
        plan, sampled = build_plan(extends, decodes, self.vocab_size, self.eos_token_ids)
        stochastic = [i for i, s in enumerate(sampled) if s.rid in self.q_rows]
        plan.prob_rows = np.asarray(stochastic, dtype=I64)
        start = time.perf_counter()
        result = self.runner.forward(plan)
        if not extends:
            self.decode_s = _decayed(self.decode_s, time.perf_counter() - start)
        self.counters["draft_forward_steps"] += 1
        for row, i in enumerate(stochastic):
            self.q_rows[sampled[i].rid].append(result.probs[row])
        return {s.rid: int(t) for s, t in zip(sampled, result.next_token_ids)}

    def _begin(self, shadow: Req) -> bool:
        """A new shadow takes its prefix from the draft tree (locked); False: no memory."""
        if shadow.last_node is not None or shadow.own_pages or shadow.kv_len:
            return True
        ids = np.asarray(shadow.fill_ids[: shadow.max_prefix_len], dtype=I64)
        prefix, node = self.tree.match_prefix(ids)
        self.tree.lock(node)
        if self.kv.start(shadow, prefix, node, 0):
            return True
        self.tree.unlock(node)
        return False

    def _sync(self, req: Req) -> Req:
        """The request's shadow, its KV cut back to the positions whose tokens are still the
        request's (a rejected draft's KV goes), its tokens now the request's."""
        shadow = self.shadows.get(req.rid)
        if shadow is None:
            shadow = self.shadows[req.rid] = Req(req.rid, [], GREEDY)
            self.owners[req.rid] = req
        ids = req.fill_ids
        # the last token's KV is computed by the catch-up that samples after it (the draft
        # may hold it already: a draft cut for pages, then sampled by the target)
        same = min(_common_prefix(shadow.input_ids[: shadow.kv_len], ids), len(ids) - 1)
        if same < shadow.prefix_len:  # the tree's part no longer matches: start afresh
            self.kv.release(shadow, keep_in_tree=False)
        elif same < shadow.kv_len:
            shadow.kv_len = same
            self.kv.drop_unused_pages(shadow)
        shadow.input_ids, shadow.output_ids = list(ids), []
        return shadow

    def _release(self, rid: str) -> None:
        """Give back a shadow's KV, its verified part into the draft tree."""
        self._sync(self.owners.pop(rid))
        self.grammar_ids.pop(rid, None)
        self.kv.release(self.shadows.pop(rid), keep_in_tree=True)

    # ---- after the target's step ------------------------------------------------------------

    def accept(self, plan: Any, result: Any, first: int, append: Any, pool: KVPool) -> list[Req]:
        """Drafts sampled from q are judged by `rejection_sample` against the verify rows'
        p: the emitted tokens are written over the target's samples, so that the n-gram
        path's rule (keep drafts while the sample equals them) then keeps exactly those."""
        row, at = first, 0
        for req in self.verifying:
            n = 1 + len(req.draft_ids)
            if req.spec.q is not None:
                out = rejection_sample(
                    result.probs[at : at + n], req.spec.q, req.draft_ids, self.rng
                )
                result.next_token_ids[row : row + len(out)] = out
                at += n
                req.spec.q = None
            row += n
        return super().accept(plan, result, first, append, pool)

    def observe_finished(self, req: Req) -> None:
        """A finished request's draft KV goes to the draft tree."""
        if req.rid in self.shadows:
            self._release(req.rid)

    def stats(self) -> dict[str, float]:
        stats = super().stats()
        stats["draft_tokens_in_tree"] = self.tree.total_size
        stats["draft_free_slots"] = self.pool.num_free_slots
        return stats


def _decayed(average: float | None, value: float) -> float:
    return value if average is None else COST_DECAY * average + (1 - COST_DECAY) * value


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=I64) != np.asarray(b[:n], dtype=I64))
    return int(diff[0]) if len(diff) else n


def _draft_params(req: Req) -> SamplingParams:
    """How the draft samples for `req`: its argmax (a point-mass q) for a greedy request, a
    seeded one (whose tokens stay those without speculation) or one returning logprobs
    (each emitted token's logprob is its sample row's); else from q, the draft's
    distribution under the request's temperature, top-k, top-p and min-p."""
    params = req.sampling
    if params.greedy or params.seed is not None or req.return_logprob:
        return GREEDY
    return replace(
        GREEDY,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
    )


def draft_config(config: ServerConfig) -> ServerConfig:
    """The config the draft model loads with: its own path, its weights as they are."""
    return replace(
        config,
        model_path=config.speculative_draft_model_path,
        dequantize_weights=False,
        quantization="",
        speculative_algorithm="",
        speculative_draft_model_path="",
        served_model_name="",
    )
