"""--kv-cache-dtype int8 on SmolLM2: the pool's memory, the compiled decode loop reading it,
and its logits against the exact fp32 pool's."""

from __future__ import annotations

import logging
import re

import torch

from conftest import CHAT_PROMPTS, chat
from radixflow.kernels.cpu import decode_loop
from radixflow.kernels.kv_int8 import Int8KV

NEW_TOKENS = 16
# Measured on SmolLM2 over the five chat prompts (the prefill's and 16 greedy steps' logits,
# up to where the outputs part): |logit difference| max 1.12, mean 0.44, top-1 the same at
# 51 of 53 positions (bf16's pool: 0.18 / 0.07, 74 of 75; fp16's: 0.024 / 0.009; logits span
# about -12 .. 23). Per-head scales round the few large key channels well and the rest
# coarsely: that is the price of 1.94x bf16's tokens. A kernel that ignores the scales moves
# logits by units.
MAX_LOGIT_ERROR = 2.0
MAX_MEAN_ERROR = 0.75
MIN_TOP1 = 0.9


def step_logits(engine, prompt: str, monkeypatch) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy output ids of `prompt` and the logits (V,) of every step that sampled them (a
    step per token: decode runs pick their tokens without handing logits back)."""
    single = engine.scheduler.config.replace(num_continuous_decode_steps=1)
    monkeypatch.setattr(engine.scheduler, "config", single)
    runner = engine.scheduler.runner
    seen: list[torch.Tensor] = []
    postprocess = runner._postprocess

    def record(logits, plan):
        seen.append(logits[-1].float().clone())  # one request: its row is the last
        return postprocess(logits, plan)

    monkeypatch.setattr(runner, "_postprocess", record)
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    out = engine.generate(prompt, params)
    monkeypatch.undo()
    return out["output_ids"], seen


def test_int8_pool_memory_and_logits_against_the_fp32_pool(
    engine, make_engine, monkeypatch, caplog
) -> None:
    """The int8 pool holds int8 data plus one fp32 scale per (token, KV head): 12,240 B a
    token for SmolLM2 against bf16's 23,040 and fp32's 46,080 (the start log says so); every
    decode step runs in the compiled loop on it; and over the chat prompts its logits stay
    within MAX_LOGIT_ERROR of the fp32 pool's, with the same top-1 token."""
    with caplog.at_level(logging.INFO, logger="radixflow.kv"):
        int8 = make_engine(kv_cache_dtype="int8")
    line = next(r.getMessage() for r in caplog.records if r.name == "radixflow.kv")
    assert re.search(r"KV pool: int8, 12,240 B per token", line), line
    runner, exact = int8.scheduler.runner, engine.scheduler.runner
    assert isinstance(runner.k_caches, Int8KV) and runner.k_caches.data.dtype == torch.int8
    assert runner.k_caches.scale.shape == runner.k_caches.shape[:-1]
    slots = runner.k_caches.shape[1]
    int8_bytes = (runner.k_caches.nbytes + runner.v_caches.nbytes) / slots
    fp32_bytes = (exact.k_caches.nbytes + exact.v_caches.nbytes) / exact.k_caches.shape[1]
    assert int8_bytes == 12_240 and fp32_bytes == 46_080

    looped: list[bool] = []
    run = decode_loop.DecodeLoop.run

    def counted(self, *args):
        out = run(self, *args)
        looped.append(out is not None)
        return out

    errors, same, compared = [], 0, 0
    for text in CHAT_PROMPTS:
        want_ids, want = step_logits(engine, chat(text), monkeypatch)
        monkeypatch.setattr(decode_loop.DecodeLoop, "run", counted)
        got_ids, got = step_logits(int8, chat(text), monkeypatch)
        # logits are comparable while both have generated the same tokens
        split = next((i for i, (a, b) in enumerate(zip(want_ids, got_ids)) if a != b), NEW_TOKENS)
        for a, b in zip(want[: split + 1], got[: split + 1]):
            errors.append((a - b).abs().max().item())
            same += int(a.argmax() == b.argmax())
            compared += 1
    assert looped and all(looped)  # the compiled loop took every decode step
    worst = max(errors)
    assert compared >= len(CHAT_PROMPTS) * NEW_TOKENS // 2
    assert 0 < worst < MAX_LOGIT_ERROR, errors
    assert sum(errors) / len(errors) < MAX_MEAN_ERROR, errors
    assert same / compared >= MIN_TOP1, (same, compared)
