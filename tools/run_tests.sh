#!/usr/bin/env bash
# The whole test suite under coverage.py (branch on), then the coverage floors.
# This is the README's test command; .ci/run calls it after installing.
#
# Each suite group runs in its own process (coverage -p, then combine): after
# the thousands of short-lived rank threads of the simulated worlds,
# coverage.py stopped recording later suites in the same process.
#
# The groups run in two lanes at once (MUON_TEST_JOBS=1: one after another):
# the fleet group spends much of its time in launcher/gloo start-up and
# waits, which the other lane fills. Output is live: every line a group's
# pytest prints is shown as it comes, prefixed with the group's name, and a
# line marks when each group starts and ends (with its time). The run ends
# with one line per group and a total; the exit status is non-zero if any
# group failed.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -f .coverage .coverage.*
JOBS="${MUON_TEST_JOBS:-2}"
LOGS="$(mktemp -d "${TMPDIR:-/tmp}/muon_tests.XXXXXX")"
trap 'rm -rf "$LOGS"' EXIT
# Unbuffered, so pytest's progress reaches the pipe (and the terminal) at once.
export PYTHONUNBUFFERED=1
RUN_START=$SECONDS

stamp() { printf '%4d s' "$((SECONDS - RUN_START))"; }

run() {  # run NAME PYTEST-ARGS...: one group, live output prefixed [NAME]
  local name="$1"; shift
  local start=$SECONDS status=0
  echo "[$name] start at $(stamp): pytest $*"
  # pytest's exit status is written to a file: inside a pipeline it would be
  # the prefixer's. The log keeps the group's output for the summary.
  { python -m coverage run -p --branch --source=python/paddle_muon_ext -m pytest -q -rfE \
      --durations=10 "$@" 2>&1 || echo "$?" >"$LOGS/$name.rc"; } \
    | tee "$LOGS/$name.log" | sed -u "s/^/[$name] /"
  [ -f "$LOGS/$name.rc" ] && status="$(cat "$LOGS/$name.rc")"
  echo "$status" >"$LOGS/$name.rc"
  echo "[$name] exit $status after $((SECONDS - start)) s (at $(stamp))"
  return "$status"
}

lane_fleet() {
  run fleet test/collective/fleet --ignore=test/collective/fleet/test_muon_group_call.py
}
lane_rest() {
  local status=0
  run legacy_mock test/legacy_test test/mock || status=1
  run group_call test/collective/fleet/test_muon_group_call.py || status=1
  run tools test/tools || status=1
  return "$status"
}

failed=0
if [ "$JOBS" -ge 2 ]; then
  lane_fleet & fleet_pid=$!
  lane_rest || failed=1
  wait "$fleet_pid" || failed=1
else
  lane_rest || failed=1
  lane_fleet || failed=1
fi
echo "===== summary ====="
passed_total=0; failed_total=0
for name in legacy_mock fleet group_call tools; do
  # pytest's closing line, e.g. "12 failed, 300 passed, 2 skipped in 9.1s"
  line="$(grep -E '^(=+ )?[0-9]+ [a-z]+.* in [0-9.]+s' "$LOGS/$name.log" | tail -1 || true)"
  echo "[$name] exit $(cat "$LOGS/$name.rc" 2>/dev/null || echo '?'): ${line:-no pytest summary}"
  p="$(sed -nE 's/(^|.* )([0-9]+) passed.*/\2/p' <<<"$line")"
  f="$(sed -nE 's/(^|.* )([0-9]+) failed.*/\2/p' <<<"$line")"
  e="$(sed -nE 's/(^|.* )([0-9]+) errors?.*/\2/p' <<<"$line")"
  passed_total=$((passed_total + ${p:-0}))
  failed_total=$((failed_total + ${f:-0} + ${e:-0}))
done
echo "total: $passed_total passed, $failed_total failed"
# The failed tests' names last, where a truncated CI log still shows them
# (pytest's -rfE lines, e.g. "FAILED test/tools/x.py::T::test_y - AssertionError: ...",
# and SUBFAILED for a failed subtest).
for name in legacy_mock fleet group_call tools; do
  grep -E '^(SUB)?(FAILED|ERROR)[ (]' "$LOGS/$name.log" 2>/dev/null | cut -c1-400 | sed "s/^/[$name] /" || true
done
if [ "$failed" -ne 0 ]; then
  echo "some test group failed (see above)" >&2
  exit 1
fi
python -m coverage combine -q
python -m coverage report --skip-empty
python tools/coverage/check_coverage.py --data-file .coverage \
  --min 90 'python/paddle_muon_ext/*' \
  --min 95 '*/muon_sharding_optimizer.py' \
  --min 95 '*/muon_sharding/comm_plan.py'
