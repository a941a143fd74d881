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
VENV=${TERAIO_TORCH_VENV:-$(mktemp -d)/venv}

step "venv with CPU torch"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# the CPU wheels when that index is reachable (smaller), else PyPI's default build
"$VENV/bin/pip" install -q torch --index-url https://download.pytorch.org/whl/cpu 2>/dev/null \
  || "$VENV/bin/pip" install -q torch
"$VENV/bin/pip" install -q numpy pytest

step "the teraio wheel (maturin, from bindings/python)"
"$VENV/bin/pip" install -q ./bindings/python

step "pytest bindings/python/tests/torch"
cd bindings/python/tests/torch
"$VENV/bin/python" -m pytest -q -p no:cacheprovider .
step "done"
