#!/usr/bin/env bash
# The whole test suite under coverage.py (branch on), then the coverage floors.
# This is the README's test command; .ci/run calls it after installing.
#
# Each suite runs in its own process (coverage -p, then combine): after the
# thousands of short-lived rank threads of the group-call grid, coverage.py
# stopped recording later suites in the same process.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -f .coverage .coverage.*
run() { python -m coverage run -p --branch --source=python/paddle_muon_ext -m pytest -q "$@"; }
run test/legacy_test test/mock
run test/collective/fleet --ignore=test/collective/fleet/test_muon_group_call.py
run test/collective/fleet/test_muon_group_call.py
run test/tools
python -m coverage combine -q
python -m coverage report --skip-empty
python tools/coverage/check_coverage.py --data-file .coverage \
  --min 90 'python/paddle_muon_ext/*' \
  --min 95 '*/muon_sharding_optimizer.py' \
  --min 95 '*/muon_comm_plan.py'
