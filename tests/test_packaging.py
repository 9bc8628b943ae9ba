"""A non-editable install ships what the kernels build from: the wheel holds the C and C++
sources beside their modules, and the installed copy (not the checkout) builds the native
kernels and the CPU decode loop. Where compilers exist, a failed build fails this test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# every native source of the checkout, as the wheel names it (quant.c includes quant_amx.c:
# a wheel without it built no quantized kernels, silently)
SOURCES = sorted(
    "radixflow/" + str(path.relative_to(ROOT))
    for pattern in ("*.c", "*.cpp", "*.h")
    for folder in ("kernels", "bench")  # bench: the bandwidth probe
    for path in (ROOT / folder).rglob(pattern)
)
BUILD = """
import os, sys
from radixflow.kernels.cpu import decode_loop, native, quant
assert decode_loop.__file__.startswith(sys.argv[1]), decode_loop.__file__
assert native.library() is not None, "native kernels did not build"
assert quant.library() is not None, "quantized kernels did not build"
assert decode_loop.extension() is not None, "decode loop did not build"
print("built", decode_loop.__file__)
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # from a copy: setuptools' build/ folder in the checkout would carry files a stale
    # package-data list no longer names into the wheel
    source = out / "source"
    skip = shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "docs", "tests")
    shutil.copytree(ROOT, source, ignore=skip)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
         "-w", str(out), str(source)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (path,) = out.glob("radixflow-*.whl")
    return path


def test_the_wheel_ships_the_kernel_sources(wheel: Path) -> None:
    assert "radixflow/kernels/cpu/quant_amx.c" in SOURCES and len(SOURCES) >= 4
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [s for s in SOURCES if s not in names]
    assert not missing, f"the wheel lacks {missing}"
    packages = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    for package in ("radixflow/runtime/scheduler", "radixflow/kernels/triton", "radixflow/lab"):
        assert package in packages


@pytest.mark.slow  # a minute on 2 cores; tests/kernels/cpu/test_decode_loop builds in-tree
@pytest.mark.skipif(
    shutil.which("cc") is None or shutil.which("c++") is None, reason="needs C and C++ compilers"
)
def test_the_installed_copy_builds_the_kernels(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
         str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(target), "RADIXFLOW_CACHE": str(tmp_path / "cache")}
    out = subprocess.run(
        [sys.executable, "-c", BUILD, str(target)],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "built" in out.stdout
