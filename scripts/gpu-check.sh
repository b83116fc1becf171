#!/usr/bin/env bash
# The engine on a GPU in one command (no Ray needed): batch invariance, greedy identity, KV round trip, rollback,
# a sampled chi-square, tokens/s, batched verify and the KV handoff on CUDA. Prints SKIP and exits 0 where torch sees no GPU. Extra arguments go to
# `python -m splitspec.checks.gpu` (e.g. --device cuda:1, --pair tiny, --json results.json).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" -m splitspec.checks.gpu "$@"
