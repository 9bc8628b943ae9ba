"""Fill-in-the-middle: each coder family's prompt layout against its documented template, on
byte-level tokenizers that carry the family's FIM tokens as single tokens (as the real ones
do); then the three doors that take an insert (OpenAI's `suffix` through the official client,
llama.cpp's `/infill` whole and streamed, Ollama's /api/generate `suffix`) on a tiny random
Llama checkpoint with Qwen2.5-Coder's tokens, and the 400 each door gives a model without FIM
tokens (SmolLM2: it has `<repo_name>` and `<file_sep>` but no `<fim_prefix>`).

Templates, as their sources write them (docs/http.md cites them):
- Qwen2.5-Coder (its README): <|fim_prefix|>P<|fim_suffix|>S<|fim_middle|>, repository
  context <|repo_name|>name\\n<|file_sep|>path\\ntext... before it.
- StarCoder2: <fim_prefix>P<fim_suffix>S<fim_middle>.
- CodeLlama (Meta's infilling_prompt_tokens): BOS ▁<PRE> P ▁<SUF> S ▁<MID>; suffix first:
  BOS ▁<PRE> ▁<SUF> S ▁<MID> P.
- DeepSeek-Coder (its README): BOS <｜fim▁begin｜>P<｜fim▁hole｜>S<｜fim▁end｜>.
- Codestral (mistral-common's encode_fim): BOS [SUFFIX]S[PREFIX]P.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
import transformers
from family_models import VOCAB, byte_vocab, save_family

from conftest import start_server
from radixflow.runtime.server.fim import find_fim, layout

QWEN = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
        "<|file_sep|>", "<|im_end|>"]  # fmt: skip
SPECIALS = {
    "qwen": QWEN,
    "starcoder2": [
        "<fim_prefix>",
        "<fim_middle>",
        "<fim_suffix>",
        "<fim_pad>",
        "<repo_name>",
        "<file_sep>",
    ],  # fmt: skip
    "codellama": ["<s>", "▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"],
    "deepseek": ["<｜begin▁of▁sentence｜>", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"],
    "codestral": ["<s>", "[PREFIX]", "[SUFFIX]", "[MIDDLE]"],
    "smollm2": ["<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>"],
}
BOS = {"codellama": "<s>", "deepseek": "<｜begin▁of▁sentence｜>", "codestral": "<s>"}
PREFIX, SUFFIX = "def add(a, b):\n    ", "\n    return c\n"
EXTRA = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}]


def fim_tokenizer(family: str) -> transformers.PreTrainedTokenizerFast:
    """Byte-level BPE without merges (ids 0..255 bytes, 256 <|endoftext|> = EOS) plus the
    family's tokens as specials, so a template string tokenizes to exactly its pieces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = byte_vocab()
    vocab["<|endoftext|>"] = 256
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    bos = BOS.get(family)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", bos_token=bos
    )
    fast.add_special_tokens({"additional_special_tokens": SPECIALS[family]})
    assert len(fast) <= VOCAB, len(fast)
    return fast


