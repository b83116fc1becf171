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
# Prometheus for the live metrics test and for operators (Debian's package; `ray metrics
# launch-prometheus` downloads from the internet instead).
if ! command -v prometheus >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  if command -v apt-get >/dev/null 2>&1; then
    $SUDO apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq prometheus >/dev/null \
      || echo "warning: could not install Debian's prometheus package; the live metrics test will fail" >&2
  else
    echo "warning: no apt-get: install Prometheus yourself for the live metrics test" >&2
  fi
fi
echo "splitspec installed in $(pwd)/.venv"
