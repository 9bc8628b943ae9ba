"""load_tokenizer's direct path: the tokenizer AutoTokenizer would give, without its imports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from family_models import save_family
from transformers import AutoTokenizer

from conftest import imported_by
from radixflow.runtime.models.loader import resolve_model_dir
from radixflow.runtime.tokenizer import load_tokenizer, plain_backend

TEXTS = [
    "Hello world",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Ünïcödé: 日本語 — emoji 🚀 and <|endoftext|> inside",
    "",
]


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    return resolve_model_dir("smollm2")


def same_tokenizer(ours, theirs) -> None:
    assert type(ours) is type(theirs)
    for text in TEXTS:
        assert ours(text)["input_ids"] == theirs(text)["input_ids"], text
        ids = theirs(text)["input_ids"]
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True
        )
    assert ours.all_special_ids == theirs.all_special_ids
    assert ours.get_added_vocab() == theirs.get_added_vocab()
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        theirs.bos_token_id,
        theirs.eos_token_id,
        theirs.pad_token_id,
    )
    assert ours.chat_template == theirs.chat_template
    if theirs.chat_template:
        turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
        assert ours.apply_chat_template(turns, tokenize=False) == theirs.apply_chat_template(
            turns, tokenize=False
        )


def test_the_default_models_tokenizer_is_autotokenizers(smollm2_dir: Path) -> None:
    assert plain_backend(smollm2_dir), "the converted GGUF's tokenizer should load directly"
    same_tokenizer(load_tokenizer(smollm2_dir), AutoTokenizer.from_pretrained(str(smollm2_dir)))


def test_loading_it_leaves_autoconfigs_imports_out(smollm2_dir: Path) -> None:
    """What the direct path exists for: the server's front process reads no model config, so
    transformers' config classes (torch.distributed, sympy: seconds) are never imported."""
    statements = (
        "from radixflow.runtime.tokenizer import load_tokenizer\n"
        f"load_tokenizer({str(smollm2_dir)!r})"
    )
    assert imported_by(statements, ("sympy", "transformers.models.auto.configuration_auto")) == []


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tiny_checkpoints_load_as_autotokenizer_does(family: str, tmp_path: Path) -> None:
    """A llama checkpoint naming TokenizersBackend takes the direct path; a qwen2 one, which
    AutoTokenizer may map to its own class, goes through AutoTokenizer."""
    path, _ = save_family(family, tmp_path)
    settings = json.loads((path / "tokenizer_config.json").read_text())
    assert settings["tokenizer_class"] == "TokenizersBackend"
    assert plain_backend(path) == (family == "llama")
    same_tokenizer(load_tokenizer(path), AutoTokenizer.from_pretrained(str(path)))


def test_custom_code_or_a_missing_config_goes_through_autotokenizer(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (tmp_path / name).write_bytes((smollm2_dir / name).read_bytes())
    assert plain_backend(tmp_path)
    settings = json.loads((tmp_path / "tokenizer_config.json").read_text())
    settings["auto_map"] = {"AutoTokenizer": ["x.Tok", None]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
    assert not plain_backend(tmp_path)
    (tmp_path / "config.json").unlink()
    assert not plain_backend(tmp_path)
