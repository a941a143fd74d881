#!/usr/bin/env bash
# teraio bench vs fio on the same files, same block size and same total queue depth, A/B
# alternated, medians and ratios printed.
#
# fio runs in three configurations and the best one per workload is the peer:
#   fio-uring-huge   ioengine=io_uring, direct=1, buffers on huge pages (iomem=shmhuge)
#   fio-libaio-huge  ioengine=libaio,   direct=1, buffers on huge pages
#   fio-uring        ioengine=io_uring, direct=1, ordinary buffers
# Huge pages are reserved for the run (vm.nr_hugepages) and the old value restored on exit.
#
# Environment (defaults): FILES=4 SIZE=1G BS=1M QD=32 (per file) ROUNDS=3 RAND_BS=4k
# RAND_RUNTIME=10 DIR=./teraio-data TERAIO=target/release/teraio WORKLOADS="write read randread"
# TOOLS="teraio fio-uring-huge fio-libaio-huge fio-uring" (teraio first; a subset for sweeps)
#
# Run from the repository root as root (installing fio and reserving huge pages need it).
set -euo pipefail

FILES=${FILES:-4}
SIZE=${SIZE:-1G}
BS=${BS:-1M}
QD=${QD:-32}
ROUNDS=${ROUNDS:-3}
RAND_BS=${RAND_BS:-4k}
RAND_RUNTIME=${RAND_RUNTIME:-10}
DIR=${DIR:-./teraio-data}
TERAIO=${TERAIO:-target/release/teraio}
WORKLOADS=${WORKLOADS:-"write read randread"}
OUT=${OUT:-$(mktemp -d /tmp/teraio-vs-peers.XXXXXX)}

if ! command -v fio >/dev/null; then
    echo "installing fio" >&2
    apt-get update -qq >/dev/null && apt-get install -y -qq fio >/dev/null
fi
if [ ! -x "$TERAIO" ]; then
    echo "building teraio (release)" >&2
    cargo build -q --release -p teraio-cli
fi
command -v jq >/dev/null || { apt-get install -y -qq jq >/dev/null; }

# Huge pages: fio's shmhuge buffers and teraio's pool (MAP_HUGETLB) both need
# FILES * QD * BS bytes; reserve twice that in 2 MiB pages, plus slack.
to_bytes() { numfmt --from=iec "$(echo "$1" | tr 'a-z' 'A-Z' | sed 's/IB$//; s/B$//')"; }
bs_bytes=$(to_bytes "$BS")
need_pages=$(( (FILES * QD * bs_bytes * 2) / (2 * 1024 * 1024) + 64 ))
old_pages=$(cat /proc/sys/vm/nr_hugepages)
restore() { echo "$old_pages" > /proc/sys/vm/nr_hugepages 2>/dev/null || true; }
trap restore EXIT
if [ "$old_pages" -lt "$need_pages" ]; then
    echo "$need_pages" > /proc/sys/vm/nr_hugepages
fi
echo "huge pages reserved: $(grep HugePages_Total /proc/meminfo | awk '{print $2}') (wanted $need_pages)" >&2

mkdir -p "$DIR"
files=()
for i in $(seq 0 $((FILES - 1))); do files+=("$DIR/dev$i"); done

# Lay the files out once (written, not just preallocated, so reads touch the disk).
"$TERAIO" bench --dir "$DIR" --files "$FILES" --size "$SIZE" --bs "$BS" --iodepth "$QD" --rw write --json > /dev/null

fio_job() { # $1 rw  $2 bs  $3 engine  $4 iomem  $5 runtime(0 = size based)
    local f="$OUT/job.fio"
    {
        echo "[global]"
        echo "ioengine=$3"
        echo "direct=1"
        echo "rw=$1"
        echo "bs=$2"
        echo "iodepth=$QD"
        echo "size=$SIZE"
        echo "iomem=$4"
        echo "group_reporting=1"
        echo "randrepeat=0"
        if [ "$5" != 0 ]; then echo "time_based=1"; echo "runtime=$5"; fi
        for i in "${!files[@]}"; do echo "[f$i]"; echo "filename=${files[$i]}"; done
    } > "$f"
    fio --output-format=json "$f"
}

