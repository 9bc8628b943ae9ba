"""LoRA adapters end to end: logits against PEFT's model with the adapter applied (alone, and
one ragged batch mixing three adapters and the base model, prefill and decode rows), the
radix tree kept apart per adapter, --max-loras-per-batch, and the server's routes (load,
unload, per-request selection by lora_path and by OpenAI model name, refusals)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from family_models import VOCAB, one_thread, save_family
from gguf_models import build_model, write_gguf
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from conftest import start_server
from radixflow import RuntimeEndpoint
from radixflow.runtime.cache.kv_pool import KVPool
from radixflow.runtime.cache.radix_cache import TOKEN_MASK
from radixflow.runtime.cache.tiered import on_disk
from radixflow.runtime.cli import build_parser
from radixflow.runtime.config import ServerConfig
from radixflow.runtime.config.checks import lora_adapters
from radixflow.runtime.config.cli import config_from_args
from radixflow.runtime.model_executor.model_runner import load_model
from radixflow.runtime.models.layers import CausalLM, ForwardBatch
from radixflow.runtime.models.loader import resolve_model_dir
from radixflow.runtime.models.lora import LoraError, LoraStore, load_adapter
from radixflow.runtime.models.quantized import quant_layers
from radixflow.runtime.protocol.plan import StepResult
from radixflow.runtime.protocol.sampling import SamplingParams
from radixflow.runtime.scheduler.lora_table import LoraTable
from radixflow.runtime.scheduler.request import Req
from radixflow.runtime.scheduler.scheduler import Scheduler

TOLERANCE = 1e-4
SPLIT = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # Phi-3's own modules
# (name, rank, lora_alpha, rslora, target modules); the last targets attention only
ADAPTERS = [("a", 4, 8, False, None), ("b", 8, 4, True, None), ("c", 2, 2, False, "attn")]


def _ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, size=n).tolist()


def _t(values: Any) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int64)


def save_adapter(
    hf_model: Any, root: Path, spec: tuple, fused: bool, b_std: float = 0.2
) -> tuple[Path, Any]:
    """A random PEFT adapter (B drawn too, so it changes the logits) saved under root/name;
    -> (its directory, PEFT's model with it applied)."""
    name, rank, alpha, rslora, only = spec
    targets = FUSED if fused else SPLIT
    if only == "attn":
        targets = [t for t in targets if t in ("q_proj", "v_proj", "qkv_proj", "o_proj")]
    torch.manual_seed(sum(map(ord, name)))
    config = LoraConfig(
        r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=targets,
        init_lora_weights=False,
    )  # fmt: skip
    peft_model = get_peft_model(copy.deepcopy(hf_model), config).eval()
    with torch.no_grad():  # PEFT's default B init is small; larger deltas show more
        for param_name, param in peft_model.named_parameters():
            if "lora_B" in param_name:
                param.normal_(0.0, b_std)
    peft_model.save_pretrained(root / name)
    return root / name, peft_model


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, Any]:
    """family -> (checkpoint, transformers model, {adapter: (dir, PEFT model)})."""
    root = tmp_path_factory.mktemp("lora")
    out = {}
    with one_thread():
        for family in ("llama", "qwen2", "phi3"):
            path, hf_model = save_family(family, root)
            adapters = {
                spec[0]: save_adapter(hf_model, root / family, spec, family == "phi3")
                for spec in ADAPTERS
            }
            out[family] = (path, hf_model, adapters)
    return out


