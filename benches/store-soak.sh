#!/usr/bin/env bash
# The store's model-based test as a soak (issue 36; docs/BENCHMARKS.md, "Store model soak"):
# OPS operations per mode (volatile, retain_on_prefetch, persistent) of engine/tests/store_model.rs
# against its model, with the simulated disks' faults, crashes and reopens; one summary line per
# mode (operations, cases, seconds, what happened); the whole output in LOG (store-soak.log).
# A failure names its case's seed and its last operations:
# TERAIO_STORE_SEED=<seed> cargo test -p teraio-engine --test store_model <mode test> replays it.
# Usage: OPS=100000 [SEEDS=n: another series of seeds] bash benches/store-soak.sh
# (CI runs the same test with 1,500 operations a mode.)
set -euo pipefail
cd "$(dirname "$0")/.."
OPS=${OPS:-100000}
PROFILE=${PROFILE:-dev}
start=$(date +%s)
TERAIO_STORE_OPS=$OPS TERAIO_STORE_SEEDS=${SEEDS:-0} nice -n "${NICE:-19}" cargo test -p teraio-engine --profile "$PROFILE" \
  --test store_model -- --nocapture --test-threads "${THREADS:-3}" 2>&1 |
  tee "${LOG:-store-soak.log}" | grep -E '^store model|^test |panicked|seed|test result'
echo "store soak: $OPS operations a mode, $(( $(date +%s) - start )) s wall"
