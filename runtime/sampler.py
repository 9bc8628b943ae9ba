"""Batched next-token sampling: penalties, grammar masks, greedy and top-k/top-p/min-p."""

from __future__ import annotations

import numpy as np
import torch

from radixflow.runtime.batch import BatchPlan

_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(words: np.ndarray, vocab_size: int, device: torch.device) -> torch.Tensor:
    """(S, W) int32 words -> (S, vocab_size) bool, bit t of word w allows token 32*w + t."""
    packed = torch.from_numpy(words).to(device)
    bits = (packed[:, :, None] >> _BITS.to(device)) & 1  # (S, W, 32)
    return bits.reshape(packed.shape[0], -1)[:, :vocab_size].bool()


def process_logits(logits: torch.Tensor, plan: BatchPlan) -> torch.Tensor:
    """Apply penalties, bans and grammar masks to (S, V) fp32 logits, in place."""
    for i, params in enumerate(plan.sampling):
        freq, pres, rep = (
            params.frequency_penalty,
            params.presence_penalty,
            params.repetition_penalty,
        )
        if (freq or pres or rep != 1.0) and plan.output_ids[i]:
            ids = torch.tensor(plan.output_ids[i], device=logits.device)
            counts = torch.bincount(ids, minlength=logits.shape[1]).to(logits.dtype)
            row = logits[i]
            if rep != 1.0:
                seen = counts > 0
                row[seen] = torch.where(row[seen] > 0, row[seen] / rep, row[seen] * rep)
            row -= freq * counts + pres * (counts > 0).to(logits.dtype)
        if plan.banned_ids[i]:
            logits[i, list(plan.banned_ids[i])] = float("-inf")
    if plan.vocab_masks is not None:
        allowed = unpack_bitmask(plan.vocab_masks, logits.shape[1], logits.device)
        logits.masked_fill_(~allowed, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor, plan: BatchPlan, generator: torch.Generator
) -> tuple[list[int], list[float]]:
    """Pick one token per row of (S, V) logits; return ids and their logprobs.

    Overwrites `logits`: the log-sum-exp runs in place instead of allocating an (S, V)
    temporary every step."""
    logits = process_logits(logits, plan)
    top, chosen = logits.max(dim=-1)  # max finds indices faster than argmax on CPU
    sampled_rows = [i for i, p in enumerate(plan.sampling) if not p.greedy]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=logits.device)
        probs = _filtered_probs(logits[rows], [plan.sampling[i] for i in sampled_rows])
        for j, i in enumerate(sampled_rows):
            seed = plan.sample_seeds[i]
            gen = generator if seed is None else torch.Generator().manual_seed(seed)
            chosen[i] = torch.multinomial(probs[j].cpu(), 1, generator=gen).to(chosen.device)[0]
    if not plan.sampled_logprobs:  # the log-sum-exp is a pass over (S, V): skip it
        return chosen.tolist(), [float("nan")] * len(chosen)
    picked = logits.gather(1, chosen[:, None])[:, 0] if sampled_rows else top
    shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    log_total = shift + logits.sub_(shift[:, None]).exp_().sum(dim=-1).log()
    return chosen.tolist(), (picked - log_total).tolist()


def _filtered_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p filtering; returns (n, V) probabilities."""
    temps = torch.tensor([p.temperature for p in params], device=logits.device)[:, None]
    probs = torch.softmax(logits / temps, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    ranks = torch.arange(probs.shape[1], device=probs.device)[None, :]
    top_k = torch.tensor(
        [p.top_k if p.top_k > 0 else probs.shape[1] for p in params], device=probs.device
    )[:, None]
    keep &= ranks < top_k
    top_p = torch.tensor([p.top_p for p in params], device=probs.device)[:, None]
    keep &= (sorted_probs.cumsum(-1) - sorted_probs) < top_p
    min_p = torch.tensor([p.min_p for p in params], device=probs.device)[:, None]
    keep &= sorted_probs >= min_p * sorted_probs[:, :1]
    keep[:, 0] = True  # the likeliest token survives every filter (top_p may round to 0)
    sorted_probs = sorted_probs * keep
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)
