#!/usr/bin/env bash
# What FSDP2 over N ranks, each rank with its own SSD array and host tier, would give with
# teraio: the simulator's table of docs/FSDP.md (issue 35). For each rank count, one rank's
# trace of the model (its 1/N shards, FSDP's gathered parameters kept in GPU memory, the
# all-gathers and reduce-scatters on the link) is planned and simulated on one rank's hardware
# model: ideal (unlimited memory), teraio (auto), teraio with the optimizer placed, teraio
# waiting for each collective (as teraio.torch runs FSDP2 today), and FSDP2's CPUOffloadPolicy.
# Simulator figures, not measurements.
#
# Usage: bash benches/fsdp-ranks.sh [MODEL_SPEC [CAP_GB [RANKS]]] [-- more `teraio simulate` options]
#   defaults: llama3-8b,dtype=bf16,gpu=h100-sxm,micro-batch=1 (Llama3-8B in bf16 on H100 SXM,
#   4 micro-batches of one 4096-token sequence per rank and step), caps 40 and 80 GB per rank,
#   ranks 1,2,4,8, the `paper` hardware per rank (4 SSDs x 6.7/6.5 GB/s, PCIe Gen5 50 GB/s,
#   128 GB host tier, CPU AdamW 4e9 params/s), link 350 GB/s (link-gbps=N in the spec: another).
#   TERAIO=path/to/teraio runs another build (default: target/release/teraio, built here).
#   Prints the text tables; add `-- --json` for JSON.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${TERAIO:-}" ]; then
  cargo build --release -q -p teraio-cli
fi
T=${TERAIO:-target/release/teraio}
SPEC=llama3-8b,dtype=bf16,gpu=h100-sxm,micro-batch=1
CAPS="40 80"
RANKS=1,2,4,8
if [ $# -gt 0 ] && [ "$1" != "--" ]; then SPEC=$1; shift; fi
if [ $# -gt 0 ] && [ "$1" != "--" ]; then CAPS=$1; shift; fi
if [ $# -gt 0 ] && [ "$1" != "--" ]; then RANKS=$1; shift; fi
if [ $# -gt 0 ] && [ "$1" = "--" ]; then shift; fi
for cap in $CAPS; do
  echo "\$ teraio simulate preset:$SPEC --fsdp-ranks $RANKS --gpu-mem-gb $cap${*:+ $*}"
  "$T" simulate "preset:$SPEC" --fsdp-ranks "$RANKS" --gpu-mem-gb "$cap" "$@"
  echo
done
