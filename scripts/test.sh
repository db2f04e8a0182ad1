#!/usr/bin/env bash
# The project's checks, from a fresh clone: set-up, lint, docs (warnings are errors), tests.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m slow` for the long runs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
source "${MOGO_VENV:-.venv}/bin/activate"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1
ruff check .
ruff format --check .
sphinx-build -q -W --keep-going -b html docs docs/_build/html
python -m pytest "$@"
