"""Embeddings and the tokenizer over HTTP against a live server: OpenAI's /v1/embeddings through
the official `openai` client, Ollama's /api/embed through the `ollama` client and its older
/api/embeddings, /tokenize and /detokenize; vectors equal the offline Engine's; bad inputs get
4xx in each door's shape and the server keeps serving with its KV all back."""

from __future__ import annotations

import base64
import time
from typing import Any

import httpx
import numpy as np
import ollama
import openai
import pytest

from conftest import Server

API_KEY = "embed-secret"
CONTEXT = 256  # a short context: a too-long input costs a few hundred tokens, not thousands
# the engine fixture's exact paths (fp32 KV and activations), so vectors compare to 1e-4
SERVER = dict(
    api_key=API_KEY, context_length=CONTEXT, kv_cache_dtype="fp32",
    quantized_activations="fp32", num_threads=1, log_level="warning",
)  # fmt: skip
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
TEXTS = ["Embeddings map text to vectors.", "The cat sat on the mat while it rained."]
LONG = "word " * (CONTEXT + 40)  # more tokens than the context holds
# (a, its paraphrase, an unrelated sentence): SmolLM2's last-token vectors put every
# paraphrase closer (cosine 0.95-0.98) than either sentence to the unrelated one (0.72-0.83)
TRIPLES = [
    ("The cat sat on the mat.", "A cat was sitting on the rug.",
     "Stock markets fell sharply on Monday."),
    ("How do I bake bread at home?", "What is a simple recipe for homemade bread?",
     "The spacecraft entered orbit around Mars."),
    ("I love playing football with my friends.",
     "Playing soccer with my pals is my favourite thing.",
     "The invoice is due at the end of the month."),
    ("The weather is very cold today.", "It is freezing outside this morning.",
     "Python lists can hold objects of any type."),
]  # fmt: skip


