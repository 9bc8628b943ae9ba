#!/usr/bin/env bash
# The test command (README, .ci/run): set up the environment, style checks, then the suite.
# Extra arguments go to pytest (`bash scripts/test.sh -m slow`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY="${RADIXFLOW_VENV:-.venv}/bin/python"
"$PY" -m ruff check .
"$PY" -m ruff format --check .
"$PY" -m pytest -q --durations=15 "$@"
