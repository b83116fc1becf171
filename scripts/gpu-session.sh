#!/usr/bin/env bash
# Both GPU checks in one call, each bounded so that both report: the service first (scripts/gpu-serve-check.sh, Ray
# Serve from the carried .gpu-bundle where the machine has no Ray: it has never run on a GPU), then the engine
# (scripts/gpu-check.sh, no Ray; an earlier GPU session ran most of it).
# A timed-out service check still stops its server (at most 60 s more). Results go to $OUT (or ./gpu-results):
# serve.json, gpu.json (each written as its checks go) and session.log; the exit code is the worse check's.
# For the device tool:
#   bash scripts/gpu-bundle.sh     # here, once (where pip works)
#   run(command="bash scripts/gpu-session.sh", carry=[".gpu-bundle"], timeout_s=590)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || echo "no nvidia-smi"
  echo "== service: scripts/gpu-serve-check.sh (at most ${SERVE_CHECK_S:-240} s)"
  timeout "${SERVE_CHECK_S:-240}" bash scripts/gpu-serve-check.sh --json "$out/serve.json"
  serve=$?
  echo "service check exit code $serve"
  echo "== engine: scripts/gpu-check.sh (at most ${GPU_CHECK_S:-270} s)"
  timeout "${GPU_CHECK_S:-270}" bash scripts/gpu-check.sh --json "$out/gpu.json"
  engine=$?
  echo "engine check exit code $engine"
  date -u
  exit $(( serve > engine ? serve : engine ))
} 2>&1 | tee "$out/session.log"
