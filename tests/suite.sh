#!/usr/bin/env bash
# The whole suite, as `make test` runs it:
#   - in the background, from the start: the unit tests and the engine's
#     integration tests (one process each, no cluster, one torch thread) on two
#     workers at idle CPU priority (SCHED_IDLE).  They take almost only the
#     time the tests in the foreground leave idle, so they add little to the
#     wall time and next to nothing to those tests' latency: a task at normal
#     priority that wakes takes the core from them at once.  Run alone, one at
#     a time, the engine's tests left a core idle for their whole three minutes.
#   - in the foreground, at normal priority: first the tests marked wall_clock
#     (verdicts that rest on a short wall-clock window: tests/wall_clock.py) on
#     two workers, mostly waiting on timers and processes; then the cluster
#     integration tests, one at a time, which start clusters and leave part of
#     the two cores idle while they wait on them.
# The cluster integration tests show their progress here; the background
# tests' output is kept in runs/unit-tests.log and printed when both are done.
# Fails when any part fails or collects nothing (pytest's exit 5).
#   usage: tests/suite.sh PYTHON [PYTEST_ARGS...]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${1:?usage: tests/suite.sh PYTHON [PYTEST_ARGS...]}
shift
mkdir -p runs
UNIT_LOG=runs/unit-tests.log
WALL_CLOCK_LOG=runs/wall-clock-tests.log
INTEGRATION_LOG=runs/integration-tests.log
: >"$WALL_CLOCK_LOG"

idle() {  # SCHED_IDLE where chrt can set it, else the lowest nice value
  if command -v chrt >/dev/null 2>&1 && chrt --idle 0 true 2>/dev/null; then
    chrt --idle 0 "$@"
  else
    nice -n 19 "$@"
  fi
}

BESIDE=(tests/unit tests/integration/engine)  # no cluster: beside the cluster integration tests

echo "==> the other unit tests and the engine's integration tests: 2 workers at idle priority, beside the" \
     "cluster integration tests (output: $UNIT_LOG)"
idle "$PY" -m pytest -ra -n 2 --dist loadfile "${BESIDE[@]}" -m "not wall_clock" "$@" >"$UNIT_LOG" 2>&1 &
UNIT_PID=$!
trap 'kill "$UNIT_PID" 2>/dev/null' INT TERM

echo "==> tests that time themselves (marked wall_clock): 2 workers at normal priority"
# Only their files are collected (tests/wall_clock.py): collecting every unit test to deselect
# most of them cost each worker about 5 s more.
mapfile -t WALL_CLOCK_PATHS < <("$PY" -m tests.wall_clock)
if [ "${#WALL_CLOCK_PATHS[@]}" -eq 0 ]; then
  echo "tests/wall_clock.py named no file" >&2
  WALL_CLOCK_RC=1
else
  "$PY" -m pytest -ra -n 2 --dist loadfile "${WALL_CLOCK_PATHS[@]}" -m wall_clock "$@" 2>&1 | tee "$WALL_CLOCK_LOG"
  WALL_CLOCK_RC=${PIPESTATUS[0]}
fi

echo "==> cluster integration tests, one at a time"
"$PY" -m pytest -ra tests/integration --ignore=tests/integration/engine "$@" 2>&1 | tee "$INTEGRATION_LOG"
INTEGRATION_RC=${PIPESTATUS[0]}

echo "==> waiting for the tests beside them"
wait "$UNIT_PID"
UNIT_RC=$?
echo "==> the tests beside them ($UNIT_LOG), last lines:"
tail -n 60 "$UNIT_LOG"
# Last, so that a log that keeps only the tail (CI's) still names every test that failed.
echo "==> tests that failed or errored, all three parts:"
grep -h -E '^(FAILED|ERROR) ' "$WALL_CLOCK_LOG" "$INTEGRATION_LOG" "$UNIT_LOG" || echo "(none)"
echo "==> exit status: wall_clock tests $WALL_CLOCK_RC, unit + engine tests $UNIT_RC, cluster integration tests" \
     "$INTEGRATION_RC"
[ "$WALL_CLOCK_RC" -eq 0 ] && [ "$UNIT_RC" -eq 0 ] && [ "$INTEGRATION_RC" -eq 0 ]
