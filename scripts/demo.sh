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

# In its own session (setsid), so that every process of its Ray cluster can be found by the session id.
setsid .venv/bin/splitspec serve --grpc-port "$PORT" >"$LOG" 2>&1 &
SERVE=$!
stop_serve() {
  # SIGTERM: splitspec serve stops within its --stop-timeout (30 s) and forces the stop past it; whatever of its
  # session is still alive after that (it was killed, say) is killed here, so a failed demo leaks no cluster.
  kill -TERM "$SERVE" 2>/dev/null || true
  for _ in $(seq 1 40); do kill -0 "$SERVE" 2>/dev/null || break; sleep 1; done
  pkill -KILL -s "$SERVE" 2>/dev/null || true
  wait "$SERVE" 2>/dev/null || true
}
trap stop_serve EXIT
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
