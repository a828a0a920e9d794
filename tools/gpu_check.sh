#!/usr/bin/env bash
# Copyright (c) 2026 paddle_muon_ext Authors. All Rights Reserved.
# Licensed under the Apache License, Version 2.0.
#
# GPU check for a machine with one CUDA GPU and paddlepaddle-gpu (< 8 min):
#   1. numerics  bf16 Newton-Schulz / Muon steps vs a float64 NumPy reference
#   2. bench     grouped vs per-matrix Newton-Schulz (full-size MoE owner)
#   3. smoke     MuonShardingOptimizer on one rank vs plain Muon
# One PASS/FAIL/SKIP line per part (details indented above it).
# Exit: 0 all passed, 1 a part failed, 77 no CUDA (every part SKIP).
#   tools/gpu_check.sh [--dry-run-cpu]   (CPU, small sizes: checks the script only)
set -u
case "${1:-}" in
  -h|--help) sed -n '4,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  ""|--dry-run-cpu) ;;
  *) echo "error: unknown argument '$1' (use --help)"; exit 2 ;;
esac
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
if [ "${1:-}" != "--dry-run-cpu" ]; then
  # one probe instead of three paddle imports
  probe=$(python3 -c "import paddle; print(int(paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0), paddle.__version__)" 2>/dev/null)
  if [ "${probe%% *}" != "1" ]; then
    echo "SKIP: no CUDA (paddle ${probe#* }): numerics, bench and smoke need a CUDA GPU and paddlepaddle-gpu"
    exit 77
  fi
fi
status=0
skipped=0
for part in numerics bench smoke; do
  # each part in its own process and time box (sum < 8 min)
  timeout 150 python3 tools/gpu_check.py "$part" "$@" 2>/tmp/gpu_check_$$.err
  rc=$?
  if [ "$rc" -eq 124 ]; then
    echo "FAIL: $part: timed out after 150 s"
  elif [ "$rc" -ne 0 ] && [ "$rc" -ne 1 ] && [ "$rc" -ne 77 ]; then
    echo "FAIL: $part: exit $rc: $(tail -n 1 /tmp/gpu_check_$$.err)"
  fi
  if [ "$rc" -eq 77 ]; then skipped=$((skipped + 1)); elif [ "$rc" -ne 0 ]; then status=1; fi
done
rm -f /tmp/gpu_check_$$.err
if [ "$status" -eq 0 ] && [ "$skipped" -eq 3 ]; then exit 77; fi
exit "$status"