def two_steps(model: CausalLM, store: LoraStore, seqs: list[list[int]], ids: list[int]):
    """Every sequence but its last token prefilled in one ragged step, then each last token
    decoded in a second; row i runs under adapter id ids[i] (0: base). -> per sequence its
    logits at every position (len, vocab)."""
    cfg = model.config
    k = torch.zeros(cfg.num_layers, 512, cfg.num_kv_heads, cfg.head_dim)
    v = torch.zeros_like(k)
    heads = [s[:-1] for s in seqs]
    lens = [len(h) for h in heads]
    starts = np.concatenate([[1], 1 + np.cumsum(lens)])  # slot 0 is the pad slot
    slots = [list(range(starts[i], starts[i] + n)) for i, n in enumerate(lens)]
    total, qo = sum(lens), np.concatenate([[0], np.cumsum(lens)])
    rows = np.repeat(ids, lens)
    prefill = ForwardBatch(
        _t(sum(heads, [])), _t(np.concatenate([np.arange(n) for n in lens])),
        _t(sum(slots, [])), total, _t(qo), _t([0] * (len(seqs) + 1)), _t([]), _t([0]),
        _t([]), _t(np.arange(total)),
    )  # fmt: skip
    prefill.lora = store.batch(np.asarray(rows, dtype=np.int64))
    first = model(prefill, k, v)  # (total, vocab)
    new = [int(starts[-1]) + i for i in range(len(seqs))]
    decode = ForwardBatch(
        _t([s[-1] for s in seqs]), _t(lens), _t(new), 0, _t([0]), _t([0]), _t([]),
        _t(np.concatenate([[0], np.cumsum([n + 1 for n in lens])])),
        _t(sum([s + [d] for s, d in zip(slots, new)], [])), _t(np.arange(len(seqs))),
    )  # fmt: skip
    decode.lora = store.batch(np.asarray(ids, dtype=np.int64))
    last = model(decode, k, v)  # (B, vocab)
    return [torch.cat([first[qo[i] : qo[i + 1]], last[i : i + 1]]) for i in range(len(seqs))]


def _reference(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]  # (L, vocab)


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3"])
def test_logits_match_peft_alone_and_mixed(families, family):
    """Each adapter alone, then one batch of the three adapters and the base model (adapter
    "a" on two sequences that are not adjacent, so its rows are gathered), prefill and
    decode rows: every logit within TOLERANCE of PEFT's."""
    path, hf_model, adapters = families[family]
    with one_thread():
        model = load_model(path, ServerConfig(), torch.device("cpu"), torch.float32)
        store = LoraStore(model.config)
        for uid, name in enumerate(adapters, 1):
            store.load(uid, name, str(adapters[name][0]))
        refs = [hf_model] + [adapters[name][1] for name in adapters]
        for uid in (1, 2, 3):  # alone
            (ours,) = two_steps(model, store, [_ids(uid, 20)], [uid])
            err = (ours - _reference(refs[uid], _ids(uid, 20))).abs().max().item()
            assert err < TOLERANCE, f"{family} adapter {uid} alone: {err}"
        seqs = [_ids(10 + i, 9 + 4 * i) for i in range(5)]
        ids = [1, 0, 1, 2, 3]
        for i, ours in enumerate(two_steps(model, store, seqs, ids)):
            err = (ours - _reference(refs[ids[i]], seqs[i])).abs().max().item()
            assert err < TOLERANCE, f"{family} mixed row {i} (adapter {ids[i]}): {err}"
        base = _reference(hf_model, seqs[0])
        assert (_reference(refs[1], seqs[0]) - base).abs().max() > 0.1, "adapter changes nothing"


def test_lora_on_a_gguf_base_kept_quantized(tmp_path):
    """LoRA on top of quantized projections: a Q8_0 GGUF of the tiny Llama (its matrices
    kept in blocks, fp32 activations) with an adapter gives the logits of the same file
    dequantized to fp32 with the adapter (the path checked against PEFT above), within 1e-4
    of the largest logit, beside a base row; the adapter moves them far more than that."""
    source = build_model("llama")
    write_gguf(tmp_path / "llama.gguf", source, "Q8_0")
    # a milder adapter: a strong one amplifies the base's own quantized-vs-fp32 rounding
    adapter_dir, _ = save_adapter(source, tmp_path, ADAPTERS[0], fused=False, b_std=0.05)
    seqs = [_ids(70, 20), _ids(71, 15)]
    logits = []
    with one_thread():
        model_dir = resolve_model_dir(str(tmp_path / "llama.gguf"))
        for dequantize in (False, True):
            config = ServerConfig(quantized_activations="fp32", dequantize_weights=dequantize)
            model = load_model(model_dir, config, torch.device("cpu"), torch.float32)
            assert bool(quant_layers(model)) != dequantize, "kept quantized or not, as asked"
            store = LoraStore(model.config)
            store.load(1, "a", str(adapter_dir))
            logits.append(two_steps(model, store, seqs + seqs[:1], [1, 0, 0]))
    (quantized, base, plain), (want, want_base, _) = logits
    for got, ref in [(quantized, want), (base, want_base)]:
        err = (got - ref).abs().max().item()
        assert err <= TOLERANCE * ref.abs().max().item(), f"GGUF base: {err}"
    assert (quantized - plain).abs().max() > 0.1, "the adapter changes nothing"


