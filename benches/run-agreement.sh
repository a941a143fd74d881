#!/usr/bin/env bash
# The main job's agreement check: `teraio run` (gpt2-replay, 60% of its peak memory, 4 files)
# several times; per run the replayed and simulated iteration and stall times, then the medians
# and the ratio replayed / simulated. Extra arguments go to `teraio run` (e.g. --time-scale 0.5).
#
# Usage: RUNS=5 DIR=/tmp/teraio-agree bash benches/run-agreement.sh [teraio run options]
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-5}
DIR=${DIR:-/tmp/teraio-agree}
cargo build --release -q -p teraio-cli
mkdir -p "$DIR"
trap 'rm -rf "$DIR"' EXIT
out="$DIR/runs.jsonl"
: >"$out"
for r in $(seq "$RUNS"); do
  ./target/release/teraio run --json --dir "$DIR" "$@" | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)))' >>"$out"
  python3 - "$out" <<'PY'
import json, sys
v = [json.loads(l) for l in open(sys.argv[1])][-1]
r, s = v["replay"], v["simulated"]
print(f"run: array write {v['array']['write_bytes_per_s']/1e9:.2f} read {v['array']['read_bytes_per_s']/1e9:.2f} "
      f"both {v['array']['mixed_bytes_per_s']/1e9:.2f} GB/s | iteration replayed {r['iteration_time_s']:.2f} s "
      f"simulated {s['iteration_time_s']:.2f} s ideal {v['ideal_time_s']:.2f} s | stall replayed {r['stall_s']:.2f} s "
      f"simulated {s['stall_s']:.2f} s | verified {r['verified_tensors']} | ratio {r['iteration_time_s']/s['iteration_time_s']:.3f}")
PY
done
python3 - "$out" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
med = lambda xs: statistics.median(xs)
ratio = med([v["replay"]["iteration_time_s"] / v["simulated"]["iteration_time_s"] for v in runs])
print(f"medians over {len(runs)} runs: replayed {med([v['replay']['iteration_time_s'] for v in runs]):.2f} s, "
      f"simulated {med([v['simulated']['iteration_time_s'] for v in runs]):.2f} s, "
      f"ideal {med([v['ideal_time_s'] for v in runs]):.2f} s; stall replayed {med([v['replay']['stall_s'] for v in runs]):.2f} s, "
      f"simulated {med([v['simulated']['stall_s'] for v in runs]):.2f} s; replayed/simulated iteration time {ratio:.3f}")
PY
