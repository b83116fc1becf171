#!/usr/bin/env bash
# splitspec served on a GPU through Ray Serve in one command: configs/gpu-one.yaml deployed with a random-weight
# pair (every stage on the GPU, then the drafter on the CPU beside GPU prefill and verify), greedy answers against
# speculation off, a bounded stop (python -m splitspec.checks.gpu_serve; its docstring says what is checked).
# Prints SKIP and exits 0 where torch sees no GPU; extra arguments go to the module (--device cpu, --json FILE).
# On a machine without Ray or a registry (the device machine), build .gpu-bundle first where pip works
# (scripts/gpu-bundle.sh) and carry it: this script unpacks it and puts it first on the path.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
extra=()
if [ -f .gpu-bundle/site.tar.xz ]; then
  site="${TMPDIR:-/tmp}/splitspec-gpu-bundle"
  rm -rf "$site" && mkdir -p "$site"
  # Python's tarfile, not tar: the machine may have no xz program
  "$PYTHON" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="tar")' \
    .gpu-bundle/site.tar.xz "$site"
  extra=(--tokenizer "$site/tokenizer")
  if ! "$PYTHON" -c "import ray" 2>/dev/null; then
    export PYTHONPATH="$site/site${PYTHONPATH:+:$PYTHONPATH}"
    echo "using the carried bundle ($(tr '\n' ' ' < .gpu-bundle/versions.txt))"
  fi
fi
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" -m splitspec.checks.gpu_serve "${extra[@]}" "$@"