@pytest.fixture(scope="module")
def client(runtime: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=runtime.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(runtime: Server) -> httpx.Client:
    with httpx.Client(base_url=runtime.url, headers=HEADERS, timeout=60) as session:
        yield session


def vectors(response: Any) -> np.ndarray:
    return np.array([item.embedding for item in response.data])


def test_openai_embeddings_equal_the_engine_and_count_the_tokenizer(
    client: openai.OpenAI, engine: Any
) -> None:
    response = client.embeddings.create(model="smollm2", input=TEXTS)
    got = vectors(response)
    want = np.array([out["embedding"] for out in engine.encode(TEXTS)])
    assert got.shape == (2, 576) and [item.index for item in response.data] == [0, 1]
    assert np.abs(got - want).max() < 1e-4
    tokens = sum(len(engine.tokenizer.encode(t, add_special_tokens=False)) for t in TEXTS)
    assert response.usage.prompt_tokens == response.usage.total_tokens == tokens
    assert response.model == "smollm2"
    ids = [engine.tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    by_ids = vectors(client.embeddings.create(model="smollm2", input=ids))
    assert np.abs(by_ids - got).max() < 1e-5
    one = vectors(client.embeddings.create(model="smollm2", input=ids[1]))
    assert np.abs(one[0] - got[1]).max() < 1e-5


def test_base64_is_little_endian_float32(client: openai.OpenAI, http: httpx.Client) -> None:
    """The openai client asks for base64 by default and decodes it: it equals the floats."""
    body = {"model": "smollm2", "input": TEXTS[0], "encoding_format": "float"}
    floats = np.array(http.post("/v1/embeddings", json=body).json()["data"][0]["embedding"])
    raw = http.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.abs(decoded - floats).max() < 1e-6
    by_client = vectors(client.embeddings.create(model="smollm2", input=TEXTS[0]))[0]
    assert np.abs(by_client - floats).max() < 1e-6


def test_paraphrases_are_closer_than_unrelated_sentences(client: openai.OpenAI) -> None:
    texts = [t for triple in TRIPLES for t in triple]
    got = vectors(client.embeddings.create(model="smollm2", input=texts)).reshape(-1, 3, 576)
    for (a, b, c), triple in zip(got, TRIPLES):
        assert a @ b > max(a @ c, b @ c) + 0.05, triple


def test_ollama_embed_and_the_older_embeddings(runtime: Server, client: openai.OpenAI) -> None:
    want = vectors(client.embeddings.create(model="smollm2", input=TEXTS))
    ollama_client = ollama.Client(host=runtime.url, headers=HEADERS)
    out = ollama_client.embed(model="smollm2", input=TEXTS)
    assert np.abs(np.array(out.embeddings) - want).max() < 1e-5
    assert out.prompt_eval_count > 0 and out.total_duration > 0
    legacy = httpx.post(
        runtime.url + "/api/embeddings",
        json={"model": "smollm2:latest", "prompt": TEXTS[1]},
        headers=HEADERS,
    ).json()
    assert np.abs(np.array(legacy["embedding"]) - want[1]).max() < 1e-5
    # no input: Ollama's load request, answered with no embeddings
    assert ollama_client.embed(model="smollm2", input=[]).embeddings == []
    # truncate (the default) cuts to the context; truncate=false refuses
    cut = ollama_client.embed(model="smollm2", input=LONG)
    assert cut.prompt_eval_count == CONTEXT - 1 and len(cut.embeddings[0]) == 576
    with pytest.raises(ollama.ResponseError) as refused:
        ollama_client.embed(model="smollm2", input=LONG, truncate=False)
    assert refused.value.status_code == 400 and "context length" in refused.value.error


@pytest.mark.parametrize(
    "path, body, status, words",
    [
        ("/v1/embeddings", {"model": "smollm2", "input": 5}, 400, "input must be"),
        ("/v1/embeddings", {"model": "smollm2", "input": []}, 400, "input must be"),
        ("/v1/embeddings", {"model": "smollm2", "input": [[1, 2], "a"]}, 400, "input must be"),
        ("/v1/embeddings", {"input": "a", "dimensions": 8}, 400, "Matryoshka"),
        ("/v1/embeddings", {"input": "a", "encoding_format": "int8"}, 400, "encoding_format"),
        ("/v1/embeddings", {"model": "gpt-4", "input": "a"}, 404, "does not exist"),
        ("/v1/embeddings", {"input": [[1] * CONTEXT]}, 400, "context length"),
        ("/v1/embeddings", {"input": [[1, 10**9]]}, 400, "input_ids must lie"),
        ("/v1/embeddings", {"input": LONG}, 400, "context length"),
        ("/api/embed", {"model": "smollm2", "input": [1, 2]}, 400, "invalid input type"),
        ("/api/embed", {"model": "smollm2", "input": "a", "dimensions": 8}, 400, "Matryoshka"),
        ("/api/embed", {"model": "llama3", "input": "a"}, 404, "not found"),
        ("/api/embed", {"input": "a"}, 400, "model is required"),
        ("/api/embed", {"model": "smollm2", "input": "a", "truncate": "no"}, 400, "truncate"),
        ("/api/embeddings", {"model": "smollm2", "prompt": 3}, 400, "prompt must be"),
        ("/tokenize", {"prompt": 3}, 400, "a string or a list"),
        ("/detokenize", {"tokens": ["a"]}, 400, "token ids"),
        ("/detokenize", {"tokens": [10**9]}, 400, "token ids"),
    ],
)
def test_bad_inputs_get_4xx_in_the_door_shape(
    http: httpx.Client, path: str, body: dict[str, Any], status: int, words: str
) -> None:
    response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    if path.startswith("/api/"):
        assert isinstance(error, str) and words in error, error  # Ollama's {"error": "..."}
    else:
        assert words in error["message"], error  # OpenAI's {"error": {"message", ...}}


def test_openai_client_raises_its_error_types(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="Matryoshka"):
        client.embeddings.create(model="smollm2", input="a", dimensions=64)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="a")


def test_tokenize_and_detokenize(http: httpx.Client, engine: Any) -> None:
    tokenizer = engine.tokenizer
    text = "Hello, tokenizer!"
    out = http.post("/tokenize", json={"prompt": text}).json()
    assert out["tokens"] == tokenizer.encode(text, add_special_tokens=True)
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == CONTEXT
    plain = http.post("/tokenize", json={"text": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    batch = http.post("/tokenize", json={"prompt": [text, "two"]}).json()
    assert batch["tokens"][0] == out["tokens"] and batch["count"][1] == len(batch["tokens"][1])
    messages = [{"role": "user", "content": "Hi there"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    back = http.post("/detokenize", json={"tokens": plain["tokens"]}).json()
    assert back["prompt"] == back["text"] == text


def test_still_serving_and_every_slot_back(http: httpx.Client, client: openai.OpenAI) -> None:
    """Runs last: after every embedding above the server answers and, once the cache is
    flushed, every KV slot is free and the idle leak check passes."""
    assert len(vectors(client.embeddings.create(model="smollm2", input="still here"))[0]) == 576
    assert http.post("/flush_cache").status_code == 200
    deadline = time.monotonic() + 10  # the scheduler's idle stats follow its flush reply
    while True:
        state = http.get("/server_info").json()["internal_states"][0]
        if state["free_slots"] == state["total_slots"] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert state["free_slots"] == state["total_slots"], state
    assert state["idle_check"] == "ok", state
