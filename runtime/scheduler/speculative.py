"""Speculative decoding drafted from n-grams, no draft model (torch-free).

Each step, for every decoding request, `Speculator.propose` looks up the request's last
tokens in up to three n-gram tables and proposes up to k next tokens:
  * a JSON-schema request's schema: the fixed text between its free values (braces, keys,
    separators; runtime/scheduler/schema_drafts.py), so a schema nobody has used yet still drafts;
  * its own context (prompt lookup): the most recent earlier occurrence of its last 4, 3, 2
    or 1 tokens in its prompt + output, and what followed;
  * the sequences the scheduler puts into the radix tree (every finished request's prompt
    and output), which hold earlier turns, tool outputs and schema keys. The table keeps
    tokens, not KV, so a draft may come from text the tree has since evicted.
Kinds are tried in `KINDS` order: the schema first, then the longest match, the own context
before the tree at equal length; the most recent occurrence within a table. A draft that
reaches the end of its match is extended by looking up again (a repeating loop drafts its
whole period); a schema segment is not (a free value follows it).

Verification: the request's step becomes an extend of 1 + k rows (its last sampled token,
then the drafts) with a logit row and a sample row each; row j is sampled exactly as the
plain decode would sample the token after the first j drafts (same penalties, bans, grammar
mask and seed stream `seed * 1_000_003 + len(output_ids)`), and `accept` keeps drafts while
the sampled token equals the draft, then keeps the first sampled token that differs. For a
point-mass draft q this is the speculative-sampling rule: the draft survives with
probability p(draft), and otherwise the token is drawn from p with the draft removed and
renormalised, norm(max(p - q, 0)); so the output distribution is unchanged, greedy output
is token for token the same, and a seeded request samples the same tokens as without
speculation (up to floating-point differences between the extend and decode paths).

k adapts to how often drafts of the same kind survived. A draft's kind is its source (own
context or tree) and the order of the n-gram that matched: an order-4 match in an agent's own
context survives ~0.9 a token, an order-2 match into the tree's text of other chats ~0.05.
Each kind keeps a decayed per-token acceptance rate, over all requests (the prior of a new
request) and per request; `alpha` blends the two, and k maximises the step's tokens per unit
of forward time, 1 + alpha + ... + alpha^k against 1 + `ROW_COST` * k. A match whose kind
does not pay (k = 0) is passed over for the next kind; every `PROBE_EVERY` passed-over matches
of a kind, a short probe keeps its rate current.

KV: drafts take slots like any extend. After acceptance the request's kv_len covers the
verified tokens only; whole pages holding only rejected positions are freed at once, and
rejected slots inside a kept page are the request's own and are overwritten later. The tree
only ever receives `slots[:kv_len]`, so it never holds unverified KV.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from radixflow.runtime.scheduler.schema_drafts import skeleton_segments

if TYPE_CHECKING:
    from radixflow.runtime.cache.kv_pool import KVPool
    from radixflow.runtime.config import ServerConfig
    from radixflow.runtime.protocol.plan import BatchPlan, StepResult
    from radixflow.runtime.scheduler.request import Req

ORDERS = (4, 3, 2, 1)  # n-gram lengths matched, longest first
SOURCES = ("schema", "own", "tree")
# The order kinds are tried in: a JSON schema's fixed text first (it is the schema's, not a
# guess from earlier text), then the longest match, the request's own context before the
# tree's text at equal length.
KINDS = [("schema", n) for n in ORDERS] + [(s, n) for n in ORDERS for s in SOURCES[1:]]
TREE_TABLE_CAPACITY = 1 << 20  # tokens kept for tree drafts; cleared when full
# Forward time of one extra draft row relative to a one-row decode step, measured (SmolLM2
# 135M fp32, 2 threads, contexts of 300 and 1000 tokens, min of 30 interleaved runs on a shared
# 2-core machine): 1+k rows took 1.09-1.10x (k=1), 1.18-1.20x (2), 1.53-1.59x (4) and
# 1.96-2.20x (8) a one-row decode; the least-squares slope is 0.12-0.14 a row.
ROW_COST = 0.13
PRIOR_ACCEPTED, PRIOR_TRIALS = 1.0, 2.0  # a kind's rate starts at 0.5
SCHEMA_PRIOR = 0.8  # a JSON schema's fixed text: only its layout is a guess
DECAY = 0.85  # weight of history in an acceptance rate, per verify step of its kind
PROBE_EVERY = 16  # matches of a kind passed over (k = 0) before a short probe
PROBE_DRAFTS = 2
SKELETON_CACHE = 64  # schemas whose skeleton tables are kept
Kind = tuple[str, int]  # (source, n-gram order) of a draft's first match


class NgramTable:
    """Token n-grams -> where the most recent continuation of each starts.

    Sequences are appended one after another; a key never spans two sequences and a
    continuation stops at the end of its sequence."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.seq_ends: list[int] = []  # sorted ends of closed sequences
        self.seq_start = 0
        self.index: dict[tuple[int, ...], int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, new: Sequence[int]) -> None:
        """Continue the current sequence with `new`; register every n-gram now followed by a
        token (the n-gram ending at the last token has no continuation yet)."""
        toks, index, first = self.tokens, self.index, self.seq_start
        old = len(toks)
        toks.extend(new)
        for i in range(max(old, first + 1), len(toks)):
            for n in ORDERS:
                if i - n >= first:
                    index[tuple(toks[i - n : i])] = i

    def add_sequence(self, seq: Sequence[int]) -> None:
        """Close the current sequence and append `seq` as a new one."""
        if len(self.tokens) > self.seq_start:
            self.seq_ends.append(len(self.tokens))
        self.seq_start = len(self.tokens)
        self.append(seq)

    def continuation(self, suffix: Sequence[int], order: int, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the last `order` tokens of `suffix` most
        recently, or [] where they never occurred with a continuation."""
        if len(suffix) < order:
            return []
        start = self.index.get(tuple(suffix[-order:]))
        if start is None:
            return []
        end = len(self.tokens)
        if start < self.seq_start:  # inside a closed sequence: stop at its end
            end = self.seq_ends[bisect.bisect_right(self.seq_ends, start)]
        return self.tokens[start : min(start + limit, end)]


EMPTY_TABLE = NgramTable()  # never appended to


@dataclass
class Rate:
    """A decayed per-token acceptance rate: each verify step adds its accepted drafts and the
    positions judged (the accepted ones, plus the rejected one if any)."""

    accepted: float = PRIOR_ACCEPTED
    trials: float = PRIOR_TRIALS

    @property
    def alpha(self) -> float:
        return self.accepted / self.trials

    def record(self, proposed: int, kept: int) -> None:
        self.accepted = DECAY * self.accepted + kept
        self.trials = DECAY * self.trials + kept + (kept < proposed)


@dataclass
class DraftState:
    """Per-request drafting state (lives on `Req.spec`)."""

    own: NgramTable = field(default_factory=NgramTable)
    seen: int = 0  # tokens of `fill_ids` in `own`
    rates: dict[Kind, Rate] = field(default_factory=dict)  # this request's, by kind
    kind: Kind | None = None  # of the drafts being verified
    shadow: Any = None  # a Grammar copy advanced over `shadow_ids` (constrained requests)
    shadow_ids: list[int] = field(default_factory=list)
    masks: np.ndarray | None = None  # (1 + k, words) grammar masks of the verify rows
    kv_before: int = 0  # kv_len and own page count when the drafts took their slots
    pages_before: int = 0
    q: Any = None  # (k, V) the distributions a draft model sampled the drafts from, or None
    verify_steps: int = 0  # this request's steps that verified drafts, and drafts it kept
    accepted: int = 0

    def meta(self) -> dict[str, float]:
        """meta_info's speculation fields (SGLang's spec_verify_ct)."""
        steps = self.verify_steps
        return {
            "spec_verify_ct": steps,
            "spec_accepted_drafts": self.accepted,
            "spec_accept_length": (self.accepted + steps) / steps if steps else 0.0,
        }


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step with k drafts yields when each draft survives with probability alpha."""
    return sum(alpha**i for i in range(k + 1))