def _corrupt(src: Path, dst: Path, change: str) -> Path:
    dst.mkdir()
    config = json.loads((src / "adapter_config.json").read_text())
    weights = load_file(str(src / "adapter_model.safetensors"))
    if change == "dora":
        config["use_dora"] = True
    elif change == "config":
        (dst / "adapter_config.json").write_text("{not json")
        save_file(weights, str(dst / "adapter_model.safetensors"))
        return dst
    elif change == "shape":
        key = next(k for k in weights if "q_proj.lora_B" in k)
        weights[key] = torch.zeros(weights[key].shape[0] + 1, weights[key].shape[1])
    elif change == "embed":
        weights["base_model.model.model.embed_tokens.lora_A.weight"] = torch.zeros(4, 272)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    if change != "missing":
        save_file(weights, str(dst / "adapter_model.safetensors"))
    return dst


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("missing", "no adapter_model.safetensors"),
        ("config", "not valid JSON"),
        ("dora", "unsupported options ['use_dora']"),
        ("shape", "do not fit"),
        ("embed", "unsupported weight"),
    ],
)
def test_bad_adapter_is_refused_at_load(families, tmp_path, change, message):
    path, hf_model, adapters = families["llama"]
    model_config = load_model(path, ServerConfig(), torch.device("cpu"), torch.float32).config
    bad = _corrupt(adapters["a"][0], tmp_path / change, change)
    with pytest.raises(LoraError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_adapter(str(bad), "bad", model_config)
    with pytest.raises(LoraError, match="exceeds --max-lora-rank 2"):
        load_adapter(str(adapters["a"][0]), "a", model_config, max_rank=2)


def test_max_loras_per_batch_holds_back_other_adapters():
    """With 2 adapters a step: requests under a third wait; the base model never does."""
    table = LoraTable(max_per_batch=2)
    loras = [1, 0, 2, 3, 1, 0]
    reqs = [Req(f"r{i}", [1, 2], SamplingParams(), lora=lora) for i, lora in enumerate(loras)]
    running = [Req("run", [1], SamplingParams(), lora=2)]
    admitted = [r.rid for r in table.admissible(reqs, running, None)]
    assert admitted == ["r0", "r1", "r2", "r4", "r5"]  # r3 (a third adapter) waits
    chunked = Req("c", [1], SamplingParams(), lora=3)  # the chunked request's adapter counts
    admitted = [r.rid for r in table.admissible(reqs, [], chunked)]
    assert admitted == ["r0", "r1", "r3", "r4", "r5"]


def test_unload_is_refused_while_a_request_runs_under_the_adapter():
    """Unloading an adapter a live request uses is refused (nothing it computes changes);
    once it is done the unload goes through, and the name is free for a new id."""

    class Runner:
        def __init__(self) -> None:
            self.loaded: dict[int, str] = {}

        def load_lora(self, uid: int, name: str, path: str) -> None:
            self.loaded[uid] = name

        def unload_lora(self, uid: int) -> None:
            del self.loaded[uid]

    runner, table = Runner(), LoraTable(max_per_batch=8)
    table.load("a", "/a", runner)
    live = [Req("r", [1], SamplingParams(), lora=table.id_of("a"))]
    with pytest.raises(ValueError, match="in use by 1 request"):
        table.unload("a", live, runner)
    assert table.id_of("a") == 1 and runner.loaded == {1: "a"}
    table.unload("a", [], runner)
    assert table.id_of("a") is None and runner.loaded == {}
    table.load("a", "/a", runner)  # reloaded: a new id, so a new namespace in the tree
    assert table.id_of("a") == 2
    with pytest.raises(ValueError, match="already loaded"):
        table.load("a", "/a", runner)


# ---- the server --------------------------------------------------------------------------

MAX_NEW = 8
CHAT = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the prompt as it is
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(families) -> Any:
    """A server on the tiny llama with adapters a and b from the start, 16-token prefill
    chunks; adapter c is loaded through the route by a test."""
    path, _, adapters = families["llama"]
    lora = [f"{name}={adapters[name][0]}" for name in ("a", "b")]
    options = dict(
        max_total_tokens=2048, chunked_prefill_size=16, log_level="warning", chat_template=CHAT
    )
    with start_server(model_path=str(path), lora_paths=lora, **options) as server:
        yield server


def _generate(url: str, **body: Any) -> httpx.Response:
    return httpx.post(url + "/generate", json={"sampling_params": GREEDY, **body}, timeout=120)


def _greedy(model: Any, ids: list[int], num: int = MAX_NEW) -> list[int]:
    out = list(ids)
    for _ in range(num):
        out.append(int(_reference(model, out)[-1].argmax()))
    return out[len(ids) :]


def _stats(url: str) -> dict[str, Any]:
    return httpx.get(url + "/server_info", timeout=30).json()["internal_states"][0]


def test_server_greedy_matches_peft_batched_across_adapters(families, served):
    """One /generate batch of prompts under a, b and the base (lora_path per prompt), each
    prompt longer than a prefill chunk: every reply is PEFT's greedy continuation."""
    _, hf_model, adapters = families["llama"]
    prompts = [_ids(30 + i, 20 + 3 * i) for i in range(3)]
    names = ["a", None, "b"]
    reply = _generate(served.url, input_ids=prompts, lora_path=names)
    assert reply.status_code == 200, reply.text
    models = [adapters["a"][1], hf_model, adapters["b"][1]]
    for ids, model, out in zip(prompts, models, reply.json()):
        assert out["output_ids"] == _greedy(model, ids)


def test_radix_cache_is_kept_apart_per_adapter(served):
    """The same prompt under a, then a again (its prefix is served from the cache), then b
    and the base (each computes the whole prompt again)."""
    ids = _ids(50, 40)
    runs = {}
    for label, name in [("a", "a"), ("a again", "a"), ("b", "b"), ("base", None)]:
        before = _stats(served.url)["prefill_tokens_computed"]
        out = _generate(served.url, input_ids=ids, lora_path=name).json()
        computed = _stats(served.url)["prefill_tokens_computed"] - before
        runs[label] = (out["meta_info"]["cached_tokens"], computed, out["output_ids"])
    assert runs["a"][:2] == (0, len(ids))
    assert runs["a again"][0] == len(ids) - 1 and runs["a again"][1] == 1
    assert runs["a again"][2] == runs["a"][2]
    assert runs["b"][:2] == (0, len(ids)) and runs["base"][:2] == (0, len(ids))
    assert runs["b"][2] != runs["a"][2] != runs["base"][2]


def test_load_use_and_unload_through_the_routes(families, served):
    """/load_lora_adapter, the adapter by OpenAI model name and in /v1/models, refusals
    (unknown name, duplicate, bad directory), /unload_lora_adapter."""
    _, hf_model, adapters = families["llama"]
    url = served.url
    post = lambda path, body: httpx.post(url + path, json=body, timeout=120)  # noqa: E731
    loaded = post("/load_lora_adapter", {"lora_name": "c", "lora_path": str(adapters["c"][0])})
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["success"] and set(loaded.json()["loaded_adapters"]) == {"a", "b", "c"}
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    cards = {card.id: card for card in client.models.list().data}
    base = next(name for name, card in cards.items() if name not in "abc")
    assert cards["c"].parent == base and cards["c"].root == str(adapters["c"][0])
    prompt = bytes(_ids(60, 12)).decode("latin-1")
    ids = served.get_tokenizer().encode(prompt, add_special_tokens=False)
    done = client.completions.create(
        model="c", prompt=ids, max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True}
    )
    assert done.model == base
    text = served.get_tokenizer().decode(_greedy(adapters["c"][1], ids), skip_special_tokens=True)
    assert done.choices[0].text == text
    again = post("/load_lora_adapter", {"lora_name": "c", "lora_path": str(adapters["c"][0])})
    assert again.status_code == 400 and "already loaded" in again.json()["error_message"]
    missing = post("/load_lora_adapter", {"lora_name": "d", "lora_path": "/no/such/dir"})
    assert (
        missing.status_code == 400 and "no adapter_config.json" in missing.json()["error_message"]
    )
    unloaded = post("/unload_lora_adapter", {"lora_name": "c"})
    assert unloaded.status_code == 200 and set(unloaded.json()["loaded_adapters"]) == {"a", "b"}
    gone = _generate(url, input_ids=ids, lora_path="c")
    # refused by the server before it reaches the scheduler (which also refuses, unnamed)
    assert gone.status_code == 400 and "named 'c' is loaded (loaded: ['a', 'b'])" in gone.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="c", prompt=ids, max_tokens=1)
    assert post("/unload_lora_adapter", {"lora_name": "c"}).status_code == 400


