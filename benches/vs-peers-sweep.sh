#!/usr/bin/env bash
# The io_uring backend against fio (io_uring, huge-page buffers) across block sizes and queue
# depths: benches/vs-peers.sh once per (block size, queue depth per file), sequential write and
# read, rounds alternated, then one table of the medians and ratios.
#
# Environment (defaults): BSS="128k 1M 4M" QDS="4 16 64" ROUNDS=3 FILES=4 SIZE=1G
# TOOLS="teraio fio-uring-huge" (any of benches/vs-peers.sh's), DIR, TERAIO as there.
# Run from the repository root as root.
set -euo pipefail
BSS=${BSS:-"128k 1M 4M"}
QDS=${QDS:-"4 16 64"}
export ROUNDS=${ROUNDS:-3} FILES=${FILES:-4} SIZE=${SIZE:-1G}
export TOOLS=${TOOLS:-"teraio fio-uring-huge"} WORKLOADS="write read"
SWEEP=$(mktemp -d /tmp/teraio-sweep.XXXXXX)
for bs in $BSS; do for qd in $QDS; do
    echo "== bs $bs qd $qd" >&2
    mkdir -p "$SWEEP/$bs-$qd"
    OUT="$SWEEP/$bs-$qd" BS=$bs QD=$qd bash benches/vs-peers.sh > "$SWEEP/$bs-$qd.txt" 2> "$SWEEP/$bs-$qd.err" \
        || { echo "bs $bs qd $qd failed: $(tail -3 "$SWEEP/$bs-$qd.err")" >&2; continue; }
done; done
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')  files=$FILES size=$SIZE rounds=$ROUNDS tools: $TOOLS"
python3 - "$SWEEP" <<'PY'
import os, statistics, sys
root = sys.argv[1]
print(f"{'bs':>5} {'qd':>3} {'workload':8} " + " ".join(f"{t:>16}" for t in os.environ["TOOLS"].split()) + "   teraio/best")
for name in sorted(os.listdir(root), key=lambda n: (n.split('-')[0], n)):
    res = os.path.join(root, name, "results.txt")
    if not os.path.isfile(res):
        continue
    bs, qd = name.rsplit("-", 1)
    by = {}
    for line in open(res):
        wl, tool, _r, bw, _iops, _p99 = line.split()
        by.setdefault(wl, {}).setdefault(tool, []).append(float(bw))
    for wl, tools in by.items():
        med = {t: statistics.median(v) for t, v in tools.items()}
        peers = {t: b for t, b in med.items() if t != "teraio"}
        ratio = med["teraio"] / max(peers.values()) if peers and "teraio" in med else float("nan")
        cells = " ".join(f"{med.get(t, float('nan')) / 1e9:16.2f}" for t in os.environ["TOOLS"].split())
        print(f"{bs:>5} {qd:>3} {wl:8} {cells}   {ratio:.2f}x")
PY
