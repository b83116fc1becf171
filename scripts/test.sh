#!/usr/bin/env bash
# Install, prepare the default model pair (cached), and run the whole test suite.
#
# The in-process tests (one torch thread each) run on two workers; the tests that start a local Ray cluster, which
# uses every core, run after them one at a time. Arguments go to pytest; one that names tests (a path or node id)
# runs just those, in one pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/splitspec models prepare

IN_PROCESS=(tests/test_*.py tests/services tests/deployments)  # (the longest files first: drafter training ~3 min)
CLUSTERS=(tests/serving tests/observability)

pytest_run() {
  set +e
  .venv/bin/python -m pytest "$@"
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
pytest_run -n 2 --dist loadfile "$@" "${IN_PROCESS[@]}" || status=$?
pytest_run --durations=15 "$@" "${CLUSTERS[@]}" || status=$?  # (the slowest cluster tests: where the time goes)
exit "$status"
