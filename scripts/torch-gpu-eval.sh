#!/usr/bin/env bash
# The GPU evaluation of teraio.torch (issue 13): examples/train_gpt.py in every mode under one
# memory cap, in fp32 (TF32 off, the paper's setting) and in bf16 autocast, on the GPU machine
# (../shared/DEVICE.md). Run from the repository root on that machine; results go to $OUT
# (default ./gpu-eval) as gpu-eval.tgz of $RES: per setting a folder with one JSON per mode, table.md, losses.csv,
# memory.csv, train_gpt.png when matplotlib is there, and the profiled trace of the ideal run.
#
# Carried from the development machine (git-ignored, see docs/TORCH.md):
#   .devcarry/torch/wheels/  DeepSpeed 0.19.8 (built with `pip wheel --no-deps deepspeed==0.19.8`)
#                            and its pure or cp312 dependencies (pip download ...)
#   .devcarry/torch/aio/     libaio headers and library (Debian's libaio1 and libaio-dev)
# MODES_FP32 / MODES_BF16 / CONFIG / CAP_FP32_GIB / CAP_BF16_GIB override the defaults.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-eval}
RES=${RES:-/tmp/teraio-gpu-eval}  # the device tool brings back few files: results go here, $OUT gets an archive
mkdir -p "$OUT" "$RES"
exec > >(tee -a "$RES/eval.log") 2>&1
date -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# cuFile's udev fix (DEVICE.md): harmless when unused
mkdir -p /run/udev/data && printf 'I:1\nE:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE=ext4\n' > /run/udev/data/b254:0 || true

SITE=/tmp/teraio-eval-site
# .devcarry/torch/tw/: the teraio wheel (`maturin build --release -m bindings/python/Cargo.toml`)
for d in .devcarry/torch/wheels .devcarry/torch/tw; do
  if [ -d "$d" ]; then
    python3 -m pip install -q --no-index --no-deps --target "$SITE" "$d"/*.whl 2>&1 | tail -2
  fi
done
AIO=$PWD/.devcarry/torch/aio/usr
export PYTHONPATH=$SITE:$PWD/bindings/python/python${PYTHONPATH:+:$PYTHONPATH}
export PATH=$SITE/bin:$PATH
export CFLAGS="-I$AIO/include" LDFLAGS="-L$AIO/lib/x86_64-linux-gnu"
export CPATH=$AIO/include LIBRARY_PATH=$AIO/lib/x86_64-linux-gnu
export LD_LIBRARY_PATH=$AIO/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export TORCH_EXTENSIONS_DIR=/tmp/teraio-eval-ext
# DeepSpeed's JIT builder cannot parse torch's "9.0a" architecture names
# (the machine's environment sets it so): name the H200's plainly
export TORCH_CUDA_ARCH_LIST=9.0 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
SSD=${SSD:-/var/tmp/teraio-eval}
mkdir -p "$SSD"

CONFIG=${CONFIG:---layers 12 --hidden 1024 --heads 16 --vocab 8192 --seq 1024 --batch 16 --steps 4 --warmup 2}
MODES_FP32=${MODES_FP32-ideal,ideal-repeat,plain,save_on_cpu,checkpointing,zero-infinity}
MODES_BF16=${MODES_BF16-ideal,ideal-repeat,plain,save_on_cpu,checkpointing}
CAP_FP32_GIB=${CAP_FP32_GIB:-6}
CAP_BF16_GIB=${CAP_BF16_GIB:-4}

# shellcheck disable=SC2086
[ -n "$MODES_BF16" ] && python3 examples/train_gpt.py --modes "$MODES_BF16" $CONFIG --dtype bf16 --cap-gib "$CAP_BF16_GIB" \
  --ssd-dir "$SSD" --profile-dir "$RES/bf16" --out "$RES/bf16" --mode-timeout-s 120
# shellcheck disable=SC2086
[ -n "$MODES_FP32" ] && python3 examples/train_gpt.py --modes "$MODES_FP32" ${CONFIG_FP32:-$CONFIG} --dtype fp32 --cap-gib "$CAP_FP32_GIB" \
  --ssd-dir "$SSD" --profile-dir "$RES/fp32" --out "$RES/fp32" --mode-timeout-s ${ZERO_TIMEOUT_S:-300}
rm -rf "$SSD"
date -u
tar -C "$RES" -czf "$OUT/gpu-eval.tgz" .
cat "$RES"/*/table.md > "$OUT/tables.md" 2>/dev/null || true