def test_load_and_unload_while_a_request_streams(families, served):
    """An adapter loaded and unloaded while a request under another streams: the streamed
    tokens are still PEFT's greedy continuation under its own adapter."""
    _, _, adapters = families["llama"]
    ids, params = _ids(80, 12), {**GREEDY, "max_new_tokens": 40}
    body = {"input_ids": ids, "lora_path": "b", "sampling_params": params, "stream": True}
    load = {"lora_name": "e", "lora_path": str(adapters["c"][0])}
    events = []
    with httpx.stream("POST", served.url + "/generate", json=body, timeout=120) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            events.append(json.loads(line.removeprefix("data: ")))
            if len(events) == 1:  # mid-stream: load, then unload, another adapter
                for path, sent in [("/load_lora_adapter", load), ("/unload_lora_adapter", load)]:
                    done = httpx.post(served.url + path, json=sent, timeout=120)
                    assert done.status_code == 200, done.text
    assert len(events) > 2 and events[-1]["output_ids"] == _greedy(adapters["b"][1], ids, 40)


def test_only_the_base_models_kv_goes_to_the_disk_tier():
    """Adapter ids are not stable across restarts: a key under an adapter never reaches the
    disk tier (runtime/cache/tiered.py), the base model's keys do."""
    base, adapter = (Req("r", [5, 6, 7], SamplingParams(), lora=lora) for lora in (0, 2))
    assert on_disk(base.cache_key()) and not on_disk(adapter.cache_key())
    assert (adapter.cache_key() & TOKEN_MASK).tolist() == [5, 6, 7]


