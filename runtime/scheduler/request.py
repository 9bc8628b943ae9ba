"""Req: one sequence's state inside the scheduler (torch-free).

Slot ownership of a request (positions 0 .. kv_len-1 have KV):
  * `slots[:prefix_len]` belong to the radix tree and are protected by the lock on `last_node`;
  * the rest live in `own_pages`, pages this request allocated and holds one reference on.
The last sampled token has no KV yet: it is the input of the next decode step. Tokens a
grammar forced after it (jump-forward) have none either: the next step extends them all.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from radixflow.runtime.cache.radix_cache import NAMESPACE_SHIFT, Node
from radixflow.runtime.protocol.messages import ImageItem
from radixflow.runtime.protocol.sampling import SamplingParams

THINKING_END_WINDOW = 16  # output tokens searched for the think block's end, each step


class ReqState(Enum):
    GRAMMAR = "grammar"  # waiting for its grammar to compile
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: output logprobs only
    top_logprobs_num: int = 0
    stream: bool = False
    pooling: str = ""  # an embedding request: "last" | "mean" | "cls" (prefill only); "" generates
    # an encoder's request: its whole input in one step (never chunked), nothing taken from
    # or given to the radix tree (set by the scheduler of an encoder model)
    whole_input: bool = False
    # the LoRA adapter's id (scheduler/lora_table.py; 0: the base model): its rows run under
    # that adapter, and its KV lives in the adapter's own part of the radix tree (`cache_key`)
    lora: int = 0
    # a vision model's images (their placeholders keyed in input_ids: scheduler/images.py)
    images: list[ImageItem] = field(default_factory=list)
    mrope: tuple[np.ndarray, int] | None = None  # the prompt's (3, L) positions and the delta

    output_ids: list[int] = field(default_factory=list)
    state: ReqState = ReqState.WAITING
    finish_reason: dict[str, Any] | None = None
    error: str | None = None

    # KV bookkeeping
    slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    kv_len: int = 0
    prefix_len: int = 0
    last_node: Node | None = None
    own_pages: list[int] = field(default_factory=list)
    extend_target: int = 0  # kv_len this step's extend will reach
    copy_src: np.ndarray | None = None  # copy-on-write of a shared partial page, next forward
    copy_dst: np.ndarray | None = None

    # scheduling
    arrival: float = field(default_factory=time.monotonic)
    arrival_step: int = 0
    priority: int = 0  # admission: larger first, with --enable-priority-scheduling
    num_preemptions: int = 0
    cached_tokens: int = -1  # set once, at first admission
    cached_tokens_disk: int = 0  # of those, loaded from the disk tier (runtime/cache/tiered.py)
    grammar: Any = None  # a constraints.Grammar while constrained
    draft_ids: list[int] = field(default_factory=list)  # this step's speculative drafts
    spec: Any = None  # speculative.DraftState once drafting has looked at this request
    jump_forward_tokens: int = 0  # output tokens a grammar forced (appended, never sampled)
    # why a jump ended the request, kept until the jumped tokens' logprobs are computed
    jump_finish: dict[str, Any] | None = None
    thinking_closed: bool = False  # the think block's end is written (or no budget applies)

    # results
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs_done: bool = False
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    hidden_sum: np.ndarray | None = None  # pooled so far: the last row, or the sum (mean)
    embedding: list[float] | None = None  # the pooled, L2-normalized vector, once finished

    @property
    def fill_ids(self) -> list[int]:
        """Every token of the sequence: prompt then output."""
        return self.input_ids + self.output_ids

    def cache_key(self, end: int | None = None) -> np.ndarray:
        """The radix tree's key of fill_ids[:end]: the token ids, moved into the adapter's
        namespace (cache/radix_cache.py) so KV computed under one adapter (or the base model)
        is never matched by a request under another, while one adapter's requests share."""
        return np.asarray(self.fill_ids[:end], dtype=np.int64) + (self.lora << NAMESPACE_SHIFT)

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.state is ReqState.FINISHED

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0

    @property
    def max_prefix_len(self) -> int:
        """Longest prefix that may come from the cache: at least one token is computed, and
        every position whose input logprob is wanted is recomputed."""
        if self.pooling in ("mean", "cls") or self.whole_input:
            return 0  # every position's hidden state (or the first) is computed, not cached
        cap = self.seq_len - 1
        if self.wants_input_logprobs and not self.input_logprobs_done:
            cap = min(cap, max(self.logprob_start_len, 1) - 1)
        if self.return_logprob:  # jumped tokens not scored yet: their positions are computed
            cap = min(cap, len(self.input_ids) + len(self.output_logprobs) - 1)
        return max(cap, 0)

    @property
    def num_ready_outputs(self) -> int:
        """Output tokens that may stream: with logprobs, only those whose logprob is known
        (a jumped token's comes from the extend that computes its KV)."""
        return len(self.output_logprobs) if self.return_logprob else len(self.output_ids)

    def input_logprob_positions(self, start: int, end: int) -> range:
        """Positions p in [start, end) whose logits give the logprob of input token p + 1."""
        if not self.wants_input_logprobs or self.input_logprobs_done:
            return range(0)
        first = max(self.logprob_start_len, 1) - 1
        return range(max(start, first), min(end, len(self.input_ids) - 1))

    def hidden_positions(self, start: int, end: int) -> range:
        """Positions p in [start, end) whose final hidden state this request pools."""
        if self.pooling == "mean":
            return range(start, end)
        if self.pooling == "last" and end == len(self.input_ids):
            return range(end - 1, end)
        if self.pooling == "cls" and start == 0 < end:
            return range(0, 1)
        return range(0)

    def pool_hidden(self, rows: np.ndarray) -> None:
        """Take this step's rows of `hidden_positions` (n, hidden_size), fp32."""
        if not len(rows):
            return
        if self.pooling in ("last", "cls"):
            self.hidden_sum = rows[-1].astype(np.float64)
            return
        total = rows.astype(np.float64).sum(0)
        self.hidden_sum = total if self.hidden_sum is None else self.hidden_sum + total

    def finish_embedding(self) -> None:
        """The pooled vector, L2-normalized (the mean's divisor cancels in the norm)."""
        assert self.hidden_sum is not None, f"{self.rid}: no hidden state was pooled"
        norm = float(np.linalg.norm(self.hidden_sum))
        self.embedding = (self.hidden_sum / max(norm, 1e-12)).tolist()

    def jumped_logprob_positions(self, start: int, end: int) -> range:
        """Positions p in [start, end) whose logits give the logprob of output token p + 1:
        the jumped tokens after the last scored output token."""
        if not self.return_logprob:
            return range(0)
        first = len(self.input_ids) + len(self.output_logprobs) - 1
        return range(max(start, first), min(end, self.seq_len - 1))

    def remaining_new_tokens(self) -> int:
        return max(self.sampling.max_new_tokens - len(self.output_ids), 0)

    def thinking_end_due(
        self, decode: Callable[[list[int]], str], encode: Callable[[str], list[int]] | None
    ) -> list[int]:
        """The tokens of the think block's end when it must be written now (its budget spent,
        the end not among the last tokens); else []. Each is then forced like a jumped one."""
        budget, end = self.sampling.max_thinking_tokens, self.sampling.thinking_end
        if budget is None or encode is None or self.thinking_closed or self.finished:
            return []
        if end in decode(self.output_ids[-THINKING_END_WINDOW:]):
            self.thinking_closed = True
        if self.thinking_closed or len(self.output_ids) < budget:
            return []
        self.thinking_closed = True
        return encode(f"\n{end}\n\n")

    def append_token(
        self,
        token: int,
        logprob: float,
        now: float,
        eos_token_ids: tuple[int, ...],
        forced: bool = False,
    ) -> dict[str, Any] | None:
        """Record a sampled token (`forced`: one a grammar forced, whose logprob the next
        extend computes) and advance the grammar; return a finish reason if the token itself
        ends the request (EOS, a stop id, a grammar that rejects it)."""
        self.output_ids.append(token)
        if forced:
            self.jump_forward_tokens += 1
        elif self.return_logprob:
            self.output_logprobs.append(logprob)
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_times.append(now)
        params = self.sampling
        min_done = len(self.output_ids) >= params.min_new_tokens
        if token in eos_token_ids:
            # ignore_eos never overrides a grammar: EOS is only sampled where it may end
            if min_done and (not params.ignore_eos or self.grammar is not None):
                return {"type": "stop", "matched": token}
            return None
        if self.grammar is not None:
            try:
                self.grammar.accept(token)
            except ValueError as e:
                return {"type": "abort", "message": f"grammar rejected token {token}: {e}"}
        if token in params.stop_token_ids and min_done:
            return {"type": "stop", "matched": token}
        return None

    def drop_last_token(self) -> None:
        """Take back the last sampled token (jump-forward replaces it; it has no KV and was not
        streamed). The caller rolls the grammar back."""
        self.output_ids.pop()
        self.token_times.pop()
        if len(self.output_logprobs) > len(self.output_ids):
            self.output_logprobs.pop()
        if len(self.output_top_logprobs) > len(self.output_ids):
            self.output_top_logprobs.pop()

    def stop_reason(
        self, context_len: int, decode: Callable[[list[int]], str]
    ) -> dict[str, Any] | None:
        """Finish reason after the last token: grammar complete, length, a stop string in the
        decoded tail, or a stop_regex matching the decoded output (`decode`: ids -> text)."""
        params = self.sampling
        if self.grammar is not None and self.grammar.is_terminated():
            return {"type": "stop", "matched": "grammar"}
        if len(self.output_ids) >= params.max_new_tokens:
            return {"type": "length", "length": params.max_new_tokens}
        if self.seq_len >= context_len:
            return {"type": "length", "length": len(self.output_ids)}
        if len(self.output_ids) < params.min_new_tokens:
            return None
        if params.stop:
            tail = decode(self.output_ids[-(max(len(s) for s in params.stop) + 8) :])
            for stop in params.stop:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
        if params.stop_regex:
            # the whole output: a regex has no length bound to cut a tail by, and may anchor
            text = decode(self.output_ids)
            for pattern in params.stop_regex:
                if re.search(pattern, text):
                    return {"type": "stop", "matched": pattern}  # SGLang's FINISHED_MATCHED_REGEX
        return None

    def set_slots(self, position: int, slots: np.ndarray) -> None:
        """Write `slots` for positions position.. and grow the table as needed."""
        end = position + len(slots)
        if end > len(self.slots):
            grown = np.zeros(max(end, 2 * len(self.slots), 64), dtype=np.int64)
            grown[: len(self.slots)] = self.slots
            self.slots = grown
        self.slots[position:end] = slots

    def meta_info(self) -> dict[str, Any]:
        itl = np.diff(self.token_times) if len(self.token_times) > 1 else np.zeros(0)
        return {
            "id": self.rid,
            "prompt_tokens": len(self.input_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": max(self.cached_tokens, 0),
            "cached_tokens_disk": min(self.cached_tokens_disk, max(self.cached_tokens, 0)),
            "finish_reason": self.finish_reason,
            "num_preemptions": self.num_preemptions,
            "jump_forward_tokens": self.jump_forward_tokens,
            "ttft": (self.first_token_time - self.arrival) if self.first_token_time else None,
            "itl_mean": float(itl.mean()) if itl.size else None,
            "itl_max": float(itl.max()) if itl.size else None,
            "e2e_latency": time.monotonic() - self.arrival,
            **(self.spec.meta() if self.spec is not None else {}),  # speculative decoding
        }
