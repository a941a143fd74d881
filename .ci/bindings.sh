#!/usr/bin/env bash
# CI of the C ABI and the Python package; standalone (installs what it needs), meant to run
# after the cargo tests of .ci/run (it reuses their dev-profile build):
#  - the C example compiled with the system C compiler against libteraio.so and libteraio.a and
#    run, the host optimizer's example (optim.c) run, the benchmark loop compiled, the header
#    compiled as C++ (c++ -fsyntax-only);
#  - the Python wheel built with maturin, installed into a fresh virtual environment, pytest.
# (That include/teraio.h matches the code is a cargo test: teraio-capi's tests/header.rs.)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
export CARGO_TERM_COLOR=never
start=$(date +%s)
step() { echo "=== bindings: $* ($(( $(date +%s) - start ))s)"; }

step "tools"
missing=()
command -v cc >/dev/null || missing+=(gcc)
command -v c++ >/dev/null || missing+=(g++)
python3 -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
if ((${#missing[@]})); then
  apt-get update -qq && apt-get install -y -qq "${missing[@]}"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

step "C ABI: libteraio (dev profile)"
cargo build --locked -p teraio-capi
lib="$repo/target/debug"
inc="$repo/bindings/c/include"

step "C: roundtrip.c against the shared library"
cc -std=c99 -Wall -Wextra -Werror -pedantic -I"$inc" bindings/c/examples/roundtrip.c \
  -L"$lib" -lteraio -o "$work/roundtrip"
LD_LIBRARY_PATH="$lib" "$work/roundtrip" "$work/rt-shared"

step "C: roundtrip.c against the static library"
cc -std=c99 -Wall -Wextra -Werror -I"$inc" bindings/c/examples/roundtrip.c "$lib/libteraio.a" \
  -lpthread -ldl -lm -lrt -lgcc_s -o "$work/roundtrip-static"
"$work/roundtrip-static" "$work/rt-static"

step "C: bench.c compiles"
cc -std=c99 -O2 -Wall -Wextra -Werror -I"$inc" bindings/c/examples/bench.c -L"$lib" -lteraio -lm \
  -o "$work/bench"

step "C: optim.c (the host optimizer, bitwise against the update rule) against the shared library"
cc -std=c99 -O2 -ffp-contract=off -Wall -Wextra -Werror -pedantic -I"$inc" \
  bindings/c/examples/optim.c -L"$lib" -lteraio -lm -o "$work/optim"
LD_LIBRARY_PATH="$lib" "$work/optim"

step "C++: the header as is"
c++ -std=c++11 -Wall -Wextra -Werror -fsyntax-only -I"$inc" bindings/c/examples/header_check.cpp

step "Python: fresh virtual environment"
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q --disable-pip-version-check maturin pytest numpy hypothesis

step "Python: wheel (maturin, dev profile)"
wheels=${TERAIO_WHEEL_DIR:-$work/wheels}
"$work/venv/bin/maturin" build --locked -m bindings/python/Cargo.toml --profile dev -o "$wheels"
"$work/venv/bin/pip" install -q --disable-pip-version-check "$wheels"/teraio-*.whl

step "Python: pytest (teraio.torch's tests are .ci/torch.sh's: they need PyTorch)"
# From outside the repository, so `import teraio` is the installed wheel.
(cd "$work" && "$work/venv/bin/python" -m pytest -q -p no:cacheprovider \
  --ignore="$repo/bindings/python/tests/torch" "$repo/bindings/python/tests")

step "done"
