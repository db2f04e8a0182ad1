#!/usr/bin/env bash
# The main demo on its embedded default: set-up, then MARBLE multi-reward fine-tuning of the
# shipped shapes-world SD3 (about 10 CPU minutes), writing into runs/shapes-marble.
# Extra arguments go to the command, e.g. `scripts/demo.sh --set train.epochs=10`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
source "${MOGO_VENV:-.venv}/bin/activate"
OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" HF_HUB_OFFLINE=1 python -m mogo_diffusion.train "$@"
