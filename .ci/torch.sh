#!/usr/bin/env bash
# CI for teraio.torch (bindings/python/python/teraio/torch, examples/train_gpt.py): a fresh
# virtual environment with CPU PyTorch, the teraio wheel built from this checkout, and pytest on
# bindings/python/tests/torch. No GPU: the tests run the profiler, the plannable optimizer, the
# pager and Session on CPU tensors through a file-backed engine. About 6-9 minutes on 2 cores
# (PyTorch's download is most of it). Called by .ci/run; runnable alone from the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
step() { echo "=== torch: $* ($(( $(date +%s) - start ))s)"; }
# a venv of its own (5.5 GB with torch) is removed at the end, as is a wheel built here
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
VENV=${TERAIO_TORCH_VENV:-$scratch/venv}

step "venv with CPU torch"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# the CPU wheels when that index is reachable (smaller), else PyPI's default build
"$VENV/bin/pip" install -q torch --index-url https://download.pytorch.org/whl/cpu 2>/dev/null \
  || "$VENV/bin/pip" install -q torch
"$VENV/bin/pip" install -q numpy pytest maturin hypothesis transformers

step "the teraio wheel"
# The wheel .ci/bindings.sh built (TERAIO_WHEEL_DIR), else build it (maturin, dev profile:
# reuses .ci/run's cargo build).
if ! compgen -G "${TERAIO_WHEEL_DIR:-/nonexistent}/teraio-*.whl" >/dev/null; then
  TERAIO_WHEEL_DIR=$scratch/wheel; mkdir -p "$TERAIO_WHEEL_DIR"
  "$VENV/bin/maturin" build --locked -m bindings/python/Cargo.toml --profile dev -o "$TERAIO_WHEEL_DIR"
fi
"$VENV/bin/pip" install -q "$TERAIO_WHEEL_DIR"/teraio-*.whl

step "pytest bindings/python/tests/torch"
# from outside the repository, so `import teraio` is the installed wheel
repo=$PWD
cd "$(dirname "$VENV")"
TERAIO_REQUIRE_TORCH=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$repo/bindings/python/tests/torch"
step "done"
