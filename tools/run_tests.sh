#!/usr/bin/env bash
# The whole test suite with coverage (branch on), then the coverage floors.
# This is the README's test command; .ci/run calls it after installing.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -f .coverage .coverage.*
python -m coverage run --branch --source=python/paddle_muon_ext -m pytest -q "$@"
python -m coverage report --skip-empty
if [ -f tools/coverage/check_coverage.py ]; then
  python tools/coverage/check_coverage.py --data-file .coverage \
    --min 90 'python/paddle_muon_ext/*' \
    --min 95 '*/muon_sharding_optimizer.py' \
    --min 95 '*/muon_comm_plan.py'
fi
