#!/usr/bin/env bash
# Offload+prefetch throughput of the C ABI (bindings/c/examples/bench.c) and the Python package
# (benches/bindings_tensors.py) against `teraio bench --tensors`, on the same engine
# configuration file (the same files), with the same seeded tensor mix (log-uniform 1 MiB -
# 1 GiB, 60% of the array), alternated in rounds; prints medians and ratios. Each binding runs
# twice: with engine buffers (no copy, as the Rust benchmark) and with caller memory (malloc /
# numpy.empty: one copy each way).
#
# Usage: ROUNDS=5 DIR=/tmp/tbind SIZE=1G bash benches/bindings-vs-bench.sh
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
ROUNDS=${ROUNDS:-5}
DIR=${DIR:-/tmp/teraio-bindings-bench}
SIZE=${SIZE:-1G}
SEED=${SEED:-1}
cargo build --release -q --locked -p teraio-cli -p teraio-capi
venv=$DIR/venv
mkdir -p "$DIR"
trap 'rm -rf "$DIR/array" "$DIR/wheels"' EXIT
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check maturin numpy
fi
"$venv/bin/maturin" build -q --release --locked -m bindings/python/Cargo.toml -o "$DIR/wheels"
"$venv/bin/pip" install -q --force-reinstall --no-deps --disable-pip-version-check "$DIR"/wheels/teraio-*.whl
cc -std=c99 -O2 -Ibindings/c/include bindings/c/examples/bench.c -Ltarget/release -lteraio -lm \
  -o "$DIR/cbench"
cfg=$DIR/engine.toml
printf 'dir = "%s/array"\nfiles = 4\nfile_size = "%s"\noverwrite = "teraio"\n' "$DIR" "$SIZE" >"$cfg"
bin=target/release/teraio
export LD_LIBRARY_PATH=$repo/target/release
: >"$DIR/results.jsonl"
for r in $(seq "$ROUNDS"); do
  j=$($bin bench --tensors --config "$cfg" --seed "$SEED" --json | tr -d '\n')
  echo "{\"tool\": \"rust\", \"r\": $j}" >>"$DIR/results.jsonl"
  total=$(echo "$j" | python3 -c 'import json,sys; print(json.load(sys.stdin)["total_bytes"])')
  for mode in buffer copy; do
    echo "{\"tool\": \"c-$mode\", \"r\": $("$DIR/cbench" "$cfg" "$total" "$SEED" "$mode")}" >>"$DIR/results.jsonl"
    echo "{\"tool\": \"python-$mode\", \"r\": $("$venv/bin/python" benches/bindings_tensors.py "$cfg" "$total" "$SEED" "$mode")}" >>"$DIR/results.jsonl"
  done
  echo "round $r done"
done
python3 - "$DIR/results.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
by = {}
for row in rows:
    by.setdefault(row["tool"], []).append(row["r"])
rust = by["rust"]
shape = {(r["tensors"], r["min_tensor_bytes"], r["max_tensor_bytes"], r["total_bytes"]) for rs in by.values() for r in rs}
assert len(shape) == 1, f"the tools moved different tensor mixes: {shape}"
n, lo, hi, total = shape.pop()
print(f"{n} tensors, {total/1e9:.2f} GB ({lo/1e6:.1f} MB .. {hi/1e6:.1f} MB), {len(rust)} rounds, medians:")
med = lambda rs, k: statistics.median(r[k]["bw_bytes"] for r in rs)
base = {k: med(rust, k) for k in ("offload", "prefetch")}
print(f"{'tool':16} {'offload GB/s':>12} {'ratio':>6} {'prefetch GB/s':>13} {'ratio':>6}")
for tool, rs in by.items():
    o, p = med(rs, "offload"), med(rs, "prefetch")
    print(f"{tool:16} {o/1e9:12.2f} {o/base['offload']:6.2f} {p/1e9:13.2f} {p/base['prefetch']:6.2f}")
PY
