"""Batched next-token sampling: penalties, grammar masks, greedy and top-k/top-p/min-p.

Device-safe: what the host knows (penalty histories, bans, grammar masks, each row's
parameters) goes up in non-blocking copies (`step_inputs`), so on CUDA the one wait of a
step is its result (`sample`'s last line). Random rows draw from `generator` (on the
logits' device), or from a generator of their own when seeded: one row at a time on CPU
(the streams of earlier releases), unseeded rows in one batched draw on CUDA.
"""

from __future__ import annotations

import numpy as np
import torch

from radixflow.kernels.cpu import native
from radixflow.runtime.model_executor.step_inputs import upload, upload_int64
from radixflow.runtime.protocol.plan import BatchPlan
from radixflow.runtime.protocol.sampling import SamplingParams


def unpack_bitmask(words: np.ndarray, vocab_size: int, device: torch.device) -> torch.Tensor:
    """(S, W) int32 words -> (S, vocab_size) bool, bit t of word w allows token 32*w + t."""
    packed = upload(words, device)
    bits = (packed[:, :, None] >> torch.arange(32, dtype=torch.int32, device=device)) & 1
    return bits.reshape(packed.shape[0], -1)[:, :vocab_size].bool()  # (S, W * 32) -> (S, V)


def _column(values: list[float], dtype: type, device: torch.device) -> torch.Tensor:
    """Per-row values -> (n, 1) on `device` (float32 or int64, as torch.tensor would make)."""
    return upload(np.asarray(values, dtype=dtype), device)[:, None]


def _penalize(logits: torch.Tensor, plan: BatchPlan, rows: list[int]) -> None:
    """Repetition, frequency and presence penalties of `rows` (their outputs so far)."""
    device, histories = logits.device, [plan.output_ids[i] for i in rows]
    owner = np.repeat(np.arange(len(rows)), [len(h) for h in histories])
    index, tokens, chosen = upload_int64([owner, np.concatenate(histories), rows], device)
    vocab = logits.shape[1]
    counts = torch.zeros((len(rows), vocab), dtype=logits.dtype, device=device)  # (n, V)
    ones = torch.ones_like(index, dtype=logits.dtype)
    counts.view(-1).scatter_add_(0, index * vocab + tokens, ones)  # no sync, unlike index_put_
    params = [plan.sampling[i] for i in rows]
    rep = _column([p.repetition_penalty for p in params], np.float32, device)
    freq = _column([p.frequency_penalty for p in params], np.float32, device)
    pres = _column([p.presence_penalty for p in params], np.float32, device)
    sub, seen = logits[chosen], counts > 0  # (n, V)
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    logits[chosen] = sub - (freq * counts + pres * seen.to(logits.dtype))


def _add_bias(logits: torch.Tensor, biases: list[tuple[int, int, float]]) -> None:
    """OpenAI's logit_bias: add each (row, token, bias) to its logit (one pair per token)."""
    rows, tokens = upload_int64([[b[0] for b in biases], [b[1] for b in biases]], logits.device)
    values = upload(np.asarray([b[2] for b in biases], dtype=np.float32), logits.device)
    logits.view(-1).scatter_add_(0, rows * logits.shape[1] + tokens, values)


