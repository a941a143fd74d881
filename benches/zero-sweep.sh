#!/usr/bin/env bash
# teraio vs the ZeRO-Infinity baseline across the paper's range of batch and sequence
# (llama3-8b, fp32 and TF32 matmuls, paper hardware). Prints one line per configuration:
# iteration seconds of teraio, teraio-hybrid and ideal on the plain trace, and of teraio,
# teraio-hybrid, zero-infinity and zero-infinity-pipelined on the activation-checkpointed one.
# Usage: bash benches/zero-sweep.sh [OUT_DIR]   (builds the release binary first)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p teraio-cli
T=target/release/teraio
OUT=${1:-$(mktemp -d)}
mkdir -p "$OUT"
times() {
  python3 -c "import json,sys; print(' '.join('refused' if 'refused' in x else
    '%.3f' % (x['iteration_time_us'] / 1e6) if x['outcome']['outcome'] == 'completed' else 'OOM'
    for x in json.load(sys.stdin)))"
}
for d in fp32 tf32; do
  for seq in 1024 4096 8192; do
    for bs in 16 64; do
      mb=$((16384 / seq)); ((mb < 1)) && mb=1; ((mb > bs)) && mb=$bs
      n=$((bs / mb))
      f=$OUT/l8-$d-$seq-$bs
      gen=(trace gen --model llama3-8b --dtype "$d" --seq "$seq" --micro-batch "$mb" --micro-batches "$n")
      $T "${gen[@]}" -o "$f.json" 2>/dev/null
      $T "${gen[@]}" --activation-checkpointing -o "$f-ck.json" 2>/dev/null
      a=$($T simulate "$f.json" --policy teraio,teraio-hybrid,ideal --json | times)
      b=$($T simulate "$f-ck.json" --policy teraio,teraio-hybrid,zero-infinity,zero-infinity-pipelined --json | times)
      echo "$d seq=$seq bs=$bs mb=${mb}x$n plain[teraio hybrid ideal]= $a ckpt[teraio hybrid zero zero-pipe]= $b"
    done
  done
done
