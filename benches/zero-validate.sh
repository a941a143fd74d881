#!/usr/bin/env bash
# The simulator's side of the ZeRO-Infinity check: the three models that
# benches/gpu/zero_infinity_ds.py trains with real DeepSpeed on a GPU machine, simulated on a
# hardware model of that machine (H200, one disk at the read/write bandwidth DeepSpeed's aio
# handle measured there, DeepSpeed's CPU-Adam rate measured there, PCIe 55 GB/s). Prints, per
# model, the modelled iteration and CPU step of `zero-infinity` and the ideal iteration, to be
# set beside the measured ones (docs/BENCHMARKS.md).
# Usage: bash benches/zero-validate.sh [READ_GB_S WRITE_GB_S CPU_ADAM_PARAMS_PER_S]
#   (TERAIO=path/to/teraio to run another build, e.g. an older model)
#   defaults: the figures measured on the nvidia-h200 device machine on 2026-11-30.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p teraio-cli
T=${TERAIO:-target/release/teraio}
READ=${1:-1.49}
WRITE=${2:-2.40}
ADAM=${3:-3.41e9}
HW=$(mktemp --suffix=.json)
trap 'rm -f "$HW"' EXIT
cat >"$HW" <<EOF
{"gpu_memory_bytes": 141000000000, "ssd_count": 1, "ssd_read_bytes_per_s": ${READ}e9,
 "ssd_write_bytes_per_s": ${WRITE}e9, "ssd_latency_us": 80.0, "pcie_h2d_bytes_per_s": 55e9,
 "pcie_d2h_bytes_per_s": 55e9, "host_memory_cap_bytes": 128000000000,
 "host_memory_bytes_per_s": 100e9, "gpudirect": false, "cpu_adam_params_per_s": $ADAM}
EOF
# hidden layers heads kv-heads ffn, as zero_infinity_ds.py's --hidden ... --ffn
for shape in "1024 8 16 8 2816" "2048 16 16 8 5632" "2560 24 20 4 6912"; do
  read -r h l a kv f <<<"$shape"
  spec="llama3-8b,hidden=$h,layers=$l,heads=$a,kv-heads=$kv,ffn=$f,vocab=32000,seq=2048"
  spec="$spec,micro-batch=4,micro-batches=2,gpu=h200"
  $T simulate "preset:$spec" --hw "$HW" --checkpointed-trace "preset:$spec,activation-checkpointing" \
    --policy ideal,zero-infinity --json | python3 -c "
import json, sys
r = {x['policy'].rstrip('*'): x for x in json.load(sys.stdin)}
z = r['zero-infinity']
print('hidden=$h layers=$l: ideal %.3f s, zero-infinity %.3f s (CPU step %.3f s, stall %.3f s)' % (
    r['ideal']['iteration_time_us'] / 1e6, z['iteration_time_us'] / 1e6,
    z['host_step_us'] / 1e6, z['stall_us'] / 1e6))"
done