def ids_of(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def built(family: str, spm: bool = False, extra: list | None = None, **info: Any) -> list[int]:
    tokenizer = fim_tokenizer(family)
    fim = find_fim(tokenizer, info)
    assert fim is not None, family
    return layout(fim, lambda t: ids_of(tokenizer, t), PREFIX, SUFFIX, extra, "", spm)


@pytest.mark.parametrize(
    ("family", "template"),
    [
        ("qwen", "<|fim_prefix|>{P}<|fim_suffix|>{S}<|fim_middle|>"),
        ("starcoder2", "<fim_prefix>{P}<fim_suffix>{S}<fim_middle>"),
        ("codellama", "<s>▁<PRE>{P}▁<SUF>{S}▁<MID>"),
        ("deepseek", "<｜begin▁of▁sentence｜><｜fim▁begin｜>{P}<｜fim▁hole｜>{S}<｜fim▁end｜>"),
        ("codestral", "<s>[SUFFIX]{S}[PREFIX]{P}"),
    ],
)
def test_each_family_lays_out_its_documented_template(family: str, template: str) -> None:
    documented = ids_of(fim_tokenizer(family), template.format(P=PREFIX, S=SUFFIX))
    assert built(family) == documented


def test_spm_orders_codellama_as_meta_and_others_as_llama_cpp() -> None:
    codellama = ids_of(fim_tokenizer("codellama"), f"<s>▁<PRE>▁<SUF>{SUFFIX}▁<MID>{PREFIX}")
    assert built("codellama", spm=True) == codellama
    qwen = ids_of(
        fim_tokenizer("qwen"), f"<|fim_suffix|>{SUFFIX}<|fim_prefix|>{PREFIX}<|fim_middle|>"
    )
    assert built("qwen", spm=True) == qwen


def test_repository_context_comes_first_in_the_repo_level_pattern() -> None:
    text = EXTRA[0]["text"]
    qwen = (f"<|repo_name|>myproject\n<|file_sep|>util.py\n{text}<|file_sep|>filename\n"
            f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>")  # fmt: skip
    assert built("qwen", extra=EXTRA) == ids_of(fim_tokenizer("qwen"), qwen)
    # no repository tokens: llama.cpp's snippet separator, after BOS
    deepseek = (f"<｜begin▁of▁sentence｜>\n\n--- snippet ---\n\n{text}<｜fim▁begin｜>{PREFIX}"
                f"<｜fim▁hole｜>{SUFFIX}<｜fim▁end｜>")  # fmt: skip
    assert built("deepseek", extra=EXTRA) == ids_of(fim_tokenizer("deepseek"), deepseek)


@pytest.mark.parametrize("family", ["qwen", "starcoder2", "codellama", "deepseek", "codestral"])
def test_what_a_new_suffix_leaves_cached(family: str) -> None:
    """PSM keeps the context and the prefix ahead of the suffix (radix hits while the suffix
    changes); Codestral's suffix-first order keeps only the context."""
    tokenizer = fim_tokenizer(family)
    fim = find_fim(tokenizer, {})
    assert fim is not None

    def encode(text: str) -> list[int]:
        return ids_of(tokenizer, text)

    one = layout(fim, encode, PREFIX, SUFFIX, EXTRA)
    two = layout(fim, encode, PREFIX, "\n    return None\n", EXTRA)
    shared = next(i for i, (a, b) in enumerate(zip(one, two)) if a != b)
    if family == "codestral":  # the prefix comes after the suffix: recomputed
        assert len(encode(EXTRA[0]["text"])) < shared < one.index(fim.ids["pre"])
    else:  # the context, the prefix and the suffix token
        assert shared >= one.index(fim.ids["suf"]) + 1


def test_stops_at_the_family_end_tokens_and_its_fim_tokens() -> None:
    tokenizer = fim_tokenizer("qwen")
    fim = find_fim(tokenizer, {})
    stops = {tokenizer.convert_ids_to_tokens(i) for i in fim.stops}
    assert {"<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|endoftext|>", "<|im_end|>"} <= stops
    codellama = fim_tokenizer("codellama")
    assert codellama.convert_tokens_to_ids("▁<EOT>") in find_fim(codellama, {}).stops


def test_gguf_metadata_names_the_tokens() -> None:
    """llama.cpp's fim_*_token_id keys win over the strings: here they name other tokens."""
    tokenizer = fim_tokenizer("smollm2")
    assert find_fim(tokenizer, {}) is None  # SmolLM2's vocabulary: no FIM tokens
    named = {"pre": 257, "suf": 258, "mid": 259}  # <|im_start|>, <|im_end|>, <repo_name>
    fim = find_fim(tokenizer, {"fim_token_ids": named})
    assert fim is not None and fim.family == "gguf"
    ids = layout(fim, lambda t: ids_of(tokenizer, t), "a", "b")
    assert ids == [named["pre"], *ids_of(tokenizer, "a"), named["suf"], *ids_of(tokenizer, "b"),
                   named["mid"]]  # fmt: skip
    # a Qwen GGUF naming only these three: its repository tokens by their strings
    qwen = fim_tokenizer("qwen")
    three = {r: qwen.convert_tokens_to_ids(f"<|fim_{n}|>") for r, n in
             (("pre", "prefix"), ("suf", "suffix"), ("mid", "middle"))}  # fmt: skip
    fim = find_fim(qwen, {"fim_token_ids": three})
    assert fim.family == "qwen2.5-coder"
    assert fim.ids["sep"] == qwen.convert_tokens_to_ids("<|file_sep|>")


# ---- the doors, on a served tiny model ----------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """A tiny random Llama whose tokenizer has Qwen2.5-Coder's FIM tokens."""
    path, _ = save_family("llama", tmp_path_factory.mktemp("fim"))
    fim_tokenizer("qwen").save_pretrained(path)
    with start_server(model_path=str(path), max_total_tokens=4096) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=120)
        yield SimpleNamespace(url=server.url, client=client, tokenizer=fim_tokenizer("qwen"))


def test_openai_suffix_through_the_official_client(served: SimpleNamespace) -> None:
    reply = served.client.completions.create(
        model="default", prompt=PREFIX, suffix=SUFFIX, max_tokens=8, temperature=0
    )
    usage = reply.usage
    expected = built("qwen")
    assert usage.prompt_tokens == len(expected)  # the FIM layout, not the bare prompt
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert usage.completion_tokens >= 1
    # the model writing <|file_sep|> has moved on to another file: the insert ends there
    sep = served.tokenizer.convert_tokens_to_ids("<|file_sep|>")
    ended = served.client.completions.create(
        model="default", prompt=PREFIX, suffix=SUFFIX, max_tokens=8, temperature=0,
        logit_bias={str(sep): 100},
    )  # fmt: skip
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == 1
    assert ended.choices[0].text == ""
    # the same insert without suffix is a plain completion of the prefix: another prompt
    plain = served.client.completions.create(model="default", prompt=PREFIX, max_tokens=1)
    assert plain.usage.prompt_tokens == len(ids_of(served.tokenizer, PREFIX))


def test_infill_answers_llama_cpp_shape_whole_and_streamed(served: SimpleNamespace) -> None:
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA,
            "n_predict": 8, "temperature": 0, "cache_prompt": True}  # fmt: skip
    whole = httpx.post(f"{served.url}/infill", json=body, timeout=120).json()
    assert whole["stop"] is True and isinstance(whole["content"], str)
    assert whole["tokens_evaluated"] == len(built("qwen", extra=EXTRA))
    assert whole["stop_type"] in ("eos", "limit") and whole["tokens_predicted"] >= 1
    assert whole["prompt"].startswith("<|repo_name|>myproject\n<|file_sep|>util.py\n")
    # the same repository context and prefix again, another suffix: the context is cached
    again = httpx.post(f"{served.url}/infill", json={**body, "input_suffix": "\n"}, timeout=120)
    prefix_at = built("qwen", extra=EXTRA).index(served.tokenizer.convert_tokens_to_ids(QWEN[0]))
    assert again.json()["tokens_cached"] >= prefix_at  # the context, cached
    events = []
    with httpx.stream("POST", f"{served.url}/infill", json={**body, "stream": True},
                      timeout=120) as response:  # fmt: skip
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert events[-1]["stop"] is True and all(not e["stop"] for e in events[:-1])
    streamed = "".join(e["content"] for e in events)
    assert streamed == whole["content"]  # temperature 0: the same insert


