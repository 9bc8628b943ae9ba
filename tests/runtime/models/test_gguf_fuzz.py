"""Damaged GGUF files: truncated anywhere, or with bits flipped anywhere, are either read
(a flipped weight byte is still a weight) or refused with a ValueError naming what is wrong;
never another exception, a crash on a mapped page past the end of the file, or an
allocation sized by a damaged count. The reader is `gguf_file.read_state` (table, shapes and
sizes checked before any weight is read or mapped)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import transformers
from family_models import one_thread
from gguf_models import build_model, write_gguf

from radixflow.runtime.models import gguf_file


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> tuple[Path, bytes, object]:
    with one_thread():
        model = build_model("llama")
    path = tmp_path_factory.mktemp("fuzz") / "tiny-q4_k.gguf"
    write_gguf(path, model, "Q4_K")
    config = transformers.AutoConfig.for_model(**model.config.to_dict())
    return path, path.read_bytes(), config


def _read(path: Path, data: bytes, config: object) -> str:
    path.write_bytes(data)
    try:
        gguf_file.read_state(path, config)
    except ValueError as e:
        assert str(e), "an empty error message"
        return "refused"
    return "read"


def test_pristine_file_reads(pristine, tmp_path) -> None:
    path, data, config = pristine
    assert _read(tmp_path / "x.gguf", data, config) == "read"


def test_truncated_files_are_refused_by_name(pristine, tmp_path) -> None:
    path, data, config = pristine
    layout = gguf_file.Layout(path)
    last = max(layout.tensors, key=lambda t: t.offset)
    cuts = [0, 3, 8, 23, 100, 1000, len(data) // 3, len(data) // 2, last.offset + 1, len(data) - 1]
    for cut in cuts:
        target = tmp_path / f"cut{cut}.gguf"
        target.write_bytes(data[:cut])
        with pytest.raises(ValueError) as info:
            gguf_file.read_state(target, config)
        if cut > last.offset:  # the table is whole: the last tensor is named
            assert last.name in str(info.value) and "cut short" in str(info.value)


def test_bit_flips_read_or_refused(pristine, tmp_path) -> None:
    """120 files with 1-8 random bits flipped (a fixed seed), half of them in the header and
    tensor table, where a flip changes counts, lengths, types, shapes and offsets."""
    path, data, config = pristine
    header_end = min(t.offset for t in gguf_file.Layout(path).tensors)
    rng = random.Random(1234)
    outcomes = {"read": 0, "refused": 0}
    for i in range(120):
        damaged = bytearray(data)
        span = header_end if i % 2 else len(data)
        for _ in range(rng.randint(1, 8)):
            at = rng.randrange(span)
            damaged[at] ^= 1 << rng.randrange(8)
        outcomes[_read(tmp_path / "flip.gguf", bytes(damaged), config)] += 1
    assert outcomes["refused"] > 0 and outcomes["read"] > 0, outcomes


def test_layout_is_parsed_once_until_the_header_changes(pristine, tmp_path, monkeypatch) -> None:
    """read_layout gives the parsed layout again while the file's header bytes and size are
    as they were, and parses a file rewritten with the same size (a flipped header byte)."""
    _, data, _ = pristine
    target = tmp_path / "same.gguf"
    target.write_bytes(data)
    parses = []
    real = gguf_file.Layout.__init__

    def counting(self, path):
        parses.append(path)
        real(self, path)

    monkeypatch.setattr(gguf_file.Layout, "__init__", counting)
    first = gguf_file.read_layout(target)
    assert gguf_file.read_layout(target) is first and len(parses) == 1
    name = first.tensors[0].name.encode()
    at = data.index(name)
    damaged = data[:at] + bytes([data[at] ^ 0x20]) + data[at + 1 :]  # 'b' -> 'B': same size
    target.write_bytes(damaged)
    again = gguf_file.read_layout(target)
    assert len(parses) == 2 and again.tensors[0].name != first.tensors[0].name
