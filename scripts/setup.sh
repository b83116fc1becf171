#!/usr/bin/env bash
# Create .venv and install splitspec with everything it needs (CPU build of torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
# torch first and pinned: 2.13.0 is the CPU build; an open range pulls a multi-GB CUDA build.
.venv/bin/pip install --quiet torch==2.13.0
.venv/bin/pip install --quiet -e ".[dev]"
echo "splitspec installed in $(pwd)/.venv"
