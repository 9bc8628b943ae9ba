"""load_hf_config's plain path: a llama-family config.json that spells out every field is read
as it is, giving the model config transformers' class would, without that class's imports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from family_models import save_family
from transformers import AutoConfig

from conftest import imported_by
from radixflow.runtime import models
from radixflow.runtime.models import checkpoint_quant
from radixflow.runtime.models.loader import (
    PlainConfig,
    load_hf_config,
    plain_config,
    resolve_model_dir,
)


def same_model_config(path: Path) -> None:
    ours, theirs = load_hf_config(path), AutoConfig.from_pretrained(str(path))
    assert isinstance(ours, PlainConfig)
    assert models.model_config(ours) == models.model_config(theirs)
    assert checkpoint_quant.quant_method(ours) == checkpoint_quant.quant_method(theirs)
    for name in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        assert getattr(ours, name) == getattr(theirs, name)  # the GGUF reader's fields


def test_the_default_model_reads_plain() -> None:
    same_model_config(resolve_model_dir("smollm2"))


def test_a_tiny_llama_checkpoint_reads_plain(tmp_path: Path) -> None:
    """Its rope is llama3's scaled kind: the same scaling comes out."""
    path, _ = save_family("llama", tmp_path)
    same_model_config(path)


def test_reading_it_leaves_the_config_classes_imports_out() -> None:
    """What the plain path exists for: the scheduler process reads its model's config without
    transformers' config classes (torch.distributed's tensor module, sympy: seconds)."""
    path = resolve_model_dir("smollm2")
    statements = (
        f"from radixflow.runtime.models.loader import load_hf_config\nload_hf_config({str(path)!r})"
    )
    assert imported_by(statements, ("sympy", "transformers.utils.type_validators")) == []


CHANGES = {
    "another family": lambda c: c.update(model_type="qwen2"),
    "custom code": lambda c: c.update(auto_map={"AutoConfig": "x.Config"}),
    "a field left to its default": lambda c: c.pop("head_dim"),
    "rope in the older form": lambda c: c.update(rope_parameters=None, rope_theta=5e5),
    "an older transformers' save": lambda c: c.update(transformers_version="4.57.1"),
}


@pytest.mark.parametrize("change", CHANGES, ids=list(CHANGES))
def test_other_configs_go_through_transformers(change: str, tmp_path: Path) -> None:
    path, _ = save_family("llama", tmp_path)
    assert plain_config(path) is not None
    config = json.loads((path / "config.json").read_text())
    CHANGES[change](config)
    (path / "config.json").write_text(json.dumps(config))
    assert plain_config(path) is None
    assert not isinstance(load_hf_config(path), PlainConfig)