def test_lora_flags():
    """--lora-paths takes several after one flag and repeats; bad lists and tensor
    parallelism with adapters are refused at the command line."""
    argv = ["serve", "--lora-paths", "a=/x", "b=/y", "--lora-paths", "/z"]
    config = config_from_args(build_parser().parse_args(argv))
    assert lora_adapters(config) == {"a": "/x", "b": "/y", "/z": "/z"}
    for bad in (["a=/x", "a=/y"], ["=/x"], ["a="]):
        with pytest.raises(ValueError, match="names unique"):
            ServerConfig(lora_paths=bad)
    with pytest.raises(ValueError, match="--tp-size > 1 is not supported"):
        ServerConfig(lora_paths=["a=/x"], tp_size=2)


TEXT_OF = {  # a door's reply -> its text
    "/v1/chat/completions": lambda data: data["choices"][0]["message"]["content"],
    "/v1/messages": lambda data: data["content"][0]["text"],
    "/v1/responses": lambda data: data["output"][0]["content"][0]["text"],
}


def test_chat_doors_pick_the_adapter_by_model(families, served):
    """OpenAI chat, Anthropic Messages and OpenAI Responses bodies naming adapter b run under
    it: the same greedy text from each, PEFT's, not the base model's."""
    _, hf_model, adapters = families["llama"]
    prompt = bytes(_ids(90, 10)).decode("latin-1")
    ids = served.get_tokenizer().encode(prompt, add_special_tokens=False)
    text = served.get_tokenizer().decode(_greedy(adapters["b"][1], ids), skip_special_tokens=True)
    base = served.get_tokenizer().decode(_greedy(hf_model, ids), skip_special_tokens=True)
    assert text != base
    common = {"model": "b", "temperature": 0, "ignore_eos": True}
    message = [{"role": "user", "content": prompt}]
    bodies = {
        "/v1/chat/completions": {**common, "messages": message, "max_tokens": MAX_NEW},
        "/v1/messages": {**common, "messages": message, "max_tokens": MAX_NEW},
        "/v1/responses": {**common, "input": prompt, "max_output_tokens": MAX_NEW},
    }
    for path, body in bodies.items():
        reply = httpx.post(served.url + path, json=body, timeout=120)
        assert reply.status_code == 200, (path, reply.text)
        assert TEXT_OF[path](reply.json()) == text, path


