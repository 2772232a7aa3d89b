#!/usr/bin/env bash
# The test command: set up (scripts/bootstrap.sh), lint, type-check, then the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
VENV="${FDG_VENV:-.venv}"
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 WANDB_MODE=offline
"$VENV/bin/ruff" check .
"$VENV/bin/mypy"
"$VENV/bin/python" -m pytest -q "$@"
