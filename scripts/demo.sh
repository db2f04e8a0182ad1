#!/usr/bin/env bash
# The main demo on its embedded default: set-up, then the first example, writing into runs/demo.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
source "${MOGO_VENV:-.venv}/bin/activate"
python examples/conflicting_gradients.py --out runs/demo "$@"
