#!/usr/bin/env bash
# Install, prepare the default model pair (cached), and run the whole test suite.
#
# The tests that start a local Ray cluster run one at a time; beside them, as idle-class processes (SCHED_IDLE, and
# nice 18 where chrt is missing: test_priority needs a step to 19), the in-process tests (one torch thread each) run on
# two workers: the cluster tests leave about half of two cores idle (processes starting, Serve's control loop, polls),
# and the in-process tests take what they leave. (At nice 18 alone they took a third of a core from Ray's workers at
# nice 15, and the cluster tests ran 20% longer.)
# Arguments go to pytest; one that names tests (a path or node id) runs just those, in one pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/splitspec models prepare

IN_PROCESS=(tests/test_*.py tests/services tests/deployments)  # (the longest files first: drafter training ~3 min)
CLUSTERS=(tests/serving tests/observability)

pytest_run() {  # [--idle] pytest's arguments
  local prefix=()
  if [ "${1:-}" = "--idle" ]; then
    prefix=(nice -n 18)
    if command -v chrt >/dev/null && chrt --idle 0 true 2>/dev/null; then prefix=(chrt --idle 0 nice -n 18); fi
    shift
  fi
  set +e
  "${prefix[@]}" .venv/bin/python -m pytest "$@"
  local status=$?
  set -e
  if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: failing the run" >&2
    return 1
  fi
  return "$status"
}

for arg in "$@"; do
  case "$arg" in
    -*) ;;
    *) pytest_run "$@"; exit $? ;;  # a selection of tests
  esac
done
status=0
in_process_log=$(mktemp)
pytest_run --idle -n 2 --dist loadfile "$@" "${IN_PROCESS[@]}" >"$in_process_log" 2>&1 &
in_process=$!
echo "== tests that start a Ray cluster (the in-process tests run beside them; their output follows)"
pytest_run --durations=15 "$@" "${CLUSTERS[@]}" || status=$?  # (the slowest cluster tests: where the time goes)
wait "$in_process" || status=$?
echo "== in-process tests"
cat "$in_process_log"
rm -f "$in_process_log"
exit "$status"
