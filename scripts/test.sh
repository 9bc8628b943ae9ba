#!/usr/bin/env bash
# The test command (README, .ci/run): set up the environment, style checks, then the suite.
# Extra arguments go to pytest (`bash scripts/test.sh -m slow`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${RADIXFLOW_VENV:-.venv}"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
# The checkout root stays off sys.path (DESIGN §2): its kernels/ folder would shadow Hugging
# Face's `kernels` package, which transformers imports. pytest's own entry point does not put
# the working directory on it (`python -m pytest` does), and PYTHONSAFEPATH (Python 3.11+)
# keeps it off for every `python -m ...` the tests start from here.
export PYTHONSAFEPATH=1
# What a first model load builds once per machine (the native kernels for this CPU, the
# compiled decode loop, SmolLM2's converted metadata), built here into the suite's cache
# (tests/conftest.py's SUITE_CACHE) as an install would: on a fresh clone it is 1-3 minutes of
# compiling that would otherwise land in whichever test loads a model first.
RADIXFLOW_CACHE="$PWD/.pytest-cache/radixflow" "$VENV/bin/python" -c \
  "from radixflow.runtime import Engine; Engine(model='smollm2', max_total_tokens=256).shutdown()"
"$VENV/bin/pytest" -q --durations=15 "$@"
