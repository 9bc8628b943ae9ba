"""Finding models: GGUF files of non-Llama families, hub ids from a local Hugging Face
cache (never the network), clear errors for what we cannot serve, and the model knobs
(--model-path / --model, --revision, --served-model-name, --chat-template,
--context-length, --trust-remote-code)."""

from __future__ import annotations

import argparse
import json
import shutil

import gguf
import pytest
import torch
from family_models import one_thread, save_family, tiny_tokenizer
from safetensors.torch import load_file, save_file

from radixflow.runtime import Engine
from radixflow.runtime.config import ServerConfig
from radixflow.runtime.config.cli import add_config_arguments, config_from_args
from radixflow.runtime.models.loader import (
    ModelNotFoundError,
    UnsupportedModelError,
    model_fim_token_ids,
    resolve_model_dir,
)
from radixflow.runtime.models.weights import CheckpointError

GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
PARAMS = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A tiny Qwen2 checkpoint directory and its transformers model."""
    with one_thread():
        yield save_family("qwen2", tmp_path_factory.mktemp("loader"))


def _gguf_name(name: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if name in fixed:
        return fixed[name]
    _, _, index, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{index}.{GGUF_NAMES[module]}.{kind}"


def write_qwen2_gguf(path, model) -> None:
    """A Qwen2 GGUF as llama.cpp lays one out (f32 tensors, gpt2 byte-level vocabulary),
    written with the gguf package's writer."""
    import gguf

    c = model.config
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    tokenizer = tiny_tokenizer()
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_token_scores([0.0] * len(tokens))  # no merges: derived from the vocabulary
    writer.add_eos_token_id(tokenizer.eos_token_id)
    for name, tensor in model.named_parameters():  # a tied head once, as the embedding
        writer.add_tensor(_gguf_name(name), tensor.detach().float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_of_qwen2_is_converted_and_served(qwen2, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("RADIXFLOW_CACHE", str(tmp_path / "cache"))
    _, hf_model = qwen2
    gguf_path = tmp_path / "tiny-qwen2.gguf"
    write_qwen2_gguf(gguf_path, hf_model)
    model_dir = resolve_model_dir(str(gguf_path))
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == [
        "Qwen2ForCausalLM"
    ]
    assert resolve_model_dir(str(gguf_path)) == model_dir  # converted once, then cached
    reference = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    reference.generation_config.eos_token_id = None
    ids = list(range(40, 70))
    with torch.no_grad():
        want = reference.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    with Engine(model_path=str(gguf_path), device="cpu", max_total_tokens=256) as engine:
        assert engine.generate(input_ids=ids, sampling_params=PARAMS)["output_ids"] == (
            want[0, len(ids) :].tolist()
        )


def _fake_hub_cache(root, repo_id: str, source, commit: str = "0123abcd" * 5) -> None:
    """`source`'s files laid out as huggingface_hub writes its cache: blobs, a snapshot of
    symlinks to them, and refs/main naming the commit."""
    repo = root / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in source.iterdir():
        blob = repo / "blobs" / f"blob-{file.name}"
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(f"../../blobs/{blob.name}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_hub_id_served_from_local_cache_never_the_network(qwen2, tmp_path, monkeypatch):
    path, _ = qwen2
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _fake_hub_cache(tmp_path, "tiny-org/tiny-qwen2", path)
    snapshot = resolve_model_dir("tiny-org/tiny-qwen2")
    assert snapshot.parent.name == "snapshots" and (snapshot / "config.json").is_file()
    assert resolve_model_dir("tiny-org/tiny-qwen2", revision="0123abcd" * 5) == snapshot
    with Engine(model_path="tiny-org/tiny-qwen2", device="cpu", max_total_tokens=256) as engine:
        from_dir = engine.with_config()  # same weights
        out = engine.generate(input_ids=[1, 2, 3], sampling_params=PARAMS)
        assert len(out["output_ids"]) == 16
        from_dir.shutdown()
    with pytest.raises(ModelNotFoundError, match="revision 'v2'"):
        resolve_model_dir("tiny-org/tiny-qwen2", revision="v2")


def test_hub_id_with_empty_cache_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_dir("Qwen/Qwen2.5-0.5B-Instruct")
    message = str(info.value)
    assert str(tmp_path / "empty" / "models--Qwen--Qwen2.5-0.5B-Instruct") in message
    assert "never downloads" in message and "HF_HOME" in message


def test_unsupported_architecture_lists_supported(qwen2, tmp_path):
    path, _ = qwen2
    shutil.copytree(path, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="FalconForCausalLM.*Gemma3ForCausalLM"):
        resolve_model_dir(str(tmp_path / "m"))


@pytest.mark.parametrize("change", ["drop", "extra"])
def test_missing_or_unexpected_weights_are_named(qwen2, tmp_path, change):
    path, _ = qwen2
    shutil.copytree(path, tmp_path / "m")
    file = tmp_path / "m" / "model.safetensors"
    state = load_file(str(file))
    if change == "drop":
        del state["model.layers.1.self_attn.k_proj.bias"]
        match = r"missing 1 weight\(s\) \['model.layers.1.self_attn.q_proj.bias \+ "
    else:
        state["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
        match = r"unexpected 1 weight\(s\) \['model.layers.0.mlp.extra.weight'\]"
    save_file(state, str(file))
    with pytest.raises(CheckpointError, match=match):
        Engine(model_path=str(tmp_path / "m"), device="cpu", max_total_tokens=256)


def test_model_knobs(qwen2, tmp_path):
    path, _ = qwen2
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    assert config_from_args(parser.parse_args(["--model", "x"])).model_path == "x"
    assert config_from_args(parser.parse_args(["--model-path", "y"])).model_path == "y"
    with pytest.raises(ValueError, match="never runs model code"):
        ServerConfig(trust_remote_code=True)
    with pytest.raises(ValueError, match="dtype"):
        ServerConfig(dtype="int8")
    template_file = tmp_path / "t.jinja"
    template_file.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    with Engine(
        model=str(path), device="cpu", dtype="bfloat16", max_total_tokens=256,
        served_model_name="tiny", chat_template=str(template_file), context_length=100,
    ) as engine:  # fmt: skip
        info = engine.model_info
        assert info["model"] == "tiny" and info["context_length"] == 100
        assert info["dtype"] == "bfloat16"
        assert (
            engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}], tokenize=False
            )
            == "[hi]"
        )
    with pytest.raises(ValueError, match="exceeds the model's 256"):
        Engine(model=str(path), device="cpu", max_total_tokens=256, context_length=1000)
    with pytest.raises(ValueError, match="neither a file nor a Jinja"):
        Engine(model=str(path), device="cpu", max_total_tokens=256, chat_template="nope.txt")


def test_sharded_checkpoint_reads_only_its_index(qwen2, tmp_path):
    """A checkpoint sharded by its index, beside another format's file (as Mistral's
    repositories ship consolidated.safetensors): only the indexed shards are read."""
    path, hf_model = qwen2
    hf_model.save_pretrained(tmp_path / "m", max_shard_size="100KB")
    shutil.copy(path / "tokenizer.json", tmp_path / "m")
    shutil.copy(path / "tokenizer_config.json", tmp_path / "m")
    assert len(list((tmp_path / "m").glob("model-*.safetensors"))) > 1
    save_file(
        {"layers.0.attention.wq.weight": torch.zeros(2)},
        tmp_path / "m" / "consolidated.safetensors",
    )
    with Engine(model=str(tmp_path / "m"), device="cpu", max_total_tokens=256) as engine:
        with Engine(model=str(path), device="cpu", max_total_tokens=256) as whole:
            ids = list(range(50, 80))
            assert (
                engine.generate(input_ids=ids, sampling_params=PARAMS)["output_ids"]
                == (whole.generate(input_ids=ids, sampling_params=PARAMS)["output_ids"])
            )


def test_fim_token_ids_come_from_llama_cpps_gguf_keys(tmp_path) -> None:
    """`tokenizer.ggml.fim_<role>_token_id` (llama.cpp's keys) by role; none: {}."""
    path = tmp_path / "fim.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    named = {"pre": 7, "suf": 9, "mid": 8, "sep": 12}
    for role, token in named.items():
        writer.add_uint32(f"tokenizer.ggml.fim_{role}_token_id", token)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tmp_path / "gguf.json").write_text(json.dumps({"path": str(path)}))
    assert model_fim_token_ids(tmp_path) == named
    assert model_fim_token_ids(tmp_path / "nowhere") == {}  # a Hugging Face directory


