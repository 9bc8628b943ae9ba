"""Images in a step's plan (torch-free): the multimodal rope positions of a vision model's
rows, and which extend rows are image tokens (their embeddings come from the vision tower).

A request's image placeholders are keyed in its input ids by a hash of the image's pixels
(`ImageItem.key`, past the vocabulary), so the radix tree shares an image's KV between requests
with the same image and never between different ones; the model reads id 0 there instead
(its rows' embeddings are replaced by the image's).

mrope (Qwen2-VL, Qwen2.5-VL, as transformers computes it): text tokens have three equal
positions; an image's tokens at merged grid cell (t, y, x) have (s + t, s + y, s + x), s being
the position its first token would have had; the text after it continues at s + max(h, w) (the
merged grid's height and width), so every later position is shifted by `delta` against its
index in the sequence (a decode row's position is its index + the request's total delta).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from radixflow.runtime.protocol.messages import ImageItem
from radixflow.runtime.protocol.plan import I64, BatchPlan

if TYPE_CHECKING:
    from radixflow.runtime.scheduler.request import Req


def prompt_mrope(images: list[ImageItem], prompt_len: int) -> tuple[np.ndarray, int]:
    """-> ((3, prompt_len) positions of the prompt, delta of every position after it)."""
    positions = np.repeat(np.arange(prompt_len, dtype=I64)[None, :], 3, axis=0)
    delta = 0
    for image in sorted(images, key=lambda i: i.offset):
        merge = math.isqrt(math.prod(image.grid) // image.num_tokens)  # the spatial merge
        t, h, w = image.grid[0], image.grid[1] // merge, image.grid[2] // merge
        assert t * h * w == image.num_tokens, f"{image.grid=} {image.num_tokens=}"
        start, end = image.offset, image.offset + image.num_tokens
        first = start + delta
        cells = np.arange(image.num_tokens, dtype=I64)
        positions[0, start:end] = first + cells // (h * w)
        positions[1, start:end] = first + (cells // w) % h
        positions[2, start:end] = first + cells % w
        delta += max(h, w) - image.num_tokens
        positions[:, end:] = np.arange(end, prompt_len, dtype=I64)[None, :] + delta
    return positions, delta


def request_mrope(req: Req, start: int, end: int) -> np.ndarray:
    """(3, end - start) positions of sequence indices [start, end) of `req`."""
    if req.mrope is None:
        req.mrope = prompt_mrope(req.images, len(req.input_ids))
    table, delta = req.mrope
    index = np.arange(start, end, dtype=I64)
    out = np.repeat((index + delta)[None, :], 3, axis=0)
    inside = index < table.shape[1]
    out[:, inside] = table[:, index[inside]]
    return out


def add_images(
    plan: BatchPlan, extends: list[Req], verifies: list[Req], decodes: list[Req]
) -> None:
    """Fill the plan's mrope positions, image rows and parts (rows in build_plan's order:
    extends, verifies, decodes), and read id 0 at image rows. No-op without images."""
    if not any(r.images for r in (*extends, *verifies, *decodes)):
        return
    parts, rows, row = [], [], 0
    spans: list[tuple[Req, int, int]] = [(r, r.kv_len, r.extend_target) for r in extends]
    spans += [(r, r.kv_len, r.kv_len + 1 + len(r.draft_ids)) for r in verifies]
    spans += [(r, r.kv_len, r.kv_len + 1) for r in decodes]
    positions = []
    for req, start, end in spans:
        positions.append(request_mrope(req, start, end))
        for image in req.images:
            first, last = max(start, image.offset), min(end, image.offset + image.num_tokens)
            if first < last:
                rows.append(np.arange(row + first - start, row + last - start, dtype=I64))
                parts.append((image, first - image.offset, last - first))
        row += end - start
    plan.image_parts = parts
    assert row == plan.num_tokens, f"{row=} {plan.num_tokens=}"
    plan.mrope_positions = np.concatenate(positions, axis=1)
    plan.image_rows = np.concatenate(rows) if rows else np.zeros(0, dtype=I64)
    plan.input_ids[plan.image_rows] = 0
