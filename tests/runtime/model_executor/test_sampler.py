"""The sampler's filters and draw against plain references: top-k / top-p / min-p as a full
sort of the vocabulary would give them (the candidates shortcut and its fallback included),
and draws whose frequencies follow the filtered distribution, seeded rows reproducible."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from radixflow.runtime.model_executor import sampler
from radixflow.runtime.protocol.sampling import SamplingParams

VOCAB = 49152  # SmolLM2's: wide enough that the candidates are a small part of it


def reference_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then each filter on the fully sorted distribution, row by row."""
    out = torch.zeros_like(logits)
    for i, p in enumerate(params):
        probs = torch.softmax(logits[i] / p.temperature, dim=-1)
        values, order = probs.sort(descending=True)
        keep = torch.ones_like(values, dtype=torch.bool)
        if 0 < p.top_k < len(values):
            keep[p.top_k :] = False
        if p.top_p < 1:  # top_p 1 keeps every token, however the sum rounds
            keep &= (values.cumsum(0) - values) < p.top_p
        keep &= values >= p.min_p * values[0]
        keep[0] = True
        out[i, order] = values * keep
    return out


def params(**fields) -> SamplingParams:
    return SamplingParams.from_dict({"temperature": 0.8, **fields})


def peaked_logits(rows: int, seed: int) -> torch.Tensor:
    """A language model's shape: a few likely tokens over a long flat tail."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=gen)
    logits[:, :64] += 8 + 4 * torch.rand(rows, 64, generator=gen)
    return logits


@pytest.mark.parametrize(
    "rows",
    [
        [params(top_p=0.9), params(top_k=40), params(top_k=5, top_p=0.5, min_p=0.05)],
        [params(top_k=3000), params(top_k=3000, top_p=0.95)],  # widens the candidates
        [params(min_p=0.1), params()],  # nothing ranked: no sort at all
        [params(top_p=0.9), params()],  # ranked beside unranked: the full sort
    ],
)
def test_filters_equal_a_full_sort(rows: list[SamplingParams]) -> None:
    logits = peaked_logits(len(rows), 1)
    got, want = sampler._filtered_probs(logits.clone(), rows), reference_probs(logits, rows)
    assert torch.equal(got > 0, want > 0)  # the same tokens kept, the tail's tiny ones too
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_a_flat_row_whose_nucleus_passes_the_candidates_is_sorted_in_full() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[0, :64] = 8.0  # peaked: its nucleus lies in the candidates
    rows = [params(top_p=0.9), params(top_p=0.9)]  # the flat row needs ~44,000 tokens
    got = sampler._filtered_probs(logits.clone(), rows)
    assert int((got[1] > 0).sum()) > 40_000
    torch.testing.assert_close(got, reference_probs(logits, rows), rtol=1e-5, atol=1e-7)


def test_draws_follow_the_filtered_distribution_and_seeds_repeat() -> None:
    torch.manual_seed(0)
    logits = torch.full((1, VOCAB), -30.0)
    logits[0, :12] = torch.linspace(0.0, 3.0, 12)  # 12 plausible tokens, the last likeliest
    rows = [params(temperature=1.0, top_p=0.9)]
    expected = reference_probs(logits, rows)[0]
    draws = 20_000
    probs, ids = sampler._filtered(logits.clone(), rows)
    assert ids is not None and ids.shape[1] < VOCAB  # the candidates' path
    probs, ids = probs.expand(draws, -1).contiguous(), ids.expand(draws, -1).contiguous()
    tokens = sampler._draw(probs, ids, [None] * draws, torch.Generator().manual_seed(1))
    counts = np.bincount(tokens.numpy(), minlength=VOCAB)
    support = (expected > 0).numpy()
    assert counts[~support].sum() == 0  # nothing outside the nucleus is ever drawn
    share = expected[support].double().numpy()
    assert chisquare(counts[support], share / share.sum() * draws).pvalue > 1e-3
    shared = torch.Generator().manual_seed(2)  # advanced by the first call: seeds ignore it
    seeded = [sampler._draw(probs[:8], ids[:8], list(range(8)), shared) for _ in "ab"]
    assert torch.equal(seeded[0], seeded[1]) and len(set(seeded[0].tolist())) > 1
