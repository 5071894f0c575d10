#!/usr/bin/env bash
# scale.sh - what offloading costs as the model grows: `zinf train` with everything on NVMe
# under fixed small budgets against the same model in memory, for model states from about
# 64 MiB to 4 GiB, with the tokens per step fixed, so compute grows with the parameters and
# the bytes moved grow with the state. Per size: step time offloaded and in memory (median
# of steps 2..STEPS), their ratio, the NVMe GB/s the offloaded step reached (read + write)
# next to `zinf bench` on the same path, and the share of the step blocked on fetch.
# Losses of the two runs must be bitwise equal; a size where they are not is marked.
# A size whose state is more than MEM_FRACTION (0.4) of this machine's RAM runs offloaded
# only (in memory it would not fit): past RAM is where offloading is the only way. Each
# offloaded run also says its tokens/s, the NVMe GB it moved per step, the IO floor (those
# bytes over `zinf bench`'s read and write rates, same run), the peak RSS of the process
# (getrusage), and its first and last losses.
#
# usage: bench/scale.sh DIR [STEPS]   (default 3)
#   ZINF=build/tools/zinf  SHAPES="6x256 8x640 12x768 24x960" (layers x dim; heads = dim/64)
#   SEQ=128 BATCH=16  DEVICE_BYTES=160M HOST_BYTES=320M (the offloaded run's budgets; the
#   device budget must hold one block's working set at the largest dim)
#   LR=1e-5 (a few steps from scratch at these sizes: 1e-4 and above make the loss jump)
#   CHECKPOINT_START=true (false: zinf.train.checkpoint_start false, so that the swap files
#   hold the state once, not twice: what a state past half the disk needs)
#   BLOCK=1M QD=32  PLOT=FILE.png (default DIR/scale.png; gnuplot draws step time, in memory
#   and offloaded, against the model state; PLOT= draws nothing)
set -euo pipefail

dir=${1:?usage: bench/scale.sh DIR [STEPS]}
steps=${2:-3}
zinf=${ZINF:-build/tools/zinf}
shapes=${SHAPES:-"6x256 8x640 12x768 24x960"}
T=${SEQ:-128} B=${BATCH:-16}
dev=${DEVICE_BYTES:-160M} host=${HOST_BYTES:-320M}
block=${BLOCK:-1M} qd=${QD:-32}
memfrac=${MEM_FRACTION:-0.4}
lr=${LR:-1e-5}
cstart=${CHECKPOINT_START:-true}
ram=$(awk '/MemTotal/ { print $2 * 1024 }' /proc/meminfo)
data=${DATA:-/usr/share/common-licenses/GPL-3}
plot=${PLOT-$dir/scale.png}
swap=$dir/scale-swap
tmp=$(mktemp -d)
trap 'rm -rf "$tmp" "$swap"' EXIT
mkdir -p "$swap"

cat > "$tmp/mem.json" <<JSON
{"zero_optimization": {"stage": 3, "offload_param": {"device": "none"},
 "offload_optimizer": {"device": "none"}},
 "zinf": {"device": "emulated", "device_bytes": "12G", "host_bytes": "2G"}}
JSON
cat > "$tmp/nvme.json" <<JSON
{"zero_optimization": {"stage": 3,
 "offload_param": {"device": "nvme", "nvme_path": "$swap", "pin_memory": true},
 "offload_optimizer": {"device": "nvme", "nvme_path": "$swap", "pin_memory": true}},
 "aio": {"block_size": $(numfmt --from=iec "$block"), "queue_depth": $qd},
 "zinf": {"device": "emulated", "device_bytes": "$dev", "host_bytes": "$host",
          "train": {"checkpoint_start": $cstart}}}
JSON

run() { # config layers dim log -> "ms_median rd_GBps wr_GBps blocked state losses rss rd_GB wr_GB tok/s"
  local heads=$(( $3 / 64 ))
  # Through python for the child's peak RSS (getrusage), written to LOG.rss.
  if ! python3 -c 'import resource, subprocess, sys
r = subprocess.call(sys.argv[2:])
open(sys.argv[1], "w").write("%d\n" % (resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024))
sys.exit(r)' "$4.rss" "$zinf" train --config "$1" --data "$data" --layers "$2" --dim "$3" \
      --heads "$heads" --seq "$T" --batch "$B" --steps "$steps" --lr "$lr" --precision fp32 \
      --log "$4" --overwrite > "$4.out" 2> "$4.err"; then
    echo "scale: zinf train failed ($1, ${2}x$3):" >&2
    grep -v 'runs unpinned' "$4.err" >&2
    return 1
  fi
  python3 - "$4" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
st = [r for r in rows if 'step' in r][1:]
summ = [r['summary'] for r in rows if 'summary' in r][0]
def med(v):
    v = sorted(v); n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2
rss = int(open(sys.argv[1] + '.rss').read())
print('%.1f %.4f %.4f %.4f %d %s %d %.3f %.3f %.1f %d' % (med([r['ms'] for r in st]),
      med([r['nvme_read_GBps'] for r in st]), med([r['nvme_write_GBps'] for r in st]),
      med([r['blocked'] for r in st]), summ['model_state_bytes'],
      ','.join('%.9g' % r['loss'] for r in rows if 'step' in r), rss,
      med([r['nvme_read_GBps'] * r['ms'] / 1e3 for r in st]),
      med([r['nvme_write_GBps'] * r['ms'] / 1e3 for r in st]),
      med([r['tokens_per_s'] for r in st]),
      summ.get('nvme', {}).get('swap_file_bytes', 0)))
PY
}

