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
# waits, which the other lane fills. Each group's output is kept in a log
# and printed whole, in order, when its lane is done; the exit status is
# non-zero if any group failed.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -f .coverage .coverage.*
JOBS="${MUON_TEST_JOBS:-2}"
LOGS="$(mktemp -d "${TMPDIR:-/tmp}/muon_tests.XXXXXX")"
trap 'rm -rf "$LOGS"' EXIT

run() {  # run NAME PYTEST-ARGS...: one group, its output to $LOGS/NAME.log
  local name="$1"; shift
  local start=$SECONDS status=0
  python -m coverage run -p --branch --source=python/paddle_muon_ext -m pytest -q \
    --durations=10 "$@" \
    >"$LOGS/$name.log" 2>&1 || status=$?
  echo "[$name] exit $status after $((SECONDS - start)) s" >>"$LOGS/$name.log"
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
for name in legacy_mock fleet group_call tools; do
  echo "===== $name ====="
  cat "$LOGS/$name.log"
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
  --min 95 '*/muon_comm_plan.py'
