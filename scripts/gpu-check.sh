#!/usr/bin/env bash
# teraio's GPU data paths on a GPU machine (issue 11): the GPU unit tests, the device-side
# check (`teraio gpu-check`), then GPU <-> SSD throughput of both paths against KvikIO and the
# disk's own O_DIRECT bandwidth on the same 4 files, A/B alternated, page cache dropped.
#
# No cargo is needed there: build here and carry the binaries.
#   cargo build --release -p teraio-cli
#   cargo test --release -p teraio-engine --lib --no-run   # the engine's unit-test binary
#   scripts/gpu-check.sh BIN_DIR OUT_DIR   # BIN_DIR holds `teraio` and `engine-tests`
# Environment: DATA (folder on the disk under test, default ./teraio-gpu-data), ROUNDS (2),
# SIZES ("1M 64M 1G": tensor sizes), PER_FILE (bytes per file per phase, 1G), WHEELS (folder
# of KvikIO wheels to install, see docs/BENCHMARKS.md), QUICK=1 (tests only), SKIP_TESTS=1
# (benchmarks only).
set -uo pipefail
BIN=${1:?usage: gpu-check.sh BIN_DIR OUT_DIR}
OUT=${2:?usage: gpu-check.sh BIN_DIR OUT_DIR}
DATA=${DATA:-./teraio-gpu-data}
ROUNDS=${ROUNDS:-2}
SIZES=${SIZES:-"1M 64M 1G"}
PER_FILE=${PER_FILE:-1G}
mkdir -p "$OUT" "$DATA"
log() { echo "== $(date +%T) $*"; }
fails=0

# CUDA 13 libraries: the PyTorch venv's (libcufile.so.0) and the toolkit's (libcufile.so,
# libnvrtc.so.13).
export LD_LIBRARY_PATH="/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}"
# cuFile classifies the disk through udev; a VM without a udev database fails
# cuFileHandleRegister ("udev property not found: ID_FS_USAGE"). Describe the disk.
mkdir -p /run/udev/data 2>/dev/null
for d in "$(stat -c '%Hd:%Ld' "$DATA")" 254:0; do
  [ -e "/run/udev/data/b$d" ] || printf 'I:1\nE:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE=ext4\n' > "/run/udev/data/b$d" 2>/dev/null
done
drop() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null; }

log "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if [ -e /proc/driver/nvidia-fs ]; then echo "nvidia-fs loaded: cuFile can run peer to peer"; else echo "nvidia-fs not loaded: cuFile runs in compatibility mode"; fi
df -h "$DATA" | tail -1

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  log "engine GPU tests (ignored without a GPU, run here)"
  "$BIN/engine-tests" --ignored cuda:: --test-threads 1 2>&1 || fails=$((fails+1))
  log "teraio gpu-check"
  "$BIN/teraio" gpu-check --dir "$DATA/check" 2>&1 || fails=$((fails+1))
  rm -rf "$DATA/check"
fi
[ "${QUICK:-0}" = 1 ] && { echo "failures: $fails"; exit $((fails > 0)); }