# The model's fp32 state (parameters, gradients, Adam m and v) from its shape, as the
# trainer counts it: 16 bytes a parameter.
state_of() { # layers dim
  echo $(( 16 * (12 * $2 * $2 * $1 + 13 * $2 * $1 + 256 * $2 + T * $2 + 2 * $2) ))
}

raw=$("$zinf" bench --path "$dir" --size 2G --block-size "$block" --queue-depth "$qd" --json)
read -r braw wraw < <(printf '%s\n' "$raw" | python3 -c 'import json,sys
rows={r["op"]: r for r in map(json.loads, sys.stdin)}
assert all(r["verified"] for r in rows.values())
print(rows["read"]["GBps"], rows["write"]["GBps"])')
echo "# scale: seq $T x batch $B tokens a step, $steps steps (medians of 2..$steps), fp32, device emulated"
echo "# offloaded: params and optimizer states on NVMe (DIR), device budget $dev, host $host, checkpoint_start $cstart; in memory: no offload"
echo "# zinf bench on DIR, 2 GiB, block $block, qd $qd: read $braw GB/s, write $wraw GB/s"
echo "# $(uname -sr), $(nproc) cpus; $(df --output=source,fstype "$dir" | tail -1)"
echo "# RAM $(awk -v b="$ram" 'BEGIN { printf "%.1f GiB", b / 2^30 }'); sizes above $memfrac of it run offloaded only"
printf "# %7s %10s %10s %10s %6s %8s %8s %9s %8s %6s %8s %8s %8s %9s %9s %s\n" shape state_MiB mem_ms offl_ms ratio \
  "rd GB/s" "wr GB/s" "rd+wr/bench" blocked tok/s "GB/step" "floor_ms" "RSS_MiB" "state/RAM" \
  "swap_GiB" "losses by step; equal"
for s in $shapes; do
  L=${s%x*} C=${s#*x}
  big=$(awk -v a="$(state_of "$L" "$C")" -v r="$ram" -v f="$memfrac" 'BEGIN { print (a > f * r) }')
  mms=nan mloss=
  if [ "$big" = 0 ]; then
    out=$(run "$tmp/mem.json" "$L" "$C" "$tmp/mem.$s.jsonl") || exit 1
    read -r mms _ _ _ state mloss _ <<< "$out"
  fi
  rm -rf "${swap:?}"/*
  out=$(run "$tmp/nvme.json" "$L" "$C" "$tmp/nvme.$s.jsonl") || exit 1
  read -r nms rd wr bl state nloss rss rdgb wrgb tps swapb <<< "$out"
  rm -rf "${swap:?}"/*
  python3 - "$s" "$state" "$mms" "$nms" "$rd" "$wr" "$bl" "$braw" "$wraw" "$mloss" "$nloss" \
    "$rss" "$rdgb" "$wrgb" "$tps" "$ram" "$swapb" <<'PY'
import math, sys
s, state, mms, nms, rd, wr, bl, braw, wraw, ml, nl, rss, rdgb, wrgb, tps, ram, swapb = sys.argv[1:]
state, mms, nms, rd, wr, bl, braw, wraw, rss, rdgb, wrgb, tps, ram, swapb = map(
    float, (state, mms, nms, rd, wr, bl, braw, wraw, rss, rdgb, wrgb, tps, ram, swapb))
# What the step's traffic reached against what the drive does at that read/write mix.
share = (rd / braw + wr / wraw)
floor = (rdgb / braw + wrgb / wraw) * 1e3
losses = nl.split(',')
same = "-" if not ml else "yes" if ml == nl else "NO"
print("  %7s %10.1f %10s %10.1f %6s %8.3f %8.3f %9.3f %7.0f%% %6.0f %8.2f %8.0f %8.0f %9.2f %9.1f %s; %s" % (
      s, state / 2**20, "-" if math.isnan(mms) else "%.1f" % mms, nms,
      "-" if math.isnan(mms) else "%.3f" % (nms / mms), rd, wr, share, bl * 100, tps,
      rdgb + wrgb, floor, rss / 2**20, state / ram, swapb / 2**30, ' '.join(l[:5] for l in losses), same))
PY
  echo "$s $(awk -v b="$state" 'BEGIN { printf "%.1f", b / 1048576 }') $mms $nms" >> "$tmp/plot.dat"
done
if [ -n "$plot" ] && command -v gnuplot > /dev/null; then
  gnuplot <<GP
set terminal pngcairo size 900,600 noenhanced font 'sans,10'
set output '$plot'
set title 'zinf train: step time against model state (seq $T x batch $B, fp32)'
set xlabel 'model state (MiB: parameters, gradients, Adam m and v)'
set ylabel 'ms per step (median)'
set logscale xy
set grid
set key top left
plot '$tmp/plot.dat' using 2:3 with linespoints lw 2 pt 7 title 'in memory', \
     '' using 2:4 with linespoints lw 2 pt 5 title 'offloaded to NVMe (device $dev, host $host)', \
     '' using 2:4:1 with labels offset 0,1 notitle
GP
  echo "# drawn: $plot"
elif [ -n "$plot" ]; then
  echo "# not drawn: no gnuplot (scripts/setup.sh installs gnuplot-nox)"
fi
echo "# rd+wr/bench: the step's read GB/s over zinf bench's read plus its write GB/s over zinf"
echo "#   bench's write: 1.0 is the drive kept as busy as zinf bench keeps it"
echo "# floor_ms: the step's NVMe bytes (GB/step) over zinf bench's rates: the IO floor"
