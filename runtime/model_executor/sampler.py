"""Batched next-token sampling: penalties, grammar masks, greedy and top-k/top-p/min-p.

Device-safe: what the host knows (penalty histories, bans, grammar masks, each row's
parameters) goes up in non-blocking copies (`step_inputs`), so on CUDA the one wait of a
step is its result (`sample`'s last line). Random rows draw by inverting each row's running
sum at a uniform from `generator` (on the logits' device; all unseeded rows in one call), or
from a generator of their own when seeded (`_draw`).
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
        probs, ids = _filtered(logits[rows], [plan.sampling[i] for i in sampled_rows])
        seeds = [plan.sample_seeds[i] for i in sampled_rows]
        chosen[rows] = _draw(probs, ids, seeds, generator)
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
    probs: torch.Tensor,
    ids: torch.Tensor | None,
    seeds: list[int | None],
    generator: torch.Generator,
) -> torch.Tensor:
    """One draw from each row of `probs` (n, C), unnormalized, by inverting its running sum at
    a uniform u: (n,) token ids (`ids` (n, C) maps a column to its token; None: the column is
    the token). A seeded row's u comes from a generator seeded with its seed, the others' from
    `generator`, all unseeded rows in one call. Why not torch.multinomial: on CPU it took
    ~1.2 ms a row over a 49,152-token vocabulary, a running sum and a search ~0.1 ms."""
    device, n = probs.device, probs.shape[0]
    u = torch.empty(n, device=device)
    unseeded = [j for j, seed in enumerate(seeds) if seed is None]
    if unseeded:
        (index,) = upload_int64([unseeded], device)
        u[index] = torch.rand(len(unseeded), generator=generator, device=device)
    for j, seed in enumerate(seeds):
        if seed is not None:
            gen = torch.Generator(device).manual_seed(seed)
            u[j : j + 1] = torch.rand(1, generator=gen, device=device)  # no host sync
    cdf = probs.cumsum(dim=-1)  # (n, C)
    total = cdf[:, -1]
    # below the total, so the first column whose sum passes it has a probability > 0
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    pick = torch.searchsorted(cdf, target[:, None], right=True).clamp_(max=cdf.shape[1] - 1)
    return pick[:, 0] if ids is None else ids.gather(1, pick)[:, 0]


CANDIDATES = 1024  # rows under top-k / top-p look among this many likeliest tokens first


def _filtered(
    logits: torch.Tensor, params: list[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Temperature, then top-k, top-p and min-p filtering: (n, C) probabilities (0 where
    filtered out) and (n, C) token ids, or ids None where the columns are the vocabulary.

    Why not a full sort: sorting (32, 49152) took ~70 ms on 2 CPU cores, about a batched
    decode step of SmolLM2. Rows filtered by rank take the top CANDIDATES (or their largest
    top_k) instead; that holds a row's nucleus whenever the candidates' mass reaches its top_p
    (every later token then starts past top_p), and when one row's does not, or a row is not
    ranked beside ranked ones, all rows are sorted in full as before."""
    device, vocab = logits.device, logits.shape[1]
    temps = _column([p.temperature for p in params], np.float32, device)
    probs = torch.softmax(logits / temps, dim=-1)
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    ranked = [k < vocab or p.top_p < 1 for k, p in zip(top_k, params)]
    min_p = _column([p.min_p for p in params], np.float32, device)
    if not any(ranked):  # temperature (and min-p) alone: no order needed
        return probs * (probs >= min_p * probs.max(dim=-1, keepdim=True).values), None
    top_p = _column([p.top_p for p in params], np.float32, device)
    width = min(vocab, max([CANDIDATES] + [k for k in top_k if k < vocab]))
    if all(ranked) and width < vocab and device.type == "cpu":  # the check below syncs
        cand, ids = probs.topk(width, dim=-1)  # (n, C), descending
        reaches = (cand.sum(dim=-1, keepdim=True) >= top_p) | (top_p >= 1)
        if not bool(reaches.all()):  # a flat row: its nucleus may run past the candidates
            cand, ids = probs.sort(dim=-1, descending=True)
    else:
        cand, ids = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(cand.shape[1], device=device)[None, :]
    keep = ranks < _column(top_k, np.int64, device)
    keep &= ((cand.cumsum(-1) - cand) < top_p) | (top_p >= 1)  # 1: the sum's rounding aside
    keep &= cand >= min_p * cand[:, :1]
    keep[:, 0] = True  # the likeliest token survives every filter (top_p may round to 0)
    return cand * keep, ids


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`_filtered` as (n, V) probabilities over the whole vocabulary."""
    probs, ids = _filtered(logits, params)
    if ids is None:
        return probs
    return torch.zeros(logits.shape, dtype=probs.dtype, device=probs.device).scatter_(1, ids, probs)
