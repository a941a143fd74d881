#!/usr/bin/env bash
# teraio bench on the SPDK backend (an SPDK uring bdev over a file, busy-polling; and an SPDK aio
# bdev in SPDK's interrupt mode, `spdk-intr`) vs the io_uring backend vs fio (io_uring,
# O_DIRECT, huge-page buffers) on the same file: 1 MiB sequential read and write
# and 4 KiB random reads, queue depth 32, rounds alternated, medians of bandwidth, IOPS and CPU
# time per I/O (the process's user + system time over the run: SPDK's reactor busy-polls a
# core). Needs a build with the `spdk` feature (docs/SPDK.md):
#   PKG_CONFIG_PATH=$PREFIX/lib/pkgconfig cargo build --release -p teraio-cli --features spdk
#
# Environment (defaults): FILE=target/bench-spdk/f0 SIZE=1G ROUNDS=3 RUNTIME=4 QD=32
# TERAIO=target/release/teraio WORKLOADS="read write randread" TOOLS="uring spdk spdk-intr fio"
# (also: spdk-aio, the aio bdev busy-polling; spdk-nap, the uring bdev polling with naps of
# NAP_US=50 microseconds, `poll_sleep_us` in [spdk]; fio-fixed, fio with registered buffers and file as
# teraio's io_uring backend uses them). Rounds alternate the order of TOOLS (odd rounds
# as listed, even rounds reversed). Run as root (huge pages).
set -euo pipefail
FILE=${FILE:-target/bench-spdk/f0}
SIZE=${SIZE:-1G}
ROUNDS=${ROUNDS:-3}
RUNTIME=${RUNTIME:-4}
QD=${QD:-32}
TERAIO=${TERAIO:-target/release/teraio}
WORKLOADS=${WORKLOADS:-"read write randread"}
read -r -a tools <<< "${TOOLS:-uring spdk spdk-intr fio}"
OUT=$(mktemp -d /tmp/teraio-spdk-vs-uring.XXXXXX)
printf '[spdk]\npoll_sleep_us = %s\n' "${NAP_US:-50}" > "$OUT/nap.toml"
command -v fio >/dev/null || { apt-get update -qq && apt-get install -y -qq fio >/dev/null; }
old_pages=$(cat /proc/sys/vm/nr_hugepages)
trap 'echo "$old_pages" > /proc/sys/vm/nr_hugepages' EXIT
[ "$old_pages" -ge 128 ] || echo 128 > /proc/sys/vm/nr_hugepages  # fio's shmhuge buffers
mkdir -p "$(dirname "$FILE")"
"$TERAIO" bench --backend uring --device "$FILE" --create --file-size "$SIZE" --force --rw write --bs 1M \
    --iodepth "$QD" --size "$SIZE" --json > /dev/null  # lay the file out (written, not sparse)

