#!/usr/bin/env bash
# Creates the virtual environment (once) and installs PyTorch and mogo into it.
#
#   TORCH_SPEC  what pip installs first; default torch==2.13.0 (the CPU build). Set it for a GPU,
#               e.g. TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128".
#   EXTRAS      mogo's extras; default dev,qp,docs,diffusion,ocr.
#   MOGO_VENV   where the environment lives; default .venv in the repository.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv="${MOGO_VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
# shellcheck disable=SC1091
source "$venv/bin/activate"
# Torch first and explicitly: a bare `torch` requirement would pull a multi-GB CUDA build.
# shellcheck disable=SC2086
python -m pip install --quiet --disable-pip-version-check ${TORCH_SPEC:-torch==2.13.0}
# The project itself through uv: pip's resolver spends many minutes backtracking over the
# diffusion and dev extras together; uv resolves them in seconds and keeps the torch above.
python -m pip install --quiet --disable-pip-version-check "uv>=0.4"
uv pip install --quiet --python "$venv/bin/python" -e ".[${EXTRAS:-dev,qp,docs,diffusion,ocr}]"
