#!/usr/bin/env bash
# swap_vs_deepspeed.sh - zinf's swap-in (bench/swapin: the engine fetching every tensor from
# its NVMe home to the device tier, step after step, with the order it learned in step 1)
# against DeepSpeed's ZeRO-Infinity parameter-swapper pattern (bench/ds_swapper_bench.py:
# one file per parameter, two sets of page-locked buffers, batches read with async_pread
# while the previous batch is copied to its device tensor) and against zinf's own raw read
# (`zinf bench --read`), on the same directory, with the same tensors, block size and queue
# depth. Each round runs all three, zinf swap-in and DeepSpeed taking turns at going first
# and the raw read between them, ROUNDS times; prints each round, the medians, the spread
# (min-max) and the ratios zinf/DeepSpeed (target >= 1.0) and zinf/raw (target >= 0.9).
#
#   bench/swap_vs_deepspeed.sh DIR [ROUNDS]      (default 5)
#   ZINF=build/tools/zinf  SWAPIN=build/bench/swapin  VENV=/var/tmp/zinf-ds-venv
#   TENSORS=64  TENSOR_SIZE=32M  BLOCK=1M  QD=32  STEPS=5  BATCH=4
#   DEVICE_KIND=emulated|cuda  (default: cuda when torch sees a GPU, else emulated; the
#   DeepSpeed side then copies into CUDA tensors, or into host tensors)
#
# A round's figure for each swap-in side is the median GB/s (tensor bytes / step wall time)
# of steps 2..STEPS of its run; swapin runs with --no-raw (no pauses between its steps), so
# neither side gets idle time between steps. Both check 3 pages per tensor per step inside
# the timing; the raw read checks every word. All files are O_DIRECT: swapin's in
# DIR/zinf-swapin, DeepSpeed's in DIR/zero_stage_3, the raw file DIR/zinf-bench.dat
# (written once, with --keep); all are removed at the end.
#
# Sets up what it needs when missing, as bench/io_vs_deepspeed.sh does: libaio-dev (apt-get)
# and a venv with torch and deepspeed from PyPI (several GB, once); DeepSpeed builds its aio
# op on first use (minutes, once). Not part of the test suite; figures go to bench/RESULTS.md.
set -euo pipefail
dir=${1:?usage: bench/swap_vs_deepspeed.sh DIR [ROUNDS]}
rounds=${2:-5}
zinf=${ZINF:-build/tools/zinf}
swapin=${SWAPIN:-build/bench/swapin}
venv=${VENV:-/var/tmp/zinf-ds-venv}
tensors=${TENSORS:-64}
tsize=${TENSOR_SIZE:-32M}
block=${BLOCK:-1M}
qd=${QD:-32}
steps=${STEPS:-5}
batch=${BATCH:-4}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$dir"

. "$here/ds_env.sh"

bytes() { numfmt --from=iec "$1"; }
tbytes=$(bytes "$tsize")
bbytes=$(bytes "$block")
total=$((tensors * tbytes))
if [ -z "${DEVICE_KIND:-}" ]; then
  DEVICE_KIND=$("$py" -c 'import torch; print("cuda" if torch.cuda.is_available() else "emulated")')
fi
case $DEVICE_KIND in
  emulated) dsdev=cpu ;;
  cuda) dsdev=cuda ;;
  *) echo "DEVICE_KIND must be emulated or cuda" >&2; exit 2 ;;
esac
zdir="$dir/zinf-swapin"
rawfile="$dir/zinf-bench.dat"
raw_was_there=0; [ -e "$rawfile" ] && raw_was_there=1
cleanup() {
  rm -rf "$zdir" "$dir/zero_stage_3"
  [ "$raw_was_there" = 1 ] || rm -f "$rawfile"
}
trap cleanup EXIT

