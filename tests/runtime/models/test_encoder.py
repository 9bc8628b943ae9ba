"""The BERT-style encoder family served with --is-embedding: pooled vectors equal transformers'
BertModel / XLMRobertaModel last_hidden_state pooled the same way and normalized, batched and
one input at a time; inputs are never chunked and give their pool slots back; generation
and inputs past max_position_embeddings are refused; a server answers /v1/embeddings and
refuses /generate and chat with a 400."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch
import transformers
from family_models import one_thread

from conftest import start_server
from radixflow.runtime import Engine
from radixflow.runtime.models import UnsupportedModelError
from radixflow.runtime.models.bert import sentence_pooling

WORDS = "the cat dog sat ran on in a mat house big small red blue ##s ##ed ##ing".split()
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *"abcdefghijklmnopqrstuvwxyz"]
MAX_POSITION = 24
TEXTS = [
    "the big red cat sat on the mat in the house",
    "a dog ran",
    "blue",
    "the small dogs ran in a big house",
]
# a small token budget and chunk: inputs longer than a chunk still run whole
ENGINE = dict(device="cpu", dtype="float32", max_total_tokens=256, chunked_prefill_size=8,
              max_prefill_tokens=16, self_check=True, is_embedding=True)  # fmt: skip
COMMON = dict(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=64, max_position_embeddings=MAX_POSITION)  # fmt: skip


def save_encoder(root, name: str, config, pooling: str | None):
    """A random-weight encoder (norms and biases drawn too) with a tiny WordPiece tokenizer,
    and sentence-transformers' pooling config when `pooling` is given."""
    torch.manual_seed(len(name))
    model = transformers.AutoModel.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for key, param in model.named_parameters():
            if "LayerNorm" in key or key.endswith("bias"):
                param.normal_(1.0 if key.endswith("weight") else 0.0, 0.3)
    path = root / name
    model.save_pretrained(path, safe_serialization=True)
    tokenizer = transformers.BertTokenizerFast(vocab={w: i for i, w in enumerate(VOCAB)})
    tokenizer.save_pretrained(path)
    if pooling is not None:
        (path / "1_Pooling").mkdir()
        modes = {"pooling_mode_cls_token": pooling == "cls",
                 "pooling_mode_mean_tokens": pooling == "mean"}  # fmt: skip
        (path / "1_Pooling" / "config.json").write_text(json.dumps(modes))
    return path, model, tokenizer


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    """name -> (Engine, transformers model, tokenizer): BERT pooling [CLS] by its
    sentence-transformers config, XLM-RoBERTa (positions after the padding id) by the mean."""
    root = tmp_path_factory.mktemp("encoders")
    made = {}
    with one_thread():
        bert = transformers.BertConfig(**COMMON)
        xlmr = transformers.XLMRobertaConfig(**{**COMMON, "max_position_embeddings": 26},
                                             pad_token_id=0)  # fmt: skip
        for name, config, pooling in (("bert", bert, "cls"), ("xlmr", xlmr, None)):
            path, model, tokenizer = save_encoder(root, name, config, pooling)
            made[name] = (Engine(model=str(path), **ENGINE), model, tokenizer)
        yield made
    for engine, _, _ in made.values():
        engine.shutdown()


def reference(model, tokenizer, texts: list[str], pooling: str) -> np.ndarray:
    """transformers' last_hidden_state of the padded batch, pooled and L2-normalized."""
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state  # (B, L, hidden)
    mask = batch.attention_mask[..., None].float()
    pooled = hidden[:, 0] if pooling == "cls" else (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(pooled, dim=-1).numpy()


@pytest.mark.parametrize("name,pooling", [("bert", "cls"), ("xlmr", "mean"), ("bert", "mean")])
def test_vectors_equal_transformers_batched_and_alone(encoders, name, pooling):
    engine, model, tokenizer = encoders[name]
    expected = reference(model, tokenizer, TEXTS, pooling)
    asked = "" if pooling == engine.model_info["pooling"] else pooling  # "": the model's own
    batched = np.array([r["embedding"] for r in engine.encode(TEXTS, pooling=asked)])
    alone = np.array([engine.encode(text, pooling=asked)["embedding"] for text in TEXTS])
    np.testing.assert_allclose(batched, expected, atol=1e-4)
    np.testing.assert_allclose(alone, expected, atol=1e-4)
    first = engine.encode(TEXTS[0], pooling=asked)["meta_info"]
    assert first["prompt_tokens"] == len(tokenizer(TEXTS[0]).input_ids)  # [CLS] ... [SEP]


def test_pooling_defaults_from_the_checkpoint(encoders, tmp_path):
    assert encoders["bert"][0].model_info["pooling"] == "cls"
    assert encoders["xlmr"][0].model_info["pooling"] == "mean"  # no 1_Pooling: the mean
    (tmp_path / "modules.json").write_text(json.dumps([
        {"path": "", "type": "sentence_transformers.models.Transformer"},
        {"path": "2_Dense", "type": "sentence_transformers.models.Dense"},
    ]))  # fmt: skip
    with pytest.raises(UnsupportedModelError, match="Dense"):
        sentence_pooling(tmp_path)


def test_generation_and_long_inputs_refused_and_no_kv_kept(encoders):
    engine, _, _ = encoders["bert"]
    with pytest.raises(ValueError, match=r"serves embeddings \(--is-embedding\)"):
        engine.generate("the cat", {"max_new_tokens": 4})
    with pytest.raises(ValueError, match="context length is 24"):
        engine.encode(input_ids=[2] + [5] * MAX_POSITION + [3])
    engine.encode(TEXTS * 3)
    stats = engine.scheduler.stats()
    assert stats["free_slots"] == stats["total_slots"], stats
    assert stats["tokens_in_tree"] == 0, stats
    assert stats["prefill_tokens_computed"] >= sum(len(t.split()) + 2 for t in TEXTS * 3)


def test_an_encoder_needs_is_embedding(encoders):
    path = encoders["bert"][0].model_info["model_path"]
    with pytest.raises(UnsupportedModelError, match="pass --is-embedding"):
        Engine(model=path, **{**ENGINE, "is_embedding": False})


def test_server_embeds_and_refuses_generation(encoders):
    engine, model, tokenizer = encoders["bert"]
    options = dict(model_path=engine.model_info["model_path"], is_embedding=True,
                   max_total_tokens=256, num_threads=1)  # fmt: skip
    with start_server(**options) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        reply = http.post("/v1/embeddings", json={"input": TEXTS})
        assert reply.status_code == 200, reply.text
        got = np.array([item["embedding"] for item in reply.json()["data"]])
        np.testing.assert_allclose(got, reference(model, tokenizer, TEXTS, "cls"), atol=1e-4)
        reply = http.post("/api/embed", json={"model": "default", "input": TEXTS[1]})
        assert reply.status_code == 200, reply.text
        for path, body in (
            ("/generate", {"text": "the cat", "sampling_params": {"max_new_tokens": 2}}),
            ("/v1/completions", {"prompt": "the cat", "max_tokens": 2}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ):
            reply = http.post(path, json=body)
            assert reply.status_code == 400, (path, reply.text)
            assert "serves embeddings (--is-embedding)" in reply.text, (path, reply.text)