# Other processes on the machine may take reserved huge pages: top the reserve up so that one
# run's buffers (FILES * QD * BS, plus slack) are free before each run.
ensure_free_hugepages() {
    local want=$(( (FILES * QD * bs_bytes) / (2 * 1024 * 1024) + 32 ))
    local free total
    free=$(awk '/HugePages_Free/ {print $2}' /proc/meminfo)
    if [ "$free" -lt "$want" ]; then
        total=$(cat /proc/sys/vm/nr_hugepages)
        echo $(( total + want - free )) > /proc/sys/vm/nr_hugepages
    fi
}

run_one() { # $1 tool  $2 rw  $3 bs  $4 runtime  -> prints bw_bytes and iops of the main direction
    ensure_free_hugepages
    local dirn=read
    case "$2" in write|randwrite) dirn=write ;; esac
    local json
    case "$1" in
        fio-uring-huge)  json=$(fio_job "$2" "$3" io_uring shmhuge "$4") || return 1 ;;
        fio-libaio-huge) json=$(fio_job "$2" "$3" libaio shmhuge "$4") || return 1 ;;
        fio-uring)       json=$(fio_job "$2" "$3" io_uring malloc "$4") || return 1 ;;
        teraio)
            local rt=()
            [ "$4" != 0 ] && rt=(--runtime "$4")
            json=$("$TERAIO" bench --dir "$DIR" --files "$FILES" --size "$SIZE" --bs "$3" \
                --iodepth "$QD" --rw "$2" "${rt[@]}" --json) || return 1 ;;
    esac
    echo "$json" | jq -r ".jobs[0].$dirn | \"\(.bw_bytes) \(.iops) \(.clat_ns.percentile[\"99.000000\"] // 0)\""
}

read -r -a tools <<< "${TOOLS:-teraio fio-uring-huge fio-libaio-huge fio-uring}"
results="$OUT/results.txt"
: > "$results"
for wl in $WORKLOADS; do
    bs=$BS; rt=0
    if [ "$wl" = randread ] || [ "$wl" = randwrite ]; then bs=$RAND_BS; rt=$RAND_RUNTIME; fi
    for r in $(seq 1 "$ROUNDS"); do
        order=("${tools[@]}")
        if [ $((r % 2)) = 0 ]; then order=(); for ((i=${#tools[@]}-1; i>=0; i--)); do order+=("${tools[$i]}"); done; fi
        for t in "${order[@]}"; do
            if ! out=$(run_one "$t" "$wl" "$bs" "$rt") || [ -z "$out" ]; then
                echo "$wl $t $r: run failed, left out" >&2
                continue
            fi
            read -r bw iops p99 <<< "$out"
            echo "$wl $t $r $bw $iops $p99" | tee -a "$results" >&2
        done
    done
done

echo
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')  files=$FILES size=$SIZE bs=$BS (random: $RAND_BS, ${RAND_RUNTIME}s) iodepth=$QD per file, rounds=$ROUNDS"
python3 - "$results" <<'EOF'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
by = {}
for wl, tool, _r, bw, iops, p99 in rows:
    by.setdefault(wl, {}).setdefault(tool, []).append((float(bw), float(iops), float(p99)))
print(f"{'workload':10} {'tool':16} {'median GB/s':>11} {'median IOPS':>12} {'p99 clat us':>12}  runs (GB/s)")
for wl, tools in by.items():
    med = {}
    for tool, v in tools.items():
        bw = statistics.median(x[0] for x in v)
        iops = statistics.median(x[1] for x in v)
        p99 = statistics.median(x[2] for x in v)
        med[tool] = bw
        runs = " ".join(f"{x[0] / 1e9:.2f}" for x in v)
        print(f"{wl:10} {tool:16} {bw / 1e9:11.2f} {iops:12.0f} {p99 / 1e3:12.0f}  {runs}")
    peers = {t: b for t, b in med.items() if t != "teraio"}
    best = max(peers, key=peers.get)
    print(f"{wl:10} ratio teraio / best peer ({best}) = {med['teraio'] / peers[best]:.2f}x")
EOF