# One JSON field out of the lines on stdin (the last line that has it); "" when missing.
field() { "$py" -c '
import json, sys
v = ""
for line in sys.stdin:
    line = line.strip()
    if line.startswith("{"):
        o = json.loads(line)
        if sys.argv[1] in o:
            v = o[sys.argv[1]]
print(v if not isinstance(v, bool) else str(v).lower())' "$1"; }
# Median GB/s of swapin's step rows 2..N (tensor bytes, and bytes read from NVMe), and
# whether every row and the summary verified.
zinf_steps() { "$py" -c '
import json, statistics, sys
rows = [json.loads(l) for l in sys.stdin if l.startswith("{")]
steps = [r for r in rows if "step" in r]
ok = bool(rows) and all(r["verified"] for r in rows)
later = steps[1:] or steps
print("%.4f %.4f %s" % (statistics.median(r["GBps"] for r in later),
                        statistics.median(r["nvme_GBps"] for r in later), "true" if ok else "false"))'; }

ds_ver=$("$py" -c 'import importlib.metadata as m; print(m.version("deepspeed"), m.version("torch"))')
echo "# swap_vs_deepspeed: $tensors tensors x $tsize = $((total >> 20)) MiB per step, block $block, queue depth $qd, $steps steps, $rounds rounds"
echo "# $(uname -sr), $(nproc) cpus, load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# filesystem of DIR: $(df --output=source,fstype "$dir" | tail -n 1 | tr -s ' ')"
echo "# $("$zinf" version | head -n 1); deepspeed ${ds_ver% *}, torch ${ds_ver#* }, $("$py" -V)"
echo "# zinf: $swapin --device-kind $DEVICE_KIND --no-raw (fetch to the device tier, 3 pages checked per fetch)"
echo "# deepspeed: ds_swapper_bench.py, aio_handle($bbytes, $qd, single_submit=False, overlap_events=True, intra_op_parallelism=1), 2 x $batch pinned buffers, device tensors on $dsdev"
echo "# raw: $zinf bench --read, $((total >> 20)) MiB, same block and queue depth, every word checked"
echo "# GB/s: tensor bytes / step wall time, the median of steps 2..$steps of the run (raw: the whole read)"
echo "# zinf_nvme: bytes zinf read from NVMe / step wall time, same steps (tensors kept resident in its device tier are not read again; deepspeed reads every one)"
"$zinf" bench --path "$dir" --size "$total" --block-size "$block" --queue-depth "$qd" --write \
  --keep --json >/dev/null

run_zinf() {
  rm -rf "$zdir"
  local out
  out=$("$swapin" --path "$zdir" --device-kind "$DEVICE_KIND" --tensors "$tensors" \
        --tensor-size "$tsize" --block-size "$block" --queue-depth "$qd" --steps "$steps" \
        --no-raw --json) || { echo "swapin failed: $out" >&2; exit 1; }
  read -r z zn zok <<<"$(printf '%s\n' "$out" | zinf_steps)"
  [ "$zok" = true ] || { echo "swapin not verified: $out" >&2; exit 1; }
  rm -rf "$zdir"
}
run_ds() {
  local out
  out=$("$py" "$here/ds_swapper_bench.py" --path "$dir" --params "$tensors" --param-size "$tbytes" \
        --batch "$batch" --steps "$steps" --block-size "$bbytes" --queue-depth "$qd" \
        --device "$dsdev" 2>/dev/null) || { echo "deepspeed swapper failed: $out" >&2; exit 1; }
  [ "$(printf '%s\n' "$out" | field verified)" = true ] ||
    { echo "deepspeed swapper not verified: $out" >&2; exit 1; }
  d=$(printf '%s\n' "$out" | field median_GBps_after_first)
}
run_raw() {
  local out
  out=$("$zinf" bench --path "$dir" --size "$total" --block-size "$block" --queue-depth "$qd" \
        --read --keep --json)
  [ "$(printf '%s\n' "$out" | field verified)" = true ] || { echo "raw read not verified: $out" >&2; exit 1; }
  w=$(printf '%s\n' "$out" | field GBps)
}

zs= zns= ds= ws=
echo "# round  first   zinf_GB/s  zinf_nvme  deepspeed_GB/s  raw_GB/s  zinf/ds  zinf/raw"
for r in $(seq 1 "$rounds"); do
  if [ $((r % 2)) = 1 ]; then first=zinf; run_zinf; run_raw; run_ds
  else first=ds; run_ds; run_raw; run_zinf; fi
  zs+="$z "; zns+="$zn "; ds+="$d "; ws+="$w "
  printf '# %5s %6s %11.3f %10.3f %15.3f %9.3f %8.3f %9.3f\n' "$r" "$first" "$z" "$zn" "$d" "$w" \
    "$(ratio "$z" "$d")" "$(ratio "$z" "$w")"
done

read -r zm zlo zhi <<<"$(echo "$zs" | stats)"
read -r nm nlo nhi <<<"$(echo "$zns" | stats)"
read -r dm dlo dhi <<<"$(echo "$ds" | stats)"
read -r wm wlo whi <<<"$(echo "$ws" | stats)"
rd=$(ratio "$zm" "$dm")
rw=$(ratio "$zm" "$wm")
echo
printf '%-22s %8s %15s\n' side GB/s "min-max"
printf '%-22s %8.3f %15s\n' "zinf swap-in" "$zm" "$zlo-$zhi"
printf '%-22s %8.3f %15s\n' "zinf swap-in, NVMe" "$nm" "$nlo-$nhi"
printf '%-22s %8.3f %15s\n' "deepspeed swapper" "$dm" "$dlo-$dhi"
printf '%-22s %8.3f %15s\n' "zinf bench --read" "$wm" "$wlo-$whi"
echo "ratio zinf/deepspeed (medians): $rd (target >= 1.0: $(met "$rd" 1.0))"
echo "ratio zinf/raw read  (medians): $rw (target >= 0.9: $(met "$rw" 0.9)); NVMe bytes: zinf/deepspeed $(ratio "$nm" "$dm"), zinf/raw $(ratio "$nm" "$wm")"
echo "every step and read verified"