def best_num_drafts(alpha: float, max_drafts: int, batch_size: int) -> int:
    """k maximising the batch's tokens per unit of forward time: (B - 1 + E[k]) / (1 + c k),
    c the cost of a draft row relative to a B-row step."""
    cost = ROW_COST / (1 + ROW_COST * (batch_size - 1))
    values = [
        (batch_size - 1 + expected_tokens(alpha, k)) / (1 + cost * k) for k in range(max_drafts + 1)
    ]
    return int(np.argmax(values))


class Speculator:
    """Drafts for the scheduler's decodes and judges them after the forward.

    Mutates: `propose` sets `req.draft_ids` and `req.spec` and remembers the step's verifying
    requests; `accept` appends tokens through the scheduler's `append` (which may finish a
    request), moves kv_len and frees pages of rejected drafts."""

    def __init__(
        self,
        config: ServerConfig,
        eos_token_ids: tuple[int, ...],
        encode: Callable[[str], list[int]] | None = None,
    ) -> None:
        self.enabled = config.speculative_algorithm == "ngram"
        self.max_drafts = config.speculative_num_draft_tokens
        self.max_batch = config.speculative_disable_by_batch_size  # 0 = no limit
        self.eos_token_ids = eos_token_ids
        self.tree = NgramTable()
        self.verifying: list[Req] = []
        self.rates: dict[Kind, Rate] = {}  # every request's acceptance, by kind of draft
        self.passed_over: dict[Kind, int] = {}  # matches not drafted since the last probe
        self.encode = encode  # text -> token ids, for schema skeletons (None: none drafted)
        self.skeletons: dict[str, NgramTable] = {}  # by JSON schema
        self.counters = {
            "spec_verify_steps": 0,
            "spec_proposed": 0,
            "spec_accepted": 0,
            "spec_batch_off_steps": 0,  # steps without drafts: the batch was too large
        }

    # ---- before the forward ---------------------------------------------------------------

    def propose(
        self, running: list[Req], spare_pages: int, page_size: int, context_len: int
    ) -> list[Req]:
        """Give each request of `running` that pays its drafts (`req.draft_ids`, at most
        `spare_pages` new pages in all); return those that verify this step."""
        self.verifying = []
        if not self.enabled:
            return []
        for req in running:
            req.draft_ids = []
        if self.max_batch and len(running) > self.max_batch:
            self.counters["spec_batch_off_steps"] += 1
            return []
        for req in running:
            if req.spec is None:
                req.spec = DraftState()
            limit = min(context_len - req.seq_len, req.remaining_new_tokens() - 1)
            drafts = self._draft(req, limit, len(running)) if limit > 0 else []
            spare_pages = self._verify_drafts(req, drafts, spare_pages, page_size)
        return self.verifying

    def _verify_drafts(self, req: Req, drafts: list[int], spare_pages: int, page_size: int) -> int:
        """Give `req` the drafts its grammar allows and the spare pages hold, to be verified
        this step; return the spare pages left."""
        if drafts and req.grammar is not None:
            drafts = self._check_grammar(req, drafts)
        while drafts and _extra_pages(req.kv_len, len(drafts), page_size) > spare_pages:
            drafts.pop()
        if not drafts:
            return spare_pages
        req.draft_ids = drafts
        req.spec.kv_before, req.spec.pages_before = req.kv_len, len(req.own_pages)
        if req.spec.masks is not None:
            req.spec.masks = req.spec.masks[: 1 + len(drafts)]
        self.verifying.append(req)
        return spare_pages - _extra_pages(req.kv_len, len(drafts), page_size)

    def _alpha(self, req: Req, kind: Kind) -> float:
        """The request's acceptance rate for drafts of `kind`, its own history blended with
        every request's (worth PRIOR_TRIALS positions)."""
        prior = self.rates.setdefault(kind, _prior(kind)).alpha
        own = req.spec.rates.get(kind)
        if own is None:
            return prior
        return (own.accepted + PRIOR_TRIALS * prior) / (own.trials + PRIOR_TRIALS)

    def _draft(self, req: Req, limit: int, batch_size: int) -> list[int]:
        """Up to `limit` tokens predicted from the request's schema, context and the tree's
        text: the first match (in KINDS order) whose kind pays, extended by looking up again
        unless it came from the schema."""
        state = req.spec
        own = state.own
        if state.seen < req.seq_len:
            own.append(req.fill_ids[state.seen :])
            state.seen = req.seq_len
        context = req.fill_ids[-max(ORDERS) :]
        tables = {"schema": self._skeleton(req.sampling.json_schema), "own": own, "tree": self.tree}
        for kind in KINDS:
            source, n = kind
            found = tables[source].continuation(context, n, limit)
            if not found:
                continue
            k = min(best_num_drafts(self._alpha(req, kind), self.max_drafts, batch_size), limit)
            if k == 0:
                self.passed_over[kind] = self.passed_over.get(kind, 0) + 1
                if self.passed_over[kind] < PROBE_EVERY:
                    continue
                k = min(PROBE_DRAFTS, limit)
            self.passed_over[kind] = 0
            state.kind = kind
            if source == "schema":  # a segment ends where a free value begins
                return found[:k]
            return self._extend(found[:k], context, tables, k)
        return []

    def _skeleton(self, schema: str | None) -> NgramTable:
        """A JSON schema's fixed text (runtime/scheduler/schema_drafts.py), each segment between
        free values a sequence of its own; empty without a schema."""
        if not schema or self.encode is None:
            return EMPTY_TABLE
        table = self.skeletons.get(schema)
        if table is None:
            if len(self.skeletons) >= SKELETON_CACHE:
                self.skeletons.clear()
            table = self.skeletons[schema] = NgramTable()
            for segment in skeleton_segments(schema):
                table.add_sequence(self.encode(segment))
        return table

    @staticmethod
    def _extend(
        drafts: list[int], context: list[int], tables: dict[str, NgramTable], k: int
    ) -> list[int]:
        """A draft that reached the end of its match continues from a new lookup (a
        repeating loop drafts its whole period), up to k tokens."""
        while len(drafts) < k:
            suffix = context + drafts
            more = next(
                (
                    found
                    for n in ORDERS[:-1]  # not on a single token's evidence
                    for source in SOURCES
                    if (found := tables[source].continuation(suffix, n, k - len(drafts)))
                ),
                None,
            )
            if more is None:
                break
            drafts += more
        return drafts

    def _check_grammar(self, req: Req, drafts: list[int]) -> list[int]:
        """Keep the drafts the grammar allows (EOS ends drafting) and build each verify row's
        mask: row j is masked by the grammar's state after the first j drafts."""
        state = req.spec
        out = req.output_ids
        if state.shadow is None or state.shadow_ids != out[: len(state.shadow_ids)]:
            state.shadow, state.shadow_ids = req.grammar.copy(), []
        for token in out[len(state.shadow_ids) :]:
            state.shadow.accept(token)
        state.shadow_ids = list(out)
        masks = np.zeros((1 + len(drafts), state.shadow.words), dtype=np.int32)
        state.shadow.fill_mask(masks[0])
        kept = 0
        for token in drafts:
            if token in self.eos_token_ids or state.shadow.is_terminated():
                break
            try:
                state.shadow.accept(token)
            except ValueError:  # GrammarError: the grammar forbids this draft
                break
            state.shadow_ids.append(token)
            kept += 1
            state.shadow.fill_mask(masks[kept])
        state.masks = masks[: 1 + kept]
        return drafts[:kept]

    # ---- after the forward ----------------------------------------------------------------

    def accept(
        self,
        plan: BatchPlan,
        result: StepResult,
        first: int,
        append: Callable[[Req, int, float, float], None],
        pool: KVPool,
    ) -> list[Req]:
        """Judge the drafts of this step's verifying requests, whose sample rows start at
        `first`; return them (all progressed)."""
        now = time.monotonic()
        row = first
        for req in self.verifying:
            drafts, state = req.draft_ids, req.spec
            kept = 0
            for j in range(len(drafts) + 1):
                token = result.next_token_ids[row + j]
                req.kv_len = state.kv_before + j + 1  # KV of the last token and j drafts
                append(req, token, result.next_logprobs[row + j], now)
                if result.top_logprobs is not None and req.top_logprobs_num:
                    logit_row, n = plan.sample_rows[row + j], req.top_logprobs_num
                    req.output_top_logprobs.append(
                        list(
                            zip(
                                result.top_logprobs[logit_row][:n].tolist(),
                                result.top_ids[logit_row][:n].tolist(),
                            )
                        )
                    )
                if j == len(drafts) or token != drafts[j]:
                    break
                kept += 1
                if req.finished:
                    break
            row += len(drafts) + 1
            self._record(state, len(drafts), kept)
            req.draft_ids = []
            if not req.finished:
                _free_rejected_pages(req, pool)
        return list(self.verifying)

    def _record(self, state: DraftState, proposed: int, kept: int) -> None:
        c = self.counters
        c["spec_verify_steps"] += 1
        c["spec_proposed"] += proposed
        c["spec_accepted"] += kept
        state.verify_steps += 1
        state.accepted += kept
        kind = state.kind
        if kind is not None:
            state.rates.setdefault(kind, Rate(0.0, 0.0)).record(proposed, kept)
            self.rates.setdefault(kind, _prior(kind)).record(proposed, kept)

    def observe_finished(self, req: Req) -> None:
        """Add a finished request's sequence (what enters the tree) to the tree table."""
        if not self.enabled or req.error is not None:
            return
        if len(self.tree) + req.seq_len > TREE_TABLE_CAPACITY:
            self.tree = NgramTable()
        self.tree.add_sequence(req.fill_ids)

    def stats(self) -> dict[str, float]:
        c = self.counters
        steps = c["spec_verify_steps"]
        return {
            **c,
            "spec_acceptance_rate": c["spec_accepted"] / c["spec_proposed"]
            if c["spec_proposed"]
            else 0.0,
            "spec_accept_length": (c["spec_accepted"] + steps) / steps if steps else 0.0,
        }


def _prior(kind: Kind) -> Rate:
    """Every request's rate for a kind not yet tried."""
    if kind[0] == "schema":
        return Rate(SCHEMA_PRIOR * PRIOR_TRIALS, PRIOR_TRIALS)
    return Rate()


def _extra_pages(kv_len: int, num_drafts: int, page_size: int) -> int:
    """Pages `num_drafts` drafts take beyond the decode's own (already reserved) page."""
    pages = lambda count: -(-(kv_len + count) // page_size) - -(-kv_len // page_size)
    return pages(1 + num_drafts) - pages(1)


def _free_rejected_pages(req: Req, pool: KVPool) -> None:
    """Free the pages the drafts took that hold no verified position (own pages are
    position-aligned: the first new page starts at the page boundary after kv_before)."""
    state, size = req.spec, pool.page_size
    first_start = -(-state.kv_before // size) * size
    new = req.own_pages[state.pages_before :]
    keep = [p for i, p in enumerate(new) if first_start + i * size < req.kv_len]
    if len(keep) < len(new):
        pool.decref(new[len(keep) :])
        req.own_pages = req.own_pages[: state.pages_before] + keep
