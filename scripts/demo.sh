#!/usr/bin/env bash
# The main demo on its embedded default: set-up, then weighted sum vs MARBLE on a real
# multi-task problem (scikit-learn's digits), writing its figure into runs/demo.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
source "${MOGO_VENV:-.venv}/bin/activate"
python examples/multitask_digits.py --out runs/demo "$@"
