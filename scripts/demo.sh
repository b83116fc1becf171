#!/usr/bin/env bash
# The README's first command: install, prepare the default pair, start the service
# (local Ray cluster, gRPC and the OpenAI-compatible HTTP API on 127.0.0.1), generate an answer through gRPC and
# one through the OpenAI API (the `openai` client), stop.
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPT=${1:-"Explain speculative decoding in two sentences."}
PORT=${SPLITSPEC_GRPC_PORT:-9000}
HTTP_PORT=${SPLITSPEC_HTTP_PORT:-8000}
LOG=${SPLITSPEC_SERVE_LOG:-${TMPDIR:-/tmp}/splitspec-serve.log}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}

bash scripts/setup.sh
.venv/bin/splitspec models prepare

# In its own session (setsid), so that every process of its Ray cluster can be found by the session id.
setsid .venv/bin/splitspec serve --grpc-port "$PORT" --http-port "$HTTP_PORT" >"$LOG" 2>&1 &
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
grep -E "serving gRPC|OpenAI-compatible|is bound on|listen on all interfaces|Ray dashboard" "$LOG" || { tail -n 30 "$LOG"; exit 1; }
echo
echo "> $PROMPT"
.venv/bin/splitspec generate "$PROMPT" --address "127.0.0.1:$PORT"
echo
echo "> the same through the OpenAI API (POST http://127.0.0.1:$HTTP_PORT/v1/chat/completions, streamed)"
.venv/bin/python - "$PROMPT" "http://127.0.0.1:$HTTP_PORT/v1" <<'EOF'
import os
import sys

from openai import OpenAI

prompt, base_url = sys.argv[1:]
client = OpenAI(base_url=base_url, api_key=os.environ.get("SPLITSPEC_AUTH_TOKEN") or "unused", timeout=300)
model = client.models.list().data[0].id
for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            temperature=0, stream=True, stream_options={"include_usage": True}):
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
    else:
        print(f"\n[{model}: {chunk.usage.completion_tokens} tokens]")
EOF
