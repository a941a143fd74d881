#!/usr/bin/env bash
# A slow device, re-planned vs the first plan kept (docs/BENCHMARKS.md, "A slow device: the plan
# adapts"): RUNS runs of each, alternated, JSON into OUT (default ./slow-device-out).
# Usage: TERAIO=target/release/teraio RUNS=3 bash benches/slow-device.sh
set -euo pipefail
TERAIO=${TERAIO:-target/release/teraio}
RUNS=${RUNS:-3}
OUT=${OUT:-slow-device-out}
mkdir -p "$OUT"
for i in $(seq "$RUNS"); do
  for mode in replan no-replan; do
    extra=()
    [ "$mode" = no-replan ] && extra=(--no-replan)
    "$TERAIO" run --sim --file-size 1G --probe-size 64M --sim-bandwidth 256M --time-scale 0.5 \
      --iterations 4 --fault slow:1:10@1 --json "${extra[@]}" > "$OUT/$mode-$i.json" || true
  done
done
python3 - "$OUT" <<'PY'
import json, glob, statistics, sys
for mode in ["replan", "no-replan"]:
    runs = [json.load(open(f))["replay"]["iterations"] for f in sorted(glob.glob(f"{sys.argv[1]}/{mode}-*.json"))]
    for k in range(4):
        t = statistics.median(r[k]["time_s"] for r in runs)
        s = statistics.median(r[k]["stall_s"] for r in runs)
        print(f"{mode:10} iteration {k}: median time {t:.2f} s, stall {s:.2f} s")
PY
