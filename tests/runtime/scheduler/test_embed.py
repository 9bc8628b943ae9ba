"""Embedding requests through the scheduler and the model: the pooled vector is transformers'
final hidden state (after the final norm) of the last token, or the mean over the prompt,
L2-normalized; batched, chunked and mixed with generation it equals the vector of one prompt
alone; its KV goes back to the pool."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from family_models import FAMILIES, one_thread, save_family

from radixflow.runtime import Engine

TOLERANCE = 1e-4  # unit vectors, fp32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (Engine on its tiny random checkpoint, 16-token chunks, transformers' model)."""
    root = tmp_path_factory.mktemp("embed-families")
    made = {}
    with one_thread():
        for family in FAMILIES:
            path, hf_model = save_family(family, root)
            engine = Engine(
                model=str(path), device="cpu", dtype="float32", max_total_tokens=1024,
                chunked_prefill_size=16, self_check=True,
            )  # fmt: skip
            made[family] = (engine, hf_model)
        yield made
    for engine, _ in made.values():
        engine.shutdown()


def _ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, size=n).tolist()


def _hf_vectors(hf_model: torch.nn.Module, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """transformers' (last-token, mean) vectors: the base model's last_hidden_state is the
    final norm's output, the LM head's input."""
    with torch.no_grad():
        out = hf_model(torch.tensor([ids]), output_hidden_states=True)
        base = hf_model.model(torch.tensor([ids])).last_hidden_state[0]
    hidden = out.hidden_states[-1][0].double().numpy()  # (L, hidden)
    assert np.allclose(hidden, base.double().numpy(), atol=1e-6)  # normed, as the head sees
    last, mean = hidden[-1], hidden.mean(0)
    return last / np.linalg.norm(last), mean / np.linalg.norm(mean)


@pytest.mark.parametrize("family", FAMILIES)
def test_pooled_vectors_match_transformers(tiny, family):
    """Two prompts of different lengths in one batch, both longer than a 16-token chunk."""
    engine, hf_model = tiny[family]
    prompts = [_ids(1, 45), _ids(2, 23)]
    with one_thread():
        last = engine.encode(input_ids=prompts)
        mean = engine.encode(input_ids=prompts, pooling="mean")
    for ids, ours_last, ours_mean in zip(prompts, last, mean):
        want_last, want_mean = _hf_vectors(hf_model, ids)
        assert ours_last["meta_info"]["prompt_tokens"] == len(ids)
        assert np.abs(np.array(ours_last["embedding"]) - want_last).max() < TOLERANCE, family
        assert np.abs(np.array(ours_mean["embedding"]) - want_mean).max() < TOLERANCE, family
        assert abs(np.linalg.norm(ours_last["embedding"]) - 1.0) < 1e-6
    engine.check_idle()


def test_cached_prefix_gives_the_same_vector(tiny):
    """A prompt whose prefix the radix cache holds computes only its tail; "last" pooling
    reuses it, "mean" recomputes every position: both equal transformers'."""
    engine, hf_model = tiny["llama"]
    prefix = _ids(5, 30)
    ids = prefix + _ids(6, 9)
    with one_thread():
        engine.generate(input_ids=prefix, sampling_params={"max_new_tokens": 1})
        last = engine.encode(input_ids=ids)
        mean = engine.encode(input_ids=ids, pooling="mean")
    assert last["meta_info"]["cached_tokens"] >= 16
    assert mean["meta_info"]["cached_tokens"] == 0
    want_last, want_mean = _hf_vectors(hf_model, ids)
    assert np.abs(np.array(last["embedding"]) - want_last).max() < TOLERANCE
    assert np.abs(np.array(mean["embedding"]) - want_mean).max() < TOLERANCE


def test_smollm2_batched_equals_one_at_a_time_and_transformers(engine, make_engine, hf_model):
    """SmolLM2: two prompts of different lengths batched (in 32-token chunks) equal each
    alone on a fresh engine, and transformers' on the same weights; the KV all returns."""
    tokenizer = engine.tokenizer
    texts = [
        "The quick brown fox jumps over the lazy dog while the farmer watches from the barn "
        "and the sun sets slowly behind the hills of the quiet valley.",
        "Embeddings map text to vectors.",
    ]
    batched_engine = make_engine(chunked_prefill_size=32, disable_radix_cache=True)
    batched = batched_engine.encode(texts)
    alone = [make_engine(disable_radix_cache=True).encode(t) for t in texts]
    for text, b, a in zip(texts, batched, alone):
        ids = tokenizer.encode(text, add_special_tokens=False)
        want, _ = _hf_vectors(hf_model, ids)
        assert np.abs(np.array(b["embedding"]) - np.array(a["embedding"])).max() < 1e-5
        assert np.abs(np.array(b["embedding"]) - want).max() < TOLERANCE
    stats = batched_engine.stats()
    assert stats["free_slots"] == stats["total_slots"], stats  # no cache: every slot is free
    batched_engine.check_idle()


def test_embed_shares_a_batch_with_generation(make_engine):
    """A generation running while an embedding request prefills: both give what they give
    alone (greedy tokens, vector)."""
    engine = make_engine()
    prompt = "Name three colors:"
    alone_text = engine.generate(prompt, {"max_new_tokens": 8, "temperature": 0})["text"]
    alone_vector = np.array(engine.encode("A sentence to embed, long enough.")["embedding"])
    engine.flush_cache()
    (handle,) = engine.submit(prompt, {"max_new_tokens": 8, "temperature": 0})
    engine.step()  # the generation is decoding when the embedding arrives
    vector = np.array(engine.encode("A sentence to embed, long enough.")["embedding"])
    assert not handle.finished  # the embedding's prefill ran beside its decodes
    while engine.step():
        pass
    assert handle.result()["text"] == alone_text
    assert np.abs(vector - alone_vector).max() < 1e-5
    assert engine.flush_cache()
    stats = engine.stats()
    assert stats["free_slots"] == stats["total_slots"], stats
    engine.check_idle()


def test_too_long_and_bad_pooling_are_refused(make_engine):
    engine = make_engine()
    context = engine.model_info["context_length"]
    with pytest.raises(ValueError) as generate_error:
        engine.generate(input_ids=[1] * context, sampling_params={"max_new_tokens": 1})
    with pytest.raises(ValueError) as embed_error:
        engine.encode(input_ids=[1] * context)
    assert str(embed_error.value) == str(generate_error.value)
    with pytest.raises(ValueError, match="pooling"):
        engine.encode("x", pooling="max")