if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/kvikio-site "$WHEELS"/*.whl && export PYTHONPATH=/tmp/kvikio-site
fi
B="$DATA/bench"; mkdir -p "$B"
J="$OUT/bench.jsonl"; : > "$J"
depth_for() { case $1 in 1M) echo 32;; 64M) echo 8;; *) echo 2;; esac; }
record() { # round bs what file
  if [ -s "$4" ] && python3 -c 'import json,sys; print(json.dumps({"round": int(sys.argv[2]), "bs": sys.argv[3], "what": sys.argv[4], "result": json.load(open(sys.argv[1]))}))' "$4" "$1" "$2" "$3" >> "$J" 2>/dev/null; then
    :
  else
    echo "no result for round $1 $2 $3"; cat "$4"; fails=$((fails+1))
  fi
}
gpu_bench() { # path bs depth [extra]
  "$BIN/teraio" bench --gpu 0 --gpu-path "$1" --dir "$B" --files 4 --size "$PER_FILE" --bs "$2" --iodepth "$3" --json "${@:4}"
}
for r in $(seq "$ROUNDS"); do
  for bs in $SIZES; do
    d=$(depth_for "$bs")
    if [ $((r % 2)) = 1 ]; then order="bounce gds kvikio disk"; else order="disk kvikio gds bounce"; fi
    for what in $order; do
      log "round $r: $bs tensors, $d in flight: $what"
      drop
      if [ "$what" = disk ]; then
        # the disk's own O_DIRECT bandwidth at this size and depth (host memory, no GPU): `bench`
        # counts its depth per file, the GPU paths in total, so d/4 per file (at least 1); a
        # block larger than a file (1G tensors over 512M files) is taken at the file's size
        dbs=$(numfmt --from=iec "$bs"); pf=$(numfmt --from=iec "$PER_FILE"); [ "$dbs" -gt "$pf" ] && dbs=$pf
        dd=$(( d / 4 > 0 ? d / 4 : 1 ))
        { "$BIN/teraio" bench --dir "$B" --files 4 --size "$PER_FILE" --bs "$dbs" --iodepth "$dd" --rw write --json > "$OUT/w.json" &&
          drop && "$BIN/teraio" bench --dir "$B" --files 4 --size "$PER_FILE" --bs "$dbs" --iodepth "$dd" --rw read --no-prefill --json > "$OUT/r.json" &&
          python3 -c 'import json,sys; w,r=(json.load(open(f)) for f in sys.argv[1:3]); w["jobs"]+=r["jobs"]; print(json.dumps(w))' "$OUT/w.json" "$OUT/r.json"; } > "$OUT/one.json" 2> "$OUT/one.err"
      elif [ "$what" = kvikio ]; then
        python3 "$(dirname "$0")/kvikio-bench.py" --files "$B"/dev0 "$B"/dev1 "$B"/dev2 "$B"/dev3 --bs "$bs" --iodepth "$d" --size "$PER_FILE" > "$OUT/one.json" 2> "$OUT/one.err"
      else
        gpu_bench "$what" "$bs" "$d" > "$OUT/one.json" 2> "$OUT/one.err"
      fi
      cat "$OUT/one.err" >&2
      record "$r" "$bs" "$what" "$OUT/one.json"
    done
  done
  log "round $r: the disk's own O_DIRECT bandwidth on the same files (host memory, 4M, qd 16)"
  drop; "$BIN/teraio" bench --dir "$B" --files 4 --size "$PER_FILE" --bs 4M --iodepth 16 --rw write --json > "$OUT/one.json" && record "$r" 4M disk-write "$OUT/one.json"
  drop; "$BIN/teraio" bench --dir "$B" --files 4 --size "$PER_FILE" --bs 4M --iodepth 16 --rw read --no-prefill --json > "$OUT/one.json" && record "$r" 4M disk-read "$OUT/one.json"
  log "round $r: GPU crc32c cost on the gds path (64M, checksums off then on)"
  drop; gpu_bench gds 64M 8 --no-checksums > "$OUT/one.json" && record "$r" 64M gds-nocrc "$OUT/one.json"
done

log "summary"
python3 - "$J" <<'PY' | tee "$OUT/summary.txt"
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def bw(row, d):
    r = row["result"]
    if row["what"] == "kvikio":
        return r[d + "_bw"]
    for j in r["jobs"]:
        if d in j and j[d]["io_bytes"] > 0:
            return j[d]["bw_bytes"]
    return None
med = lambda v: statistics.median(v) if v else float("nan")
disk_w = med([bw(r, "write") for r in rows if r["what"] == "disk-write"])
disk_r = med([bw(r, "read") for r in rows if r["what"] == "disk-read"])
print(f"disk O_DIRECT (4 files, 4M, qd16): write {disk_w/1e9:.2f} GB/s, read {disk_r/1e9:.2f} GB/s")
kv = [r for r in rows if r["what"] == "kvikio"]
if kv:
    k = kv[0]["result"]
    print(f"KvikIO {k['version']}: compat_mode={k['compat_mode']}, direct_io={k['direct_io']}, threads={k['threads']}, task_size={k['task_size']}")
g = [r for r in rows if r["what"] == "gds"]
if g:
    print("teraio gds path: cuFile", g[0]["result"]["gpu"]["cufile_mode"])
# "vs disk": the 4M qd16 reference above; "vs disk at size": the disk's own O_DIRECT at the
# tensors' size and depth (host memory), measured in the same rounds
print("| tensors | path | GPU->SSD GB/s | vs KvikIO | vs disk | vs disk at size | SSD->GPU GB/s | vs KvikIO | vs disk | vs disk at size | runs |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for bs in dict.fromkeys(r["bs"] for r in rows if r["what"] in ("gds", "bounce", "kvikio")):
    kw = med([bw(r, "write") for r in rows if r["bs"] == bs and r["what"] == "kvikio"])
    kr = med([bw(r, "read") for r in rows if r["bs"] == bs and r["what"] == "kvikio"])
    sw = med([bw(r, "write") for r in rows if r["bs"] == bs and r["what"] == "disk"])
    sr = med([bw(r, "read") for r in rows if r["bs"] == bs and r["what"] == "disk"])
    for what in ("bounce", "gds", "kvikio", "disk"):
        sel = [r for r in rows if r["bs"] == bs and r["what"] == what]
        if not sel:
            continue
        w = med([bw(r, "write") for r in sel]); rd = med([bw(r, "read") for r in sel])
        print(f"| {bs} | {what} | {w/1e9:.2f} | {w/kw:.2f}x | {w/disk_w:.2f}x | {w/sw:.2f}x | {rd/1e9:.2f} | {rd/kr:.2f}x | {rd/disk_r:.2f}x | {rd/sr:.2f}x | {len(sel)} |")
# paired per round (the machine's disk drifts between rounds): bounce / KvikIO in the same round
for bs in dict.fromkeys(r["bs"] for r in rows if r["what"] == "bounce"):
    by = {(r["round"], r["what"]): r for r in rows if r["bs"] == bs}
    pairs = [(by[(k, "bounce")], by[(k, "kvikio")]) for k, w in by if w == "bounce" and (k, "kvikio") in by]
    if pairs:
        pw = sorted(bw(b, "write") / bw(k, "write") for b, k in pairs)
        pr = sorted(bw(b, "read") / bw(k, "read") for b, k in pairs)
        print(f"{bs} bounce / KvikIO per round: write " + " ".join(f"{x:.2f}" for x in pw)
              + f" (median {med(pw):.2f}), read " + " ".join(f"{x:.2f}" for x in pr) + f" (median {med(pr):.2f})")
on = [r for r in rows if r["what"] == "gds" and r["bs"] == "64M"]
off = [r for r in rows if r["what"] == "gds-nocrc"]
if on and off:
    tw_on, tw_off = med([bw(r, "write") for r in on]), med([bw(r, "write") for r in off])
    tr_on, tr_off = med([bw(r, "read") for r in on]), med([bw(r, "read") for r in off])
    crc = med([r["result"]["gpu"]["gpu_crc_s"] for r in on])
    print(f"GPU crc32c (gds, 64M): throughput with/without checksums: write {tw_on/tw_off:.3f}, read {tr_on/tr_off:.3f}; crc calls took {crc:.3f} s summed over the operations (they overlap)")
PY
rm -f "$OUT/one.json" "$OUT/one.err" "$OUT/w.json" "$OUT/r.json"
log "done: $fails failure(s)"
exit $((fails > 0))
