#!/usr/bin/env bash
# The README's first command: install, prepare the default pair, start the service
# (local Ray cluster + gRPC on 127.0.0.1), generate an answer through gRPC, stop.
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPT=${1:-"Explain speculative decoding in two sentences."}
PORT=${SPLITSPEC_GRPC_PORT:-9000}
LOG=${SPLITSPEC_SERVE_LOG:-${TMPDIR:-/tmp}/splitspec-serve.log}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}

bash scripts/setup.sh
.venv/bin/splitspec models prepare

.venv/bin/splitspec serve --grpc-port "$PORT" >"$LOG" 2>&1 &
SERVE=$!
trap 'kill -TERM $SERVE 2>/dev/null || true; wait $SERVE 2>/dev/null || true' EXIT
echo "starting the service (log: $LOG) ..."
for _ in $(seq 1 600); do
  if grep -q "is serving gRPC" "$LOG"; then break; fi
  if ! kill -0 "$SERVE" 2>/dev/null; then tail -n 30 "$LOG"; exit 1; fi
  sleep 1
done
grep -E "serving gRPC|Ray dashboard" "$LOG" || { tail -n 30 "$LOG"; exit 1; }
echo
echo "> $PROMPT"
.venv/bin/splitspec generate "$PROMPT" --address "127.0.0.1:$PORT"
