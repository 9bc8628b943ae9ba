"""Every supported family against its transformers implementation, in fp32: ragged logits
through both CPU attention ops, logprobs through the engine (page sizes 1 and 16, chunked
prefill, prompts continuing from a cached prefix longer than the sliding window), and greedy
generation token for token, alone and batched, cache on and off."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from family_models import FAMILIES, WINDOW, one_thread, save_family, save_gemma3_multimodal
from tp_ranks import ragged_logits

from radixflow.kernels import CPU_OPS, REFERENCE_OPS
from radixflow.runtime import Engine
from radixflow.runtime.config import ServerConfig
from radixflow.runtime.model_executor.model_runner import load_model
from radixflow.runtime.models.layers import ForwardBatch

TOLERANCE = 1e-4
PREFIX_LEN = 24  # cached prefix: three windows long, more than a 16-slot page
# Sequences stay within Phi-3's original 72 positions: past them transformers switches the
# LongRoPE factors of a whole sequence (test_phi3_longrope_past_original_window).
MAX_COMPARED_LEN = 72


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    with one_thread():
        yield {family: save_family(family, root) for family in FAMILIES}


@pytest.fixture(scope="module")
def engines(checkpoints):
    """family -> Engine (page 1, 16-token prefill chunks, self-checks on)."""
    made = {}
    for family, (path, _) in checkpoints.items():
        made[family] = Engine(
            model=str(path), device="cpu", dtype="float32", max_total_tokens=1024,
            chunked_prefill_size=16, self_check=True,
        )  # fmt: skip
    yield made
    for engine in made.values():
        engine.shutdown()


def _ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, size=n).tolist()


def _t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _hf_logits(hf_model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    assert len(ids) <= MAX_COMPARED_LEN
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0]  # (L, vocab)


@pytest.mark.parametrize("ops", [CPU_OPS, REFERENCE_OPS], ids=lambda ops: ops.name)
@pytest.mark.parametrize("family", FAMILIES)
def test_ragged_logits_match_transformers(checkpoints, family, ops):
    """One ragged step: a fresh prompt, a prompt continuing after PREFIX_LEN cached tokens
    and a decode over 40 cached tokens, on scattered slots, after a warm-up step that
    cached the prefixes."""
    path, hf_model = checkpoints[family]
    model = load_model(path, ServerConfig(), torch.device("cpu"), torch.float32)
    model.ops = ops
    logits = ragged_logits(
        model
    )  # the step tests/runtime/distributed/test_tensor_parallel.py shards too
    s0, s1, s2 = _ids(1, 30), _ids(2, PREFIX_LEN + 14), _ids(3, 41)  # its prompts
    expected = [_hf_logits(hf_model, s) for s in (s0, s1, s2)]
    want = torch.cat([expected[0], expected[1][PREFIX_LEN:], expected[2][-1:]])
    err = (logits - want).abs().max().item()
    assert err < TOLERANCE, f"{family}: max abs logit error {err}"


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_logprobs_match_transformers(checkpoints, engines, family, page_size):
    """Input logprobs of a batch mixing a fresh prompt and one continuing from a cached
    prefix longer than the window, prefilled in 16-token chunks."""
    _, hf_model = checkpoints[family]
    engine = engines[family].with_config(page_size=page_size, self_check=True)
    prefix = _ids(10, PREFIX_LEN)
    engine.generate(input_ids=prefix, sampling_params={"max_new_tokens": 1})
    prompts = [prefix + _ids(11, 20), _ids(12, 40)]
    start = PREFIX_LEN + 1  # logprobs from here: positions before it may come from the cache
    outs = engine.generate(
        input_ids=prompts,
        sampling_params={"max_new_tokens": 1, "temperature": 0},
        return_logprob=True,
        logprob_start_len=start,
    )
    cached = outs[0]["meta_info"]["cached_tokens"]
    assert cached > WINDOW and cached >= PREFIX_LEN // page_size * page_size - page_size
    assert outs[1]["meta_info"]["cached_tokens"] == 0
    for ids, out in zip(prompts, outs):
        ours = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"]]
        ref = torch.log_softmax(_hf_logits(hf_model, ids), -1)  # (L, vocab)
        want = ref[start - 1 : len(ids) - 1].gather(1, _t(ids[start:])[:, None])[:, 0]
        err = (torch.tensor(ours[1:] if ours[0] is None else ours) - want).abs().max().item()
        assert err < TOLERANCE, f"{family} page {page_size}: max abs logprob error {err}"
    engine.check_idle()
    engine.shutdown()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_generate(checkpoints, engines, family):
    """32 greedy tokens equal transformers' `generate`, batched and alone, with the radix
    cache on (the prompts share a prefix longer than the window) and off."""
    _, hf_model = checkpoints[family]
    shared = _ids(20, 18)
    prompts = [shared + _ids(21, 12), shared + _ids(22, 19), _ids(23, 25)]
    hf_model.generation_config.eos_token_id = None
    expected = []
    for ids in prompts:
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([ids]), max_new_tokens=32, do_sample=False, pad_token_id=0
            )
        expected.append(out[0, len(ids) :].tolist())
    params = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    cached = engines[family]
    uncached = cached.with_config(disable_radix_cache=True, page_size=16)
    for engine, alone in ((cached, prompts), (uncached, prompts[:1])):
        batched = engine.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in batched] == expected, family
        for ids, want in zip(alone, expected):
            assert engine.generate(input_ids=ids, sampling_params=params)["output_ids"] == want
        engine.check_idle()
    uncached.shutdown()


def test_phi3_longrope_past_original_window(checkpoints, engines):
    """Past `original_max_position_embeddings` each position takes the long factors, so a
    position's K/V never depends on how long its sequence grows (the radix cache relies on
    it): token for token what transformers computes decoding with its KV cache kept.
    (transformers' `generate` instead drops its cache at that point and re-encodes the
    whole sequence with the long factors; we do not follow it there.)"""
    _, hf_model = checkpoints["phi3"]
    ids = _ids(30, 64)
    with torch.no_grad():
        out = hf_model(torch.tensor([ids]), use_cache=True)
        want = [int(out.logits[0, -1].argmax())]
        for _ in range(15):  # to position 79, past the original 72
            out = hf_model(torch.tensor([want[-1:]]), cache=out.cache)
            want.append(int(out.logits[0, -1].argmax()))
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    got = engines["phi3"].generate(input_ids=ids, sampling_params=params)["output_ids"]
    assert got == want


def test_gemma3_image_text_checkpoint_serves_its_text_model(tmp_path):
    """Gemma 3 4B and up ship as Gemma3ForConditionalGeneration: the text model is served
    (its names renamed, the vision tower's weights skipped) with transformers' logits."""
    path, hf_model = save_gemma3_multimodal(tmp_path)
    with one_thread():
        model = load_model(path, ServerConfig(), torch.device("cpu"), torch.float32)
        ids = _ids(40, 36)
        n = len(ids)
        cfg = model.config
        k = torch.zeros(cfg.num_layers, 64, cfg.num_kv_heads, cfg.head_dim)
        batch = ForwardBatch(
            _t(ids), _t(list(range(n))), _t(list(range(1, n + 1))), n, _t([0, n]), _t([0, 0]),
            _t([]), _t([0]), _t([]), _t(list(range(n))),
        )  # fmt: skip
        logits = model(batch, k, torch.zeros_like(k))
        with torch.no_grad():
            want = hf_model(input_ids=torch.tensor([ids])).logits[0]
    assert (logits - want).abs().max().item() < TOLERANCE
