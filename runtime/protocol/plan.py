"""BatchPlan (scheduler -> model executor, and rank 0 -> the other tensor-parallel ranks) and
StepResult (back), torch-free.

The plan is a flat ragged batch: rows [0, num_extend_tokens) are the new tokens of extending
requests (prefills, chunks), then one row per decoding request. Every array is numpy so the
scheduler never touches a tensor; the runner turns the plan into tensors in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from radixflow.runtime.protocol.messages import ImageItem
from radixflow.runtime.protocol.sampling import SamplingParams

I64 = np.int64


@dataclass
class BatchPlan:
    input_ids: np.ndarray  # (T,)
    positions: np.ndarray  # (T,)
    out_slots: np.ndarray  # (T,)
    num_extend_tokens: int
    extend_qo_indptr: np.ndarray  # (Be+1,)
    extend_kv_indptr: np.ndarray  # (Be+1,)
    extend_kv_indices: np.ndarray
    decode_kv_indptr: np.ndarray  # (Bd+1,)
    decode_kv_indices: np.ndarray
    logit_rows: np.ndarray  # (R,) rows whose next-token distribution is needed
    # per logit row: the token whose logprob is wanted (input logprobs), or -1
    logprob_targets: np.ndarray  # (R,)
    # sampling requests, in order: which logit row each samples from
    sample_rows: np.ndarray  # (S,) indices into logit_rows
    sampling: list[SamplingParams] = field(default_factory=list)
    sample_seeds: list[int | None] = field(default_factory=list)  # seed + position, or None
    output_ids: list[list[int]] = field(default_factory=list)  # for penalties
    banned_ids: list[tuple[int, ...]] = field(default_factory=list)  # EOS before min_new_tokens
    vocab_masks: np.ndarray | None = None  # (S, words) int32 bitmask, bit set = allowed
    top_logprobs_num: int = 0  # top-k logprobs wanted for every logit row (0 = none)
    sampled_logprobs: bool = True  # whether any sample row wants its token's logprob
    copy_src: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=I64))  # CoW slots
    copy_dst: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=I64))
    # extend rows whose final hidden state (after the final norm) embedding requests pool
    hidden_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=I64))  # (H,)
    # sample rows (non-greedy) whose processed distribution comes back: draft-model
    # speculation's rejection sampling (runtime/scheduler/draft_model.py)
    prob_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=I64))  # (P,)
    # (T,) per row: the LoRA adapter it runs under (0: the base model); empty: every row the
    # base's. At most --max-loras-per-batch distinct adapters (runtime/models/lora.py)
    lora_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=I64))
    # images (runtime/scheduler/images.py): (3, T) mrope positions when a row needs them, and
    # the extend rows of image tokens with, per run of them, (image, first token, count)
    mrope_positions: np.ndarray | None = None
    image_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=I64))  # (K,)
    image_parts: list[tuple[ImageItem, int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class StepResult:
    next_token_ids: list[int]  # (S,)
    next_logprobs: list[float]  # (S,) logprob of each sampled token
    target_logprobs: np.ndarray  # (R,) logprob of logprob_targets (NaN where -1)
    top_logprobs: np.ndarray | None = None  # (R, k) values
    top_ids: np.ndarray | None = None  # (R, k)
    hidden: np.ndarray | None = None  # (H, hidden_size) fp32: the plan's hidden_rows, normed
    probs: np.ndarray | None = None  # (P, V) fp32: the distributions of the plan's prob_rows
