#!/usr/bin/env bash
# The Python buffer-protocol fuzz (bindings/python/tests/test_fuzz_buffers.py) for a while:
# rounds of EXAMPLES hypothesis examples per test, each round with its own seed (1, 2, ...),
# until MINUTES have passed; one line per round, and a total at the end. Any failing round stops
# the run with hypothesis's falsifying example.
#
#   PYTHON=/path/to/python [PYTHONPATH=...] scripts/fuzz-python-buffers.sh MINUTES [EXAMPLES]
#
# PYTHON is an interpreter with teraio (the wheel), numpy, pytest and hypothesis installed
# (default: python3). EXAMPLES defaults to 20000. Run it from anywhere; it runs pytest from a
# temporary folder so `import teraio` is the installed package, not the source tree.
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: $0 MINUTES [EXAMPLES]" >&2
    exit 2
fi
minutes=$1
examples=${2:-20000}
python=${PYTHON:-python3}
tests=$(cd "$(dirname "$0")/.." && pwd)/bindings/python/tests/test_fuzz_buffers.py
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
start=$(date +%s)
end=$((start + minutes * 60))
round=0
while [ "$(date +%s)" -lt "$end" ]; do
    round=$((round + 1))
    t0=$(date +%s)
    if ! out=$(TERAIO_PY_FUZZ_EXAMPLES=$examples TERAIO_PY_FUZZ_SEED=$round \
        "$python" -m pytest -q -p no:cacheprovider "--hypothesis-seed=$round" "$tests" 2>&1); then
        echo "$out"
        echo "round $round (seed $round): FAILED after $(( $(date +%s) - start )) s"
        exit 1
    fi
    echo "round $round (seed $round): $(echo "$out" | tail -1) in $(( $(date +%s) - t0 )) s"
done
tests_per_round=$("$python" -m pytest -q -p no:cacheprovider --collect-only "$tests" 2>/dev/null \
    | grep -c '::' || true)
echo "total: $round rounds x $tests_per_round tests x up to $examples examples, $(( $(date +%s) - start )) s, no failure"
