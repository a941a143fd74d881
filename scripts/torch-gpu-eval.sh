#!/bin/bash
# The PyTorch evaluation on a GPU machine (no cargo there): the teraio wheel built elsewhere
# (`maturin build --release --locked -m bindings/python/Cargo.toml -o WHEELS`), this checkout's
# teraio.torch over it, then examples/train_gpt.py's modes, each in a fresh process, fp32, GPT
# 169 M parameters, 16 x 1024 tokens per step, a 6 GiB cap (docs/BENCHMARKS.md, "teraio.torch").
#
#   WHEELS=dir MODES=ideal,teraio-host,checkpointing,save_on_cpu,teraio-ssd \
#     bash scripts/torch-gpu-eval.sh OUT [train_gpt options...]
#
# GATHER_AB=1: teraio-host with and without the gather between steps, alternated twice.
# VARIANTS="name:train_gpt options;name:options;...": teraio-host once per variant, in this
#   order, ROUNDS times (default 1), e.g. VARIANTS="base:;w16:--teraio-workers 16"; a variant's
#   own --modes replaces the mode (VARIANTS="ideal:--modes ideal;ckpt:--modes checkpointing;t:");
#   a variant's `@wheels=DIR` runs it on the wheel in DIR instead of WHEELS (two engine builds
#   alternated in one command: VARIANTS="new:;old:@wheels=.devcarry/torch/tw-prev"); `@torchpy=DIR`
#   takes teraio.torch from DIR (a copy of bindings/python/python/teraio/torch of another commit)
#   instead of this checkout's.
# PyTorch's caching allocator runs with expandable segments (PYTORCH_CUDA_ALLOC_CONF below)
#   unless the options say otherwise (train_gpt.py --cuda-alloc-conf).
# DS=dir (default .devcarry/torch/ds, used when present): DeepSpeed for the zero-infinity mode,
#   its wheel (`DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation deepspeed==0.19.8`) and
#   its dependencies' cp312 wheels (`pip download --only-binary=:all: --python-version 3.12`);
#   AIO=dir (default .devcarry/torch/aio): Debian's libaio1 and libaio-dev unpacked
#   (`dpkg-deb -x`), for the async_io op DeepSpeed compiles at its first use (about a minute).
set -u
OUT=${1:?output folder}; shift
WHEELS=${WHEELS:-.devcarry/torch/tw}
export LD_LIBRARY_PATH="/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
site_of() { # wheel folder [teraio.torch folder] -> a folder with that wheel and the checkout's
  # (or the given) teraio.torch over it
  local s; s=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --target "$s" "$1"/*.whl 2>&1 | tail -1 >&2
  rm -rf "$s/teraio/torch"; cp -r "${2:-bindings/python/python/teraio/torch}" "$s/teraio/torch"
  echo "$s"
}
SITE=$(site_of "$WHEELS")
declare -A SITES=(["$WHEELS"]=$SITE)
export PYTHONPATH=$SITE PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
DS=${DS:-.devcarry/torch/ds} AIO=$(realpath -m "${AIO:-.devcarry/torch/aio}")/usr
DS_SITE=""
if [ -d "$DS" ]; then
  DS_SITE=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --target "$DS_SITE" "$DS"/*.whl 2>&1 | tail -1
  export PATH=$DS_SITE/bin:$PATH DS_SITE CPATH=$AIO/include LIBRARY_PATH=$AIO/lib/x86_64-linux-gnu
  export LD_LIBRARY_PATH=$AIO/lib/x86_64-linux-gnu:$LD_LIBRARY_PATH
  export TORCH_EXTENSIONS_DIR=/tmp/teraio-eval-ext CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
  # DeepSpeed's JIT builder cannot parse torch's "9.0a" architecture names
  export TORCH_CUDA_ARCH_LIST=9.0 PYTHONPATH=$SITE:$DS_SITE
fi
SSD=${SSD:-/var/tmp/teraio-eval}; mkdir -p "$SSD" "$OUT"
date -u; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
CONFIG="--layers 12 --hidden 1024 --heads 16 --vocab 8192 --seq 1024 --batch 16 --warmup 2 --dtype fp32
  --cap-gib 6 --host-gib 24 --ssd-dir $SSD --hw docs/torch-eval/traces/h200-one-disk.hw.json"
if [ -n "${VARIANTS:-}" ]; then
  IFS=';' read -ra VS <<< "$VARIANTS"
  for r in $(seq 1 "${ROUNDS:-1}"); do for v in "${VS[@]}"; do
    name=${v%%:*}; opts=${v#*:}; wheels=$WHEELS
    if [[ $opts =~ @wheels=([^[:space:]]+) ]]; then
      wheels=${BASH_REMATCH[1]}; opts=${opts/@wheels=$wheels/}
    fi
    key=$wheels py=""
    if [[ $opts =~ @torchpy=([^[:space:]]+) ]]; then
      py=${BASH_REMATCH[1]}; opts=${opts/@torchpy=$py/}; key="$wheels|$py"
    fi
    [ -n "${SITES[$key]:-}" ] || SITES[$key]=$(site_of "$wheels" "$py")
    # shellcheck disable=SC2086
    PYTHONPATH=${SITES[$key]}${DS_SITE:+:$DS_SITE} timeout "${VARIANT_S:-150}" python3 examples/train_gpt.py --modes "${VMODE:-teraio-host}" $CONFIG \
      --steps "${STEPS:-4}" --mode-timeout-s 130 $opts "$@" --out "$OUT/$name$r" > "$OUT/$name$r.log" 2>&1
    echo "== $name round $r ($opts)"; grep -E "teraio step [1-9]|Error|Traceback" "$OUT/$name$r.log" | cut -c1-700
    tail -n 1 "$OUT/$name$r/table.md"
  done; done
elif [ -n "${GATHER_AB:-}" ]; then
  for r in 1 2; do for g in gather nogather; do
    extra=""; [ $g = nogather ] && extra="--teraio-no-gather"
    timeout 150 python3 examples/train_gpt.py --modes teraio-host $CONFIG --steps 4 --mode-timeout-s 120 \
      $extra "$@" --out "$OUT/$g$r" > "$OUT/$g$r.log" 2>&1
    echo "== $g run $r"; grep -E "teraio step [2-9]|Error|Traceback" "$OUT/$g$r.log" | cut -c1-400
    grep "| teraio-host" "$OUT/$g$r/table.md"
  done; done
else
  timeout ${TRAIN_S:-560} python3 examples/train_gpt.py --modes "${MODES:-ideal,teraio-host,teraio-ssd}" $CONFIG \
    --steps "${STEPS:-3}" --mode-timeout-s "${MODE_S:-150}" "$@" --out "$OUT/fp32" > "$OUT/train.log" 2>&1
  echo "train rc=$?"; grep -E "teraio|Error|\] step|Traceback" "$OUT/train.log" | cut -c1-400 | tail -60
  cat "$OUT/fp32/table.md" 2>/dev/null
fi
rm -rf "$SSD" "${SITES[@]}" $DS_SITE; date -u