def test_ollama_generate_with_suffix(served: SimpleNamespace) -> None:
    body = {"model": "default", "prompt": PREFIX, "suffix": SUFFIX, "stream": False,
            "options": {"num_predict": 8, "temperature": 0}}  # fmt: skip
    reply = httpx.post(f"{served.url}/api/generate", json=body, timeout=120).json()
    assert reply["done"] is True and reply["prompt_eval_count"] == len(built("qwen"))
    assert reply["context"][: len(built("qwen"))] == built("qwen")
    shown = httpx.post(f"{served.url}/api/show", json={"model": "default"}, timeout=60).json()
    assert "insert" in shown["capabilities"]  # Ollama's word for a model that takes suffix


def test_a_model_without_fim_tokens_is_refused(shared_server: Any) -> None:
    url = shared_server.url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="default", prompt="a", suffix="b", max_tokens=1)
    assert refused.value.body["param"] == "suffix"
    assert "fill-in-the-middle" in refused.value.body["message"]
    infill = httpx.post(f"{url}/infill", json={"input_prefix": "a", "input_suffix": "b"})
    assert infill.status_code == 400
    assert infill.json()["error"]["code"] == 400  # llama.cpp's error shape
    assert "fill-in-the-middle" in infill.json()["error"]["message"]
    generate = {"model": "default", "prompt": "a", "suffix": "b", "stream": False}
    ollama = httpx.post(f"{url}/api/generate", json=generate)
    assert ollama.status_code == 400 and "fill-in-the-middle" in ollama.json()["error"]
    shown = httpx.post(f"{url}/api/show", json={"model": "default"}, timeout=60).json()
    assert "insert" not in shown["capabilities"]