def test_runtime_endpoint_picks_the_adapter_over_zeromq_and_http(families, served):
    """The frontend's RuntimeEndpoint sends `lora_path` on both transports."""
    _, _, adapters = families["llama"]
    ids = _ids(95, 11)
    want = _greedy(adapters["a"][1], ids)
    for address in (served.address, served.url):
        endpoint = RuntimeEndpoint(address, timeout=120)
        try:
            out = endpoint.generate(input_ids=ids, sampling_params=GREEDY, lora_path="a")
            assert out["output_ids"] == want, address
        finally:
            endpoint.close()


class RecordingRunner:
    """A model runner that samples token 1 and records each step's distinct adapters."""

    def __init__(self) -> None:
        self.adapters_per_step: list[set[int]] = []

    def forward(self, plan: Any) -> StepResult:
        self.adapters_per_step.append(set(plan.lora_ids.tolist()) - {0})
        count = len(plan.sample_rows)
        return StepResult([1] * count, [0.0] * count, np.zeros(len(plan.logit_rows)))

    def load_lora(self, uid: int, name: str, path: str) -> None:
        pass

    def unload_lora(self, uid: int) -> None:
        pass


def test_scheduler_steps_hold_at_most_max_loras_per_batch_adapters():
    """Requests under three adapters and the base, all waiting at once, with 2 adapters a
    step: no step holds more than 2, the third adapter's requests run once others end."""
    config = ServerConfig(max_total_tokens=4096, max_loras_per_batch=2, self_check=True)
    runner = RecordingRunner()
    scheduler = Scheduler(
        config, runner, KVPool(4096, 1), eos_token_ids=(0,), context_len=1000,
        vocab_size=VOCAB, decode=lambda ids: "",
    )  # fmt: skip
    for name in "xyz":
        scheduler.loras.load(name, f"/{name}", runner)
    params = SamplingParams(max_new_tokens=6, temperature=0)
    reqs = [
        Req(f"r{i}", _ids(i, 9), params, lora=scheduler.loras.id_of(name))
        for i, name in enumerate(["x", "", "y", "z", "x", "", "z"])
    ]
    for req in reqs:
        scheduler.add_request(req)
    while scheduler.has_work:
        scheduler.step()
    assert all(req.finished and len(req.output_ids) == 6 for req in reqs)
    assert max(map(len, runner.adapters_per_step)) == 2
    assert {1, 2, 3} == set().union(*runner.adapters_per_step)
