"""Several models behind one `radixflow serve` (runtime/desk/): SmolLM2 and tiny random
checkpoints of two other families under a memory cap that holds two of them, behind an API
key. By name through the official `openai` and `ollama` clients each model answers as it
does served alone (SmolLM2: the shared single-model server fed the same requests in the same
order; the tiny ones: transformers' greedy decoding); unknown names get each door's own 404;
keep_alive 0 unloads (the child exits); a third model evicts the least recently used idle
one; streams are unchanged while other models load and unload; a model past the cap is
refused; RuntimeEndpoint names a model, over HTTP and over the desk's ZeroMQ door (DSL
programs, streams, aborts, unknown names); SIGTERM stops every child."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import struct
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import ollama
import openai
import pytest
import torch
from family_models import save_family, tiny_tokenizer

import radixflow as sgl
from conftest import emptied, start_server
from radixflow import RuntimeEndpoint
from radixflow.backend import RuntimeEndpointError

KEY = "desk-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
CAP = "2.5G"  # SmolLM2 with a 2,048-token pool needs 1.13 GiB, a tiny model 1.00 (the reserve)
QUESTIONS = ["What is the capital of France?", "Say hello in Spanish."]
TINY_PROMPTS = ["Hello", "The sea"]
NEW = 8
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def save_tiny(family: str, root: Path, name: str) -> SimpleNamespace:
    path, model = save_family(family, root, name)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return SimpleNamespace(path=path, model=model, tokenizer=tokenizer)


def save_too_big(root: Path, like: Path) -> Path:
    """A checkpoint whose header declares 4 GiB of fp32 weights (a sparse file: nothing is
    written), past any cap the tests set; it is never loaded, only planned and refused."""
    path = root / "big"
    path.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(like / name, path / name)
    size = 4 << 30
    header = json.dumps({"w": {"dtype": "F32", "shape": [size // 4], "data_offsets": [0, size]}})
    with (path / "model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(header)) + header.encode())
        f.truncate(8 + len(header) + size)
    return path


def greedy(tiny: SimpleNamespace, prompt: str, new: int = NEW) -> str:
    """transformers' greedy continuation of `prompt` by a tiny checkpoint: the text a server
    of that model alone answers."""
    ids = tiny.tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = tiny.model.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=256,
                                  pad_token_id=256)  # fmt: skip
    return tiny.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@pytest.fixture(scope="module")
def desk(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("desk")
    tiny = save_tiny("qwen3", root, "tiny")
    third = save_tiny("mistral", root, "third")
    big = save_too_big(root, tiny.path)
    models = f"chat=smollm2,tiny={tiny.path},third={third.path},big={big}"
    options = dict(max_total_tokens=2048, models_memory=CAP, api_key=KEY, log_level="info")
    with start_server(model_path=models, **options) as server:
        yield SimpleNamespace(
            url=server.url,
            address=server.address,
            process=server.process,
            tiny=tiny,
            third=third,
            openai=openai.OpenAI(
                base_url=f"{server.url}/v1", api_key=KEY, timeout=300, max_retries=0
            ),
            ollama=ollama.Client(host=server.url, headers=AUTH, timeout=300),
            http=httpx.Client(base_url=server.url, headers=AUTH, timeout=300),
        )


def loaded(desk: SimpleNamespace) -> dict[str, dict[str, Any]]:
    """/api/ps: the loaded models by name (without Ollama's :latest)."""
    reply = desk.http.get("/api/ps").raise_for_status().json()
    return {m["name"].removesuffix(":latest"): m for m in reply["models"]}


def metric(desk: SimpleNamespace, name: str, model: str | None = None) -> float:
    label = f'{{model="{model}"}}' if model else ""
    text = desk.http.get("/metrics").raise_for_status().text
    found = re.search(rf"^radixflow:{name}{re.escape(label)} (\S+)$", text, re.MULTILINE)
    assert found, f"{name}{label} not in /metrics"
    return float(found.group(1))


def gone(pid: int, within: float = 30.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def unloaded(desk: SimpleNamespace, name: str, within: float = 30.0) -> bool:
    """Whether the model is unloaded within `within` seconds: gone from /api/ps, and its
    server exited (a model stopping still counts against the cap)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        state = desk.http.get("/health").json()["models"][name]
        if state == "unloaded" and name not in loaded(desk):
            return True
        time.sleep(0.1)
    return False


def test_every_model_is_listed_and_none_is_loaded_yet(desk: SimpleNamespace) -> None:
    names = ["chat", "tiny", "third", "big"]
    assert [m.id for m in desk.openai.models.list().data] == names
    assert [m.model for m in desk.ollama.list().models] == [f"{n}:latest" for n in names]
    assert loaded(desk) == {}
    assert metric(desk, "desk_resident_models") == 0


def test_the_key_is_checked_at_the_desk(desk: SimpleNamespace) -> None:
    bare = httpx.Client(base_url=desk.url, timeout=30)
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
    assert bare.post("/v1/completions", json=body).status_code == 401
    assert bare.post("/api/generate", json={**body, "stream": False}).json()["error"]
    assert bare.get("/health").status_code == 200  # public, as the single server's
    assert loaded(desk) == {}  # a refused request loads nothing


def test_an_unknown_model_gets_each_doors_404(desk: SimpleNamespace) -> None:
    with pytest.raises(openai.NotFoundError) as error:
        desk.openai.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert error.value.body["code"] == "model_not_found"
    with pytest.raises(ollama.ResponseError) as ollama_error:
        desk.ollama.chat(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert ollama_error.value.status_code == 404
    assert ollama_error.value.error == "model 'nope' not found"
    anthropic = desk.http.post(
        "/v1/messages", json={"model": "nope", "max_tokens": 2, "messages": []}
    )
    assert anthropic.status_code == 404
    assert anthropic.json()["error"]["type"] == "not_found_error"
    infill = desk.http.post("/infill", json={"model": "nope", "input_prefix": "a"})
    assert infill.status_code == 404 and infill.json()["error"]["code"] == 404
    native = desk.http.post("/generate", json={"model": "nope", "text": "a"})
    assert native.status_code == 404 and native.json()["error"]["code"] == "model_not_found"
    assert loaded(desk) == {}


def test_two_models_answer_by_name_as_each_alone(desk: SimpleNamespace, shared_server) -> None:
    desk.http.post("/flush_cache", params={"model": "chat"})  # loads it; an empty tree
    answers = []
    for question, prompt in zip(QUESTIONS, TINY_PROMPTS):
        messages = [{"role": "user", "content": question}]
        reply = desk.openai.chat.completions.create(
            model="chat", messages=messages, max_tokens=NEW, temperature=0
        )
        answers.append(("openai chat", reply.choices[0].message.content))
        tiny = desk.openai.completions.create(
            model="tiny", prompt=prompt, max_tokens=NEW, temperature=0
        )
        assert tiny.choices[0].text == greedy(desk.tiny, prompt)
        assert tiny.model == "tiny"
        options = {"temperature": 0, "num_predict": NEW}
        chat = desk.ollama.chat(model="chat", messages=messages, options=options)
        answers.append(("ollama chat", chat.message.content))
        raw = desk.ollama.generate(model="tiny", prompt=prompt, raw=True, options=options)
        assert raw.response == greedy(desk.tiny, prompt)
    # SmolLM2 served alone, fed the same requests in the same order from an empty tree
    alone = emptied(shared_server)
    client = openai.OpenAI(base_url=f"{alone.url}/v1", api_key="none", timeout=300)
    ollama_alone = ollama.Client(host=alone.url, timeout=300)
    expected = []
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        reply = client.chat.completions.create(
            model="default", messages=messages, max_tokens=NEW, temperature=0
        )
        expected.append(("openai chat", reply.choices[0].message.content))
        chat = ollama_alone.chat(
            model="smollm2", messages=messages, options={"temperature": 0, "num_predict": NEW}
        )
        expected.append(("ollama chat", chat.message.content))
    assert answers == expected
    assert sorted(loaded(desk)) == ["chat", "tiny"]
    assert metric(desk, "desk_loads_total", "chat") == 1  # loaded once, kept between requests


@sgl.function
def complete(s: Any, prompt: str) -> None:
    s += prompt + sgl.gen("out", max_tokens=NEW, temperature=0)


def zmq_endpoint(desk: SimpleNamespace, model: str, **kwargs: Any) -> RuntimeEndpoint:
    return RuntimeEndpoint(desk.address, api_key=KEY, model=model, **{"timeout": 300, **kwargs})


def test_zeromq_programs_run_on_the_model_they_name(desk: SimpleNamespace) -> None:
    """The desk's ready line has a ZeroMQ address; a DSL program over it runs on the model
    its endpoint names and answers as the HTTP door does (both models already loaded)."""
    assert desk.address.startswith("tcp://127.0.0.1:")
    for name, prompt in (("chat", QUESTIONS[0]), ("tiny", TINY_PROMPTS[0])):
        endpoint = zmq_endpoint(desk, name)
        try:
            out = complete.run(prompt=prompt, backend=endpoint)["out"]
            assert endpoint.model_info()["model"] == name
        finally:
            endpoint.close()
        body = {"model": name, "text": prompt,
                "sampling_params": {"max_new_tokens": NEW, "temperature": 0}}  # fmt: skip
        assert out == desk.http.post("/generate", json=body).raise_for_status().json()["text"]
        if name == "tiny":
            assert out == greedy(desk.tiny, prompt)
    assert metric(desk, "desk_loads_total", "chat") == 1  # the loaded models served it


def test_zeromq_streams_count_and_abort_through_the_desk(desk: SimpleNamespace) -> None:
    """A stream over ZeroMQ comes chunk by chunk, counted as a request on its model while it
    runs; an abort reaches the model's server, and the aborted stream ends there."""
    endpoint = zmq_endpoint(desk, "tiny")
    greedy_params = {"max_new_tokens": 24, "temperature": 0}
    try:
        chunks, active = [], []
        for chunk in endpoint.generate_stream("Once upon a time", greedy_params):
            active.append(loaded(desk)["tiny"]["active_requests"])
            chunks.append(chunk)
        assert len(chunks) > 2 and chunks[-1]["finished"]
        assert chunks[-1]["text"] == greedy(desk.tiny, "Once upon a time", 24)
        assert active[0] == 1 and loaded(desk)["tiny"]["active_requests"] == 0
        params = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
        stream = endpoint.generate_stream("Once", params, rid="desk-zmq-abort")
        next(stream)
        assert endpoint.abort("desk-zmq-abort"), "the abort did not reach the model's server"
        last = list(stream)[-1]
        assert last["finished"] and last["meta_info"]["finish_reason"]["type"] == "abort"
        assert loaded(desk)["tiny"]["active_requests"] == 0
    finally:
        endpoint.close()


def test_zeromq_refuses_unknown_models_and_wrong_keys(desk: SimpleNamespace) -> None:
    """An unknown name gets the protocol's error reply at once, not a hang; a wrong key is
    refused at the desk; neither loads anything."""
    before = sorted(loaded(desk))
    endpoint = zmq_endpoint(desk, "nope", timeout=10)
    try:
        with pytest.raises(RuntimeEndpointError) as error:
            endpoint.generate("Hello", {"max_new_tokens": 2})
        assert error.value.code == "invalid_request" and "'nope'" in str(error.value)
    finally:
        endpoint.close()
    wrong = RuntimeEndpoint(desk.address, api_key="wrong", model="tiny", timeout=10)
    try:
        with pytest.raises(RuntimeEndpointError) as refused:
            wrong.model_info()
        assert refused.value.code == "unauthorized"
    finally:
        wrong.close()
    assert sorted(loaded(desk)) == before


def test_a_single_server_takes_only_its_own_model_name(shared_server) -> None:
    """Over ZeroMQ a single server answers a request naming its own model, and one naming
    another with the protocol's error reply."""
    own = shared_server.endpoint.model_info()["model"]
    for name in (own, "default", None):
        endpoint = RuntimeEndpoint(shared_server.address, model=name, timeout=60)
        try:
            assert endpoint.model_info()["model"] == own
        finally:
            endpoint.close()
    endpoint = RuntimeEndpoint(shared_server.address, model="nope", timeout=10)
    try:
        with pytest.raises(RuntimeEndpointError) as error:
            endpoint.generate("Hello", {"max_new_tokens": 2})
        assert error.value.code == "invalid_request" and "'nope'" in str(error.value)
    finally:
        endpoint.close()


def test_a_third_model_evicts_the_least_recently_used(desk: SimpleNamespace) -> None:
    for name in ("chat", "tiny"):  # chat used least recently
        desk.ollama.generate(model=name, prompt="a", raw=True, options={"num_predict": 1})
    assert sorted(loaded(desk)) == ["chat", "tiny"]  # two fit under the cap, not three
    chat_pid = loaded(desk)["chat"]["pid"]
    reply = desk.openai.completions.create(
        model="third", prompt="Hello", max_tokens=NEW, temperature=0
    )
    assert reply.choices[0].text == greedy(desk.third, "Hello")
    assert sorted(loaded(desk)) == ["third", "tiny"]  # chat was used least recently
    assert gone(chat_pid)
    assert metric(desk, "desk_evictions_total", "chat") == 1
    assert metric(desk, "desk_evictions_total", "tiny") == 0


def test_keep_alive_zero_unloads_the_model(desk: SimpleNamespace) -> None:
    pid = loaded(desk)["third"]["pid"]
    resident = metric(desk, "desk_resident_bytes")
    reply = desk.ollama.generate(
        model="third", prompt="Hello", raw=True, keep_alive=0,
        options={"temperature": 0, "num_predict": NEW},
    )  # fmt: skip
    assert reply.response == greedy(desk.third, "Hello")  # answered, then unloaded
    assert unloaded(desk, "third")
    assert gone(pid), "the unloaded model's server process still runs"
    assert metric(desk, "desk_resident_bytes") < resident
    assert metric(desk, "desk_unloads_total", "third") == 1
    assert sorted(loaded(desk)) == ["tiny"]  # the other one stays (keep-alive 5m)


def stream_tiny(desk: SimpleNamespace, prompt: str, new: int, started: threading.Event) -> str:
    """An SSE completion from tiny, read event by event; `started` is set after the first."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": new, "temperature": 0,
            "stream": True}  # fmt: skip
    text, done = "", False
    with desk.http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            text += json.loads(line[6:])["choices"][0]["text"]
            started.set()
    assert done, "the stream ended without [DONE]"
    return text


@pytest.mark.slow  # a third model start (~10 s on a quiet machine)
def test_streams_are_unchanged_while_another_model_loads_and_unloads(
    desk: SimpleNamespace,
) -> None:
    """tiny streams while third loads, then while third unloads; each stream is whole and
    equal to tiny's greedy text."""
    assert sorted(loaded(desk)) == ["tiny"]
    prompt, new = "Once upon a time", 160
    expected = greedy(desk.tiny, prompt, new)
    started, load_done = threading.Event(), threading.Event()

    def load_third() -> None:
        desk.ollama.generate(model="third", keep_alive="5m")  # Ollama's load call: no prompt
        load_done.set()

    loader = threading.Thread(target=load_third)
    loader.start()
    while desk.http.get("/health").json()["models"]["third"] != "loading":
        time.sleep(0.05)
    assert stream_tiny(desk, prompt, new, started) == expected
    assert not load_done.is_set(), "third loaded before the stream ended: nothing overlapped"
    loader.join(300)
    assert sorted(loaded(desk)) == ["third", "tiny"]
    third_pid = loaded(desk)["third"]["pid"]
    started.clear()
    unloader = threading.Thread(
        target=lambda: (started.wait(60), desk.ollama.generate(model="third", keep_alive=0))
    )
    unloader.start()
    assert stream_tiny(desk, prompt, new, started) == expected
    unloader.join(120)
    assert unloaded(desk, "third") and gone(third_pid)
    assert sorted(loaded(desk)) == ["tiny"]
    resident = sum(m["size"] for m in loaded(desk).values())
    assert metric(desk, "desk_resident_bytes") == resident  # nothing left counted


def test_a_model_past_the_cap_is_refused(desk: SimpleNamespace) -> None:
    before = loaded(desk)
    with pytest.raises(openai.InternalServerError) as error:
        desk.openai.completions.create(model="big", prompt="a", max_tokens=1)
    assert "cannot fit even alone" in error.value.message
    with pytest.raises(ollama.ResponseError) as ollama_error:
        desk.ollama.generate(model="big", prompt="a")
    assert "cannot fit even alone" in ollama_error.value.error
    assert metric(desk, "desk_refused_total", "big") == 2
    assert loaded(desk).keys() == before.keys()  # nothing was evicted for it


def test_runtime_endpoint_names_a_model(desk: SimpleNamespace) -> None:
    endpoint = RuntimeEndpoint(desk.url, api_key=KEY, model="tiny", timeout=300)
    try:
        out = endpoint.generate("Hello", {"max_new_tokens": NEW, "temperature": 0})
        assert out["text"] == greedy(desk.tiny, "Hello")
        assert endpoint.model_info()["model"] == "tiny"
    finally:
        endpoint.close()


def test_sigterm_stops_every_model(desk: SimpleNamespace) -> None:
    pids = [m["pid"] for m in loaded(desk).values()]
    assert pids
    desk.process.send_signal(signal.SIGTERM)
    assert desk.process.wait(120) == 0
    assert all(gone(pid, 5) for pid in pids)
