#!/usr/bin/env bash
# The differential harness (bindings/python/tests/torch/test_differential.py) at length: JOBS
# processes, each running CASES/JOBS generated cases from its own seed (SEED0, SEED0+1, ...),
# every case training under a Session and plainly and comparing losses, parameters, gradients and
# optimizer states bitwise. Prints one line per process and a total; exits non-zero on any
# mismatch (the failing case, shrunk, is in that process's log).
#
#   bash scripts/differential-soak.sh [CASES=2000] [JOBS=nproc] [LOGDIR=/tmp/teraio-soak]
#
# Needs python with torch, hypothesis and the teraio package importable (PYTHON, default python3;
# set PYTHONPATH to an installed wheel's folder). TERAIO_DIFF_DEVICE=cuda runs CUDA tensors
# (deterministic algorithms on) through the engine's GPU paths.
set -euo pipefail
cases=${1:-2000}
jobs=${2:-$(nproc)}
logs=${3:-/tmp/teraio-soak}
py=${PYTHON:-python3}
seed0=${SEED0:-1000}
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$logs"
per=$(( (cases + jobs - 1) / jobs ))
start=$(date +%s)
pids=()
for j in $(seq 0 $((jobs - 1))); do
  ( cd "$logs" && TERAIO_DIFF_PROGRESS=1 TERAIO_DIFF_CASES=$per TERAIO_DIFF_SEED=$((seed0 + j)) "$py" -m pytest -q -s -p no:cacheprovider \
      "$here/bindings/python/tests/torch/test_differential.py" -k equals_plain >"$logs/soak-$j.log" 2>&1 ) &
  pids+=($!)
done
fail=0
for j in "${!pids[@]}"; do
  if wait "${pids[$j]}"; then r=ok; else r=FAILED; fail=1; fi
  echo "process $j (seed $((seed0 + j)), $per cases): $r"
done
passed=$(cat "$logs"/soak-*.log | grep -c '^teraio-diff: equal' || true)
echo "differential soak: $passed cases equal (of $((per * jobs)) asked) in $jobs processes, $(( $(date +%s) - start )) s, $([ $fail = 0 ] && echo '0 mismatches' || echo 'FAILED: see the logs in '"$logs")"
exit $fail
