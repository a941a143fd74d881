#!/usr/bin/env bash
# Migration throughput through the tensor store (`teraio bench --tensors`: log-uniform 1 MiB -
# 1 GiB tensors, offload all then prefetch all, crc32c on) against raw sequential 1 MiB I/O
# (`teraio bench --rw write|read`) on the same files, alternated A/B; prints medians and ratios.
#
# Usage: ROUNDS=5 DIR=/tmp/tstore SIZE=1G bash benches/store-vs-bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-5}
DIR=${DIR:-/tmp/teraio-store-bench}
SIZE=${SIZE:-1G}
cargo build --release -q -p teraio-cli
bin=./target/release/teraio
mkdir -p "$DIR"
trap 'rm -rf "$DIR"' EXIT
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
: >"$DIR/sw"; : >"$DIR/sr"; : >"$DIR/rw"; : >"$DIR/rr"
for r in $(seq "$ROUNDS"); do
  j=$($bin bench --tensors --dir "$DIR" --size "$SIZE" --json)
  echo "$j" | python3 -c 'import json,sys; v=json.load(sys.stdin); print(v["offload"]["bw_bytes"])' >>"$DIR/sw"
  echo "$j" | python3 -c 'import json,sys; v=json.load(sys.stdin); print(v["prefetch"]["bw_bytes"])' >>"$DIR/sr"
  $bin bench --rw write --dir "$DIR" --size "$SIZE" --json |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["jobs"][0]["write"]["bw_bytes"])' >>"$DIR/rw"
  $bin bench --rw read --dir "$DIR" --size "$SIZE" --json |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["jobs"][0]["read"]["bw_bytes"])' >>"$DIR/rr"
  echo "round $r: store write $(tail -1 "$DIR/sw") read $(tail -1 "$DIR/sr"); raw write $(tail -1 "$DIR/rw") read $(tail -1 "$DIR/rr") (bytes/s)"
done
sw=$(median <"$DIR/sw"); sr=$(median <"$DIR/sr"); rw=$(median <"$DIR/rw"); rr=$(median <"$DIR/rr")
python3 - "$sw" "$sr" "$rw" "$rr" <<'PY'
import sys
sw, sr, rw, rr = map(float, sys.argv[1:])
print(f"medians over the rounds (GB/s): store offload {sw/1e9:.2f}, raw write {rw/1e9:.2f}, ratio {sw/rw:.2f}x")
print(f"                                store prefetch {sr/1e9:.2f}, raw read {rr/1e9:.2f}, ratio {sr/rr:.2f}x")
PY