def process_logits(logits: torch.Tensor, plan: BatchPlan) -> torch.Tensor:
    """Apply penalties, logit biases, bans and grammar masks to (S, V) fp32 logits, in place.
    Biases come before bans and masks, so +100 never revives a token they forbid."""
    penalized = [
        i
        for i, p in enumerate(plan.sampling)
        if (p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0)
        and plan.output_ids[i]
    ]
    if penalized:
        _penalize(logits, plan, penalized)
    biases = [
        (i, int(token), bias)
        for i, p in enumerate(plan.sampling)
        if p.logit_bias
        for token, bias in p.logit_bias.items()
    ]
    if biases:
        _add_bias(logits, biases)
    bans = [(i, token) for i, ids in enumerate(plan.banned_ids) for token in ids]
    if bans:
        rows, tokens = upload_int64(np.asarray(bans, dtype=np.int64).T, logits.device)
        logits[rows, tokens] = float("-inf")
    if plan.vocab_masks is not None:
        allowed = unpack_bitmask(plan.vocab_masks, logits.shape[1], logits.device)
        logits.masked_fill_(~allowed, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,
    plan: BatchPlan,
    generator: torch.Generator,
    probs_out: list[torch.Tensor] | None = None,
) -> tuple[list[int], list[float]]:
    """Pick one token per row of (S, V) logits; return ids and their logprobs; append the
    (P, V) distributions the rows of `plan.prob_rows` sample from to `probs_out`.

    Overwrites `logits`: the log-sum-exp runs in place instead of allocating an (S, V)
    temporary every step."""
    logits = process_logits(logits, plan)
    # max finds indices faster than argmax on CPU, and the native pass faster than both
    top, chosen = native.argmax(logits) or logits.max(dim=-1)
    sampled_rows = [i for i, p in enumerate(plan.sampling) if not p.greedy]
    if sampled_rows:
        (rows,) = upload_int64([sampled_rows], logits.device)
        probs = _filtered_probs(logits[rows], [plan.sampling[i] for i in sampled_rows])
        seeds = [plan.sample_seeds[i] for i in sampled_rows]
        _draw(chosen, rows, probs, seeds, generator)
    if probs_out is not None and len(plan.prob_rows):
        (wanted,) = upload_int64([plan.prob_rows], logits.device)
        probs_out.append(
            _filtered_probs(logits[wanted], [plan.sampling[i] for i in plan.prob_rows])
        )
    if not plan.sampled_logprobs:  # the log-sum-exp is a pass over (S, V): skip it
        return chosen.tolist(), [float("nan")] * len(chosen)
    picked = logits.gather(1, chosen[:, None])[:, 0] if sampled_rows else top
    shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    log_total = shift + logits.sub_(shift[:, None]).exp_().sum(dim=-1).log()
    # The step's one wait: ids (exact in float64) and logprobs come back in one copy.
    result = torch.stack([chosen.to(torch.float64), (picked - log_total).to(torch.float64)])
    ids, logprobs = result.cpu().tolist()
    return [int(i) for i in ids], logprobs


def _draw(
    chosen: torch.Tensor,
    rows: torch.Tensor,
    probs: torch.Tensor,
    seeds: list[int | None],
    generator: torch.Generator,
) -> None:
    """Write a draw from each row of `probs` (n, V) into chosen[rows]: a seeded row from a
    generator seeded with its seed (on the logits' device), the others from `generator`."""
    device = probs.device
    unseeded = [j for j, seed in enumerate(seeds) if seed is None]
    if device.type != "cpu" and unseeded:  # one batched draw, no per-row launch
        (index,) = upload_int64([unseeded], device)
        chosen[rows[index]] = torch.multinomial(probs[index], 1, generator=generator)[:, 0]
    for j, seed in enumerate(seeds):
        if seed is None and device.type != "cpu":
            continue
        gen = generator if seed is None else torch.Generator(device).manual_seed(seed)
        # a 1-element index tensor: a 0-dim one would be read on the host (a sync)
        chosen[rows[j : j + 1]] = torch.multinomial(probs[j], 1, generator=gen)


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p filtering; returns (n, V) probabilities."""
    device, vocab = logits.device, logits.shape[1]
    temps = _column([p.temperature for p in params], np.float32, device)
    probs = torch.softmax(logits / temps, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    ranks = torch.arange(vocab, device=device)[None, :]
    keep &= ranks < _column([p.top_k if p.top_k > 0 else vocab for p in params], np.int64, device)
    top_p = _column([p.top_p for p in params], np.float32, device)
    keep &= (sorted_probs.cumsum(-1) - sorted_probs) < top_p
    min_p = _column([p.min_p for p in params], np.float32, device)
    keep &= sorted_probs >= min_p * sorted_probs[:, :1]
    keep[:, 0] = True  # the likeliest token survives every filter (top_p may round to 0)
    sorted_probs = sorted_probs * keep
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)
