"""The model's own sampling defaults: what a checkpoint's generation_config.json (or a GGUF's
`general.sampling.*` keys) recommends is what a request that leaves those fields unset samples
with, shown in its meta_info and in /v1/models and /get_model_info; a request's own values
win; `--sampling-defaults openai` turns them off. "Samples with" is checked by the tokens: a
seeded request without the fields gives the tokens of the same seed with the defaults spelled
out, and not those of 1.0 / 1.0 / off."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from family_models import save_family
from gguf_models import build_model, write_gguf

from conftest import start_server
from radixflow.runtime.engine import Engine
from radixflow.runtime.models.loader import GGUF_POINTER, model_sampling_defaults

RECOMMENDED = {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
OPENAI = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
PROMPT = {"input_ids": [5, 17, 42, 9, 77, 31]}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = save_family("llama", tmp_path_factory.mktemp("defaults"))
    config = {"do_sample": True, **RECOMMENDED, "bos_token_id": 1, "eos_token_id": 2}
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def served(checkpoint: Path) -> Iterator[str]:
    with start_server(model_path=str(checkpoint), max_total_tokens=1024) as server:
        yield server.url


def generate(url: str, **sampling: object) -> dict:
    body = {**PROMPT, "sampling_params": {"max_new_tokens": 24, "seed": 7, **sampling}}
    return httpx.post(url + "/generate", json=body, timeout=60).json()


def test_unset_fields_take_the_models_defaults(served: str) -> None:
    unset = generate(served)
    assert unset["meta_info"]["sampling_defaults"] == RECOMMENDED
    spelled = generate(served, **RECOMMENDED)
    assert "sampling_defaults" not in spelled["meta_info"]
    assert unset["output_ids"] == spelled["output_ids"]
    assert unset["output_ids"] != generate(served, **OPENAI)["output_ids"]


def test_a_requests_own_values_win(served: str) -> None:
    own = generate(served, temperature=0)
    assert own["meta_info"]["sampling_defaults"] == {"top_p": 0.9, "top_k": 20}
    assert own["output_ids"] == generate(served, temperature=0, top_p=0.5)["output_ids"]


def test_the_defaults_are_shown(served: str) -> None:
    card = httpx.get(served + "/v1/models", timeout=30).json()["data"][0]
    assert card["sampling_defaults"] == RECOMMENDED
    info = httpx.get(served + "/get_model_info", timeout=30).json()
    assert info["preferred_sampling_params"] == RECOMMENDED


def test_the_openai_flag_turns_them_off(checkpoint: Path) -> None:
    """The offline Engine applies the same defaults; --sampling-defaults openai drops them
    (in process: a second server would cost the suite its start)."""
    params = {"max_new_tokens": 24, "seed": 7}
    ids = PROMPT["input_ids"]
    with Engine(model=str(checkpoint), max_total_tokens=1024) as engine:
        assert engine.model_info["sampling_defaults"] == RECOMMENDED
        unset = engine.generate(input_ids=ids, sampling_params=params)["output_ids"]
        spelled = {**params, **RECOMMENDED}
        assert unset == engine.generate(input_ids=ids, sampling_params=spelled)["output_ids"]
    with Engine(model=str(checkpoint), max_total_tokens=1024, sampling_defaults="openai") as engine:
        assert engine.model_info["sampling_defaults"] == {}
        unset = engine.generate(input_ids=ids, sampling_params=params)["output_ids"]
        spelled = {**params, **OPENAI}
        assert unset == engine.generate(input_ids=ids, sampling_params=spelled)["output_ids"]


def test_a_ggufs_sampling_keys(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    keys = {"general.sampling.temp": 0.7, "general.sampling.top_p": 0.8,
            "general.sampling.top_k": 40, "general.sampling.min_p": 0.05}  # fmt: skip
    write_gguf(path, build_model("llama"), "Q8_0", metadata=keys)
    folder = tmp_path / "converted"
    folder.mkdir()
    (folder / GGUF_POINTER).write_text(json.dumps({"path": str(path)}))
    found = model_sampling_defaults(folder)
    assert found == pytest.approx({"temperature": 0.7, "top_p": 0.8, "top_k": 40, "min_p": 0.05})
    assert isinstance(found["top_k"], int)
    write_gguf(path, build_model("llama"), "Q8_0")
    assert model_sampling_defaults(folder) == {}


def test_a_generation_config_without_sampling_values(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text('{"do_sample": false, "top_k": "x"}')
    assert model_sampling_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text("not json")
    assert model_sampling_defaults(tmp_path) == {}