def test_rope_rows_are_put_back_as_they_are_read(tmp_path) -> None:
    """A llama q or k matrix's rows land in the model's order as `_pread` reads them: the
    same bytes as undoing llama.cpp's permutation after the read (row (h, i, p) of the file
    is row (h, p, i)), over more rows than one preadv takes (IOV_MAX); a file that ends
    inside the tensor is refused with its name."""
    import numpy as np  # noqa: PLC0415

    from radixflow.runtime.models import gguf_file  # noqa: PLC0415

    heads, rows, width = 4, 2 * gguf_file.IOV_MAX + 8, 34  # Q8_0 rows of 32 values
    data = np.random.default_rng(0).integers(0, 256, (rows, width), dtype=np.uint8)
    path = tmp_path / "rows.bin"
    path.write_bytes(b"\0" * 100 + data.tobytes())
    tensor = gguf_file.TensorInfo(
        "blk.0.attn_q.weight", (32, rows), int(gguf.GGMLQuantizationType.Q8_0), 100
    )
    half = rows // heads // 2
    expected = data.reshape(heads, half, 2, width).swapaxes(1, 2).reshape(rows, width)
    with path.open("rb") as f:
        got = gguf_file._pread(f.fileno(), tensor, path, heads).reshape(rows, width)
        assert np.array_equal(got, expected) and not np.array_equal(got, data)
        plain = gguf_file._pread(f.fileno(), tensor, path).reshape(rows, width)
        assert np.array_equal(plain, data)
    path.write_bytes(b"\0" * 100 + data.tobytes()[:-5])
    with path.open("rb") as f, pytest.raises(ValueError, match="attn_q.weight is cut short"):
        gguf_file._pread(f.fileno(), tensor, path, heads)
