"""Scheduler: admission, cache-aware ordering, chunked prefill, preemption (torch-free).

One `step()` = poll grammars, make room for the running decodes (evict, else preempt),
continue the chunked request, admit waiting requests in policy order within the KV and token
budgets, run one forward pass for the whole ragged batch, then postprocess (append tokens,
check stops, jump forward over grammar-forced text: runtime/scheduler/jump_forward.py, insert
computed KV into the radix tree, release finished requests)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from radixflow.runtime.cache.kv_pool import KVPool
from radixflow.runtime.cache.radix_cache import RadixCache
from radixflow.runtime.cache.tiered import DiskTier
from radixflow.runtime.config import ServerConfig
from radixflow.runtime.protocol.messages import EMBEDDING_ONLY
from radixflow.runtime.protocol.plan import BatchPlan, StepResult
from radixflow.runtime.scheduler import decode_runs
from radixflow.runtime.scheduler.batch import as_decode_rows, build_plan
from radixflow.runtime.scheduler.invariants import check_ownership
from radixflow.runtime.scheduler.jump_forward import JumpForward
from radixflow.runtime.scheduler.lora_table import LoraTable
from radixflow.runtime.scheduler.policy import order_waiting, shares_uncached
from radixflow.runtime.scheduler.request import Req, ReqState
from radixflow.runtime.scheduler.request_kv import RequestKV
from radixflow.runtime.scheduler.speculative import Speculator
from radixflow.runtime.scheduler.stats import SchedulerStats
from radixflow.runtime.scheduler.step_outputs import pool_hidden, store_logprobs, top_of

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
CLIP_MAX_NEW_TOKENS = 4096
RETRACT_HEADROOM_STEPS = 20

log = logging.getLogger(__name__)
COUNTERS = (  # decode_runs: decode steps run as one call, and the tokens they kept
    "prefill_tokens_computed", "prompt_tokens", "cached_tokens", "decode_tokens", "preemptions",
    "finished_requests", "aborted_requests", "forward_steps", "decode_runs", "decode_run_tokens",
)  # fmt: skip


class Runner(Protocol):
    def forward(self, plan: BatchPlan) -> StepResult: ...


class Scheduler:
    def __init__(
        self,
        config: ServerConfig,
        runner: Runner,
        pool: KVPool,
        *,
        eos_token_ids: tuple[int, ...],
        context_len: int,
        vocab_size: int,
        decode: Callable[[list[int]], str],
        grammars: Any = None,
        encode: Callable[[str], list[int]] | None = None,  # text -> ids, for schema drafts
        clock: Callable[[], float] = time.monotonic,  # virtual under `radixflow simulate`
        encoder: bool = False,  # an encoder model: embed requests only, each input whole
        speculator: Speculator | None = None,  # a draft model's (runtime/scheduler/draft_model.py)
        tiers: DiskTier | None = None,  # a disk tier under the tree (its own tree)
    ) -> None:
        self.config = config
        self.encoder = encoder
        self.runner = runner
        self.eos_token_ids = eos_token_ids
        self.context_len = context_len
        self.vocab_size = vocab_size
        self.decode = decode
        self.grammars = grammars
        self.pool = pool
        self.tree = tiers.tree if tiers else RadixCache(pool, disabled=config.disable_radix_cache)
        self.grammar_queue: list[Req] = []
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.step_count = 0
        self.clock, self.metrics, self.admit_stop = clock, SchedulerStats(), None
        self.kv = RequestKV(self.pool, self.tree, self.metrics, tiers)
        self.spec = speculator or Speculator(config, eos_token_ids, encode)
        self.encode = encode
        self.jump = JumpForward(not config.disable_jump_forward)
        self.loras = LoraTable(config.max_loras_per_batch)  # adapter names -> ids
        self.init_ratio = min(INIT_NEW_TOKEN_RATIO * config.schedule_conservativeness, 1.0)
        self.min_ratio = self.init_ratio * MIN_NEW_TOKEN_RATIO_FACTOR
        self.new_token_ratio = self.init_ratio
        self.counters = dict.fromkeys(COUNTERS, 0)

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, req: Req) -> None:
        """Queue a request; an impossible one finishes at once with an error."""
        req.arrival_step = self.step_count
        self.metrics.arrived(req)
        req.whole_input = self.encoder
        problem = self._check_fits(req)
        if problem:
            self._fail(req, problem)
            return
        key = req.sampling.grammar_key
        if key is not None:
            if self.grammars is None:
                self._fail(req, "constrained decoding is not available in this runtime")
                return
            self.grammars.submit(key)
            req.state = ReqState.GRAMMAR
            self.grammar_queue.append(req)
        else:
            req.state = ReqState.WAITING
            self.waiting.append(req)
            self.kv.prefetch(req)  # blocks on disk are read while it waits

    def abort(self, rid: str, message: str = "aborted") -> Req | None:
        """Finish `rid` wherever it is (idempotent; unknown rids return None)."""
        for queue in (self.grammar_queue, self.waiting, self.running):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    self._finish(req, {"type": "abort", "message": message})
                    self.counters["aborted_requests"] += 1
                    return req
        if self.chunked is not None and self.chunked.rid == rid:
            req, self.chunked = self.chunked, None
            self._finish(req, {"type": "abort", "message": message})
            self.counters["aborted_requests"] += 1
            return req
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.grammar_queue or self.waiting or self.running or self.chunked)

    def live_requests(self) -> list[Req]:
        chunked = [self.chunked] if self.chunked else []
        return self.grammar_queue + self.waiting + self.running + chunked

    # ---- the step --------------------------------------------------------------------------

    def step(self) -> list[Req]:
        """Run one scheduling step; return the requests that progressed or finished."""
        self.step_count += 1
        start = self.clock()
        updated = self._poll_grammars()
        updated += self._make_decode_room()
        spare = self.pool.num_free_pages - self._decode_pages_needed()
        jumps = [r for r in self.running if r.seq_len - r.kv_len > 1]  # jumped tokens pending
        jumps.sort(key=as_decode_rows)  # those run as decode rows last (store_logprobs' order)
        stepping = [r for r in self.running if r.seq_len - r.kv_len == 1]
        verifies = self.spec.propose(stepping, spare, self.pool.page_size, self.context_len)
        decodes = [r for r in stepping if not r.draft_ids]
        run = decode_runs.start(self, decodes, bool(verifies or jumps))  # None: one step
        for req in decodes if run is None else ():  # before admission (prefills cannot
            self.kv.alloc_decode_slot(req)  # take the decodes' pages); a run grew its own
        for req in jumps:  # the last token and the jumped ones (room made like the decodes')
            grown = self.kv.grow(req, req.seq_len - req.kv_len)
            assert grown, f"{req.rid}: no room for jumped tokens, free={self.pool.num_free_pages}"
        for req in verifies:  # the last token and the drafts, in `spare` pages
            self.kv.grow(req, 1 + len(req.draft_ids))
        extends = self._admit()  # jumped tokens, like drafts, are not charged to the budget
        if not decodes and not extends and not verifies and not jumps:
            if not self.has_work:
                self.new_token_ratio = self.init_ratio
            return updated
        try:
            plan, sample_reqs = build_plan(
                extends + [r for r in jumps if not as_decode_rows(r)], decodes, self.vocab_size,
                self.eos_token_ids, verifies, [r for r in jumps if as_decode_rows(r)],
            )  # fmt: skip
            tokens = None if run is None else self.runner.forward_steps(plan, run.slots(decodes))
            self.counters["forward_steps"] += 1
            if tokens is not None:  # a decode run (decode_runs.py): its tokens, in order
                updated += run.keep(self, decodes, tokens)
            else:
                result = self.runner.forward(plan)
                updated += self._postprocess(plan, result, extends, jumps, decodes, sample_reqs)
                if run is not None:  # declined: a plain step; the run's pages go back
                    run.give_back(self, decodes)
            self.metrics.stepped(self, plan, extends, start)
        except Exception as e:  # noqa: BLE001 - one bad batch must not take the process down
            log.exception("step %d failed; its requests get an error", self.step_count)
            message = f"internal error in this step: {e!r}"
            updated += self._fail_batch(extends + jumps + decodes + verifies, message)
        if self.config.self_check:
            self.check_invariants()
        return updated

    # ---- grammar queue ---------------------------------------------------------------------

    def _poll_grammars(self) -> list[Req]:
        failed = []
        for req in list(self.grammar_queue):
            ready = self.grammars.poll(req.sampling.grammar_key)
            if ready is None:
                continue
            self.grammar_queue.remove(req)
            if isinstance(ready, Exception):
                self._fail(req, f"invalid grammar: {ready}")
                failed.append(req)
            else:
                req.grammar = ready
                if self.jump.jump(req, self._append_forced, self.clock()):
                    failed.append(req)  # forced text from the start: it streams now
                if not req.finished:
                    req.state = ReqState.WAITING
                    self.waiting.append(req)
        return failed

    # ---- memory for decodes: evict, else preempt -------------------------------------------

    def _decode_pages_needed(self) -> int:
        """New pages the running requests' pending tokens take (the last sampled token, and
        any jumped after it)."""
        size = self.pool.page_size
        return sum(-(-r.seq_len // size) - -(-r.kv_len // size) for r in self.running)

    def _make_decode_room(self) -> list[Req]:
        failed = []
        while self.running:
            short = self._decode_pages_needed() - self.pool.num_free_pages
            if short <= 0:
                break
            if self.metrics.evicted(self.tree.evict(short * self.pool.page_size)) > 0:
                continue
            if len(self.running) == 1:
                failed.append(self._fail_running(self.running[0], "out of KV memory"))
                continue
            failed += self._preempt_one()
        return failed

    def _preempt_one(self) -> list[Req]:
        """Retract the least-progressed running request (fewest outputs, longest prompt)."""
        victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.input_ids)))
        self.running.remove(victim)
        self.counters["preemptions"] += 1
        victim.num_preemptions += 1
        self.kv.release(victim, keep_in_tree=True)
        if victim.num_preemptions > self.config.max_preemptions:
            self._finish(victim, {"type": "abort", "message": "preempted too many times"})
            victim.error = "preempted too many times (KV pool too small for the load)"
            return [victim]
        victim.state = ReqState.WAITING
        self.waiting.append(victim)
        decoded = sum(len(r.output_ids) for r in self.running)
        wanted = sum(r.sampling.max_new_tokens for r in self.running) or 1
        self.new_token_ratio = min(
            1.0, (decoded + RETRACT_HEADROOM_STEPS * len(self.running)) / wanted
        )
        return []

    # ---- admission -------------------------------------------------------------------------

    def _reserved_for_running(self) -> float:
        return self.new_token_ratio * sum(self._still_needed(r) for r in self.running)

    def _still_needed(self, req: Req) -> int:
        """Tokens `req` may still generate: max_new_tokens, the context and a clip bound it."""
        room = self.context_len - req.seq_len
        return max(0, min(req.remaining_new_tokens(), room, CLIP_MAX_NEW_TOKENS))

    def _prefill_budget(self) -> int:
        size = self.config.chunked_prefill_size
        return (
            self.config.max_prefill_tokens
            if size <= 0
            else min(size, self.config.max_prefill_tokens)
        )

    def _admit(self) -> list[Req]:
        """Choose this step's extends: the chunked request first, then waiting requests."""
        budget = self._prefill_budget()
        extends: list[Req] = []
        if self.chunked is not None:
            req = self.chunked
            chunk = min(req.seq_len - req.kv_len, self.config.chunked_prefill_size)
            if self.kv.grow(req, chunk):
                extends.append(req)
                budget -= chunk
        admitted_cost = 0.0
        in_step = [self.chunked.cache_key()] if self.chunked else []
        self.admit_stop = None  # why admission stopped; None: the queue ran out
        by = self.config.schedule_policy, self.step_count, self.config.enable_priority_scheduling
        ordered = order_waiting(self.waiting, self.tree, *by)
        # within --max-loras-per-batch adapters a step (the chunked request's counted too)
        for req in self.loras.admissible(ordered, self.running + extends, self.chunked):
            if budget <= 0 or len(self.running) + len(extends) >= self.config.max_running_requests:
                self.admit_stop = "token_budget" if budget <= 0 else "running_cap"
                break
            prefix, node = self.kv.match(req)  # loads what follows on disk, if any
            ids = req.cache_key()
            reuses = not (self.tree.disabled or req.whole_input or req.pooling in ("mean", "cls"))
            if reuses and shares_uncached(ids, len(prefix), in_step):
                continue  # a request admitted this step computes that prefix; reuse it next step
            self.tree.lock(node)
            extend_len = req.seq_len - len(prefix)
            cost = extend_len + self._still_needed(req)
            available = self.pool.num_free_slots + self.tree.evictable_size
            room = available - self._reserved_for_running() - admitted_cost
            alone = not self.running and not extends
            chunk = extend_len
            if extend_len > budget:
                if req.whole_input:  # an encoder's input runs whole, alone when over budget
                    chunk = 0 if extends else extend_len
                elif self.config.chunked_prefill_size > 0 and self.chunked is None:
                    chunk = budget
                elif extends:  # chunking off: only the step's first prefill may exceed
                    chunk = 0
            if chunk == 0 or chunk > available or (cost > room and not alone):
                self.admit_stop = "token_budget" if chunk == 0 else "kv"
                self.tree.unlock(node)
                break
            if not self._start(req, prefix, node, chunk):
                self.admit_stop = "kv"
                self.tree.unlock(node)
                break
            self.waiting.remove(req)
            if chunk < extend_len:
                self.chunked = req
            extends.append(req)
            in_step.append(ids)
            budget -= chunk
            admitted_cost += cost
        return extends

    def _start(self, req: Req, prefix: np.ndarray, node: Any, chunk: int) -> bool:
        """Give a waiting request its cached prefix (lock held) and `chunk` new slots."""
        if not self.kv.start(req, prefix, node, chunk):
            return False
        if req.cached_tokens < 0:  # of the prompt (text jumped before the prefill may match)
            req.cached_tokens = min(len(prefix), len(req.input_ids))
            self.counters["cached_tokens"] += req.cached_tokens
            self.counters["prompt_tokens"] += len(req.input_ids)
        req.state = ReqState.RUNNING
        return True

    # ---- after the forward -----------------------------------------------------------------

    def _postprocess(
        self,
        plan: BatchPlan,
        result: StepResult,
        extends: list[Req],
        jumps: list[Req],
        decodes: list[Req],
        sample_reqs: list[Req],
    ) -> list[Req]:
        now = self.clock()
        store_logprobs(plan, result, extends + jumps)
        pool_hidden(result, extends)
        for req in extends:
            self.counters["prefill_tokens_computed"] += req.extend_target - req.kv_len
        # a jump's rows (its last sampled token and the forced ones) ran as decode rows
        self.counters["decode_tokens"] += sum(r.extend_target - r.kv_len for r in jumps)
        for req in extends + jumps:
            req.kv_len = req.extend_target
            if not req.whole_input:  # an encoder's slots hold no KV to share
                self.kv.cache_computed(req)
        self.counters["decode_tokens"] += len(decodes)
        for req in decodes:
            req.kv_len += 1
        sampled = {id(r): i for i, r in enumerate(sample_reqs)}
        updated: list[Req] = []
        for req in extends:
            if req.kv_len < req.seq_len:
                continue  # mid-chunk: stays the chunked request
            if self.chunked is req:
                self.chunked = None
            if id(req) not in sampled:  # prefill-only (max_new_tokens == 0), or a jump ended it
                if req.pooling:
                    req.finish_embedding()
                self._finish(req, req.jump_finish or {"type": "length", "length": 0})
                updated.append(req)
                continue
            self.running.append(req)
        for req in jumps:
            if req.jump_finish is not None:  # its jumped tokens' logprobs are in now
                self._finish(req, req.jump_finish)
                updated.append(req)
        for req in sample_reqs:
            if req.finished:
                continue
            i = sampled[id(req)]
            self._append_token(req, result.next_token_ids[i], result.next_logprobs[i], now)
            if result.top_logprobs is not None and req.top_logprobs_num:
                row = plan.sample_rows[i]
                req.output_top_logprobs.append(top_of(result, row, req.top_logprobs_num))
            updated.append(req)
        updated += self.spec.accept(plan, result, len(sample_reqs), self._append_token, self.pool)
        for req in sample_reqs + self.spec.verifying:  # before anything streams
            for token in req.thinking_end_due(self.decode, self.encode):  # budget spent
                if self._append_forced(req, token, now):
                    break
            self.jump.jump(req, self._append_forced, now)
        for req in list(self.running):
            if req.finished:
                self.running.remove(req)
        decay = (self.init_ratio - self.min_ratio) / self.config.new_token_ratio_decay_steps
        self.new_token_ratio = max(self.new_token_ratio - decay, self.min_ratio)
        return updated

    def _append_token(self, req: Req, token: int, logprob: float, now: float) -> None:
        reason = req.append_token(token, logprob, now, self.eos_token_ids)
        reason = reason or req.stop_reason(self.context_len, self.decode)
        if reason is not None:
            self._finish(req, reason)

    def _append_forced(self, req: Req, token: int, now: float) -> bool:
        """Append a token the grammar forced; True once the request is done: finished, or
        (with logprobs) finishing after the extend that computes the jumped tokens' logprobs."""
        reason = req.append_token(token, math.nan, now, self.eos_token_ids, forced=True)
        reason = reason or req.stop_reason(self.context_len, self.decode)
        if reason is None:
            return False
        if req.return_logprob and reason["type"] not in ("abort", "error"):
            req.jump_finish = reason
        else:
            self._finish(req, reason)
        return True

    def _finish(self, req: Req, reason: dict[str, Any]) -> None:
        if req.finished:
            return
        req.finish_reason = reason
        if reason["type"] in ("abort", "error") and req.error is None:
            req.error = reason.get("message", reason["type"])
        kept = reason["type"] not in ("abort", "error") and not req.whole_input
        self.kv.release(req, keep_in_tree=kept)
        self.metrics.finished(req, self.clock())
        self.spec.observe_finished(req)
        req.state = ReqState.FINISHED
        self.counters["finished_requests"] += 1

    def _fail(self, req: Req, message: str) -> None:
        req.error = message
        self._finish(req, {"type": "error", "message": message})

    def _fail_batch(self, batch: list[Req], message: str) -> list[Req]:
        """Fail every unfinished request of a step that raised, wherever it sits now; their
        KV goes back (nothing of this step enters the tree), so the pool stays consistent."""
        failed = []
        for req in batch:
            if req.finished:
                continue
            for queue in (self.running, self.waiting):
                if req in queue:
                    queue.remove(req)
            if self.chunked is req:
                self.chunked = None
            self._fail(req, message)
            failed.append(req)
        return failed

    def _fail_running(self, req: Req, message: str) -> Req:
        self.running.remove(req)
        self._fail(req, message)
        return req

    def _check_fits(self, req: Req) -> str | None:
        """Why `req` can never run, or None. It never holds more than the context's slots.
        (Prompt lengths and ids were checked where the request entered: RequestLimits.)"""
        if self.encoder and (not req.pooling or req.sampling.max_new_tokens):
            return f"an encoder model: {EMBEDDING_ONLY}"
        need = min(len(req.input_ids) + req.sampling.max_new_tokens, self.context_len)
        if need > self.pool.capacity_pages * self.pool.page_size:
            return (
                f"request needs {need} KV slots (prompt + max_new_tokens) but the pool holds "
                f"{self.pool.capacity_pages * self.pool.page_size}"
            )
        return None

    # ---- introspection ---------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {
            **c,
            "cache_hit_rate": c["cached_tokens"] / max(c["prompt_tokens"], 1),
            "tokens_in_tree": self.tree.total_size,
            "evictable_tokens": self.tree.evictable_size,
            "protected_tokens": self.tree.protected_size,
            "free_slots": self.pool.num_free_slots,
            "total_slots": self.pool.capacity_pages * self.pool.page_size,
            "running_requests": len(self.running) + (1 if self.chunked else 0),
            "waiting_requests": len(self.waiting) + len(self.grammar_queue),
            "new_token_ratio": self.new_token_ratio,
            **self.metrics.stats(self),
            **self.spec.stats(),
            **self.jump.stats(),
        }

    def check_invariants(self) -> None:
        """Slot/page ownership adds up; tree counters and locks are consistent."""
        check_ownership(self)