run() { # tool rw bs -> "bw iops cpu_us_per_io"
    local dirn=read; [ "$2" = write ] && dirn=write
    local args=(--backend "$1" --device "$FILE")
    case "$1" in
        spdk-aio) args=(--backend spdk --device "aio:$FILE") ;;
        spdk-intr) args=(--backend spdk --device "aio:$FILE" --spdk-interrupt) ;;
        spdk-nap) args=(--backend spdk --device "$FILE" --config "$OUT/nap.toml") ;;
    esac
    case "$1" in
        uring|spdk|spdk-aio|spdk-intr|spdk-nap)
            "$TERAIO" bench "${args[@]}" --file-size "$SIZE" --rw "$2" --bs "$3" \
                --iodepth "$QD" --size "$SIZE" --runtime "$RUNTIME" --json 2>/dev/null \
            | jq -r ".jobs[0] | \"\(.$dirn.bw_bytes) \(.$dirn.iops) \(.cpu_us_per_io)\"" ;;
        fio|fio-fixed)
            local fixed=(); [ "$1" = fio-fixed ] && fixed=(--fixedbufs=1 --registerfiles=1)
            fio --output-format=json --name=f --filename="$FILE" --direct=1 --ioengine=io_uring \
                "${fixed[@]}" --iomem=shmhuge --rw="$2" --bs="$3" --iodepth="$QD" --size="$SIZE" --time_based=1 \
                --runtime="$RUNTIME" --randrepeat=0 \
            | jq -r ".jobs[0] | \"\(.$dirn.bw_bytes) \(.$dirn.iops) \(((.usr_cpu + .sys_cpu) / 100 * .job_runtime * 1000) / ([.$dirn.total_ios, 1] | max))\"" ;;
    esac
}
reversed=(); for ((i = ${#tools[@]} - 1; i >= 0; i--)); do reversed+=("${tools[i]}"); done
echo "start: $(date -u '+%Y-%m-%d %H:%M UTC') load: $(cut -d' ' -f1-3 /proc/loadavg)"
for wl in $WORKLOADS; do
    bs=1M; [ "$wl" = randread ] && bs=4k
    for r in $(seq 1 "$ROUNDS"); do
        order=("${tools[@]}"); [ $((r % 2)) = 0 ] && order=("${reversed[@]}")
        for t in "${order[@]}"; do
            out=$(run "$t" "$wl" "$bs") || { echo "$wl $t $r failed" >&2; continue; }
            echo "$wl $t $r $out" | tee -a "$OUT/results.txt" >&2
        done
    done
done
echo "end: $(date -u '+%Y-%m-%d %H:%M UTC')  file=$FILE size=$SIZE qd=$QD runtime=${RUNTIME}s rounds=$ROUNDS load: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$OUT/results.txt" <<'PY'
import statistics, sys
by = {}
rounds = {}
for line in open(sys.argv[1]):
    wl, tool, r, bw, iops, cpu = line.split()
    by.setdefault(wl, {}).setdefault(tool, []).append((float(bw), float(iops), float(cpu)))
    rounds.setdefault((wl, r), {})[tool] = float(bw)
print(f"{'workload':9} {'tool':6} {'MB/s':>8} {'IOPS':>9} {'CPU us/IO':>10}  runs (MB/s)")
for wl, tools in by.items():
    med = {}
    for tool, v in tools.items():
        m = [statistics.median(x[i] for x in v) for i in range(3)]
        med[tool] = m[0]
        print(f"{wl:9} {tool:6} {m[0] / 1e6:8.0f} {m[1]:9.0f} {m[2]:10.1f}  " + " ".join(f"{x[0] / 1e6:.0f}" for x in v))
    nan = float("nan")
    print(f"{wl:9} " + ", ".join(f"{t} / fio = {med[t] / med.get('fio', nan):.2f}x" for t in med if t != "fio")
          + (f", spdk / uring = {med['spdk'] / med['uring']:.2f}x" if "spdk" in med and "uring" in med else "")
          + (f", spdk-intr / spdk = {med['spdk-intr'] / med['spdk']:.2f}x" if "spdk-intr" in med and "spdk" in med else ""))
    # Paired: each tool against fio of the same round (the disk drifts between rounds).
    for t in med:
        if t == "fio":
            continue
        q = sorted(v[t] / v["fio"] for (w, _), v in rounds.items() if w == wl and t in v and "fio" in v)
        if q:
            print(f"{wl:9} {t} / fio per round: median {statistics.median(q):.2f}x, "
                  f"range {q[0]:.2f}-{q[-1]:.2f}x, rounds >= 0.95x: {sum(x >= 0.95 for x in q)} of {len(q)}")
    # Each SPDK variant against the io_uring backend: ratio of medians and of the same round.
    for t in med:
        if not t.startswith("spdk") or "uring" not in med:
            continue
        q = sorted(v[t] / v["uring"] for (w, _), v in rounds.items() if w == wl and t in v and "uring" in v)
        print(f"{wl:9} {t} / uring = {med[t] / med['uring']:.2f}x; per round: median "
              f"{statistics.median(q):.2f}x, range {q[0]:.2f}-{q[-1]:.2f}x, "
              f"rounds >= 0.95x: {sum(x >= 0.95 for x in q)} of {len(q)}")
PY
