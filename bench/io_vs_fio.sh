#!/usr/bin/env bash
# io_vs_fio.sh - zinf bench against fio (O_DIRECT) on the same file, with the same block
# size and queue depth, alternating, ROUNDS rounds each; prints the median GB/s of each
# (robust to the odd round disturbed by a neighbour on a shared machine) and the ratio
# zinf/fio of the medians for read and for write.
#
# fio with default options is only a floor. Each fio round runs every variant below and
# counts the best, so the figure is the strongest fio seen here:
#   uring         --ioengine=io_uring (defaults)
#   uring-batch   io_uring submitting and completing the whole queue in batches
#                 (--iodepth_batch_submit=QD --iodepth_batch_complete_max=QD), with fixed
#                 buffers and registered files
#   libaio-batch  --ioengine=libaio with the same batching
# The per-variant medians are printed too (FIO_VARIANTS="uring" gives the old floor).
#
# usage: bench/io_vs_fio.sh [DIR] [SIZE] [ROUNDS]   (defaults: ./swap 2G 3)
#   ZINF=path/to/zinf   the binary (default: build/tools/zinf)
#   CONFIGS="1M:32 4M:16"   block:queue-depth pairs to compare
#   JSON=file           also write the rows as JSON lines there
set -euo pipefail

dir=${1:-swap}
size=${2:-2G}
rounds=${3:-3}
zinf=${ZINF:-build/tools/zinf}
configs=${CONFIGS:-"1M:32 4M:16"}
json_out=${JSON:-}
variants=${FIO_VARIANTS:-"uring uring-batch libaio-batch"}

for tool in fio python3; do
  if ! command -v "$tool" >/dev/null; then
    if [ "$(id -u)" = 0 ]; then apt-get install -y -q fio python3 >/dev/null
    else echo "io_vs_fio: $tool is missing (apt-get install fio python3)" >&2; exit 2; fi
  fi
done
[ -x "$zinf" ] || { echo "io_vs_fio: $zinf not built (meson setup build && ninja -C build)" >&2; exit 2; }
mkdir -p "$dir"
file="$dir/zinf-bench.dat"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"; rm -f "$file"' EXIT

fio_one() { # variant op bs qd -> GB/s
  local v=$1 op=$2 bs=$3 qd=$4 extra=()
  [ "$op" = write ] && extra=(--end_fsync=1)
  case $v in
    uring) extra+=(--ioengine=io_uring) ;;
    uring-batch) extra+=(--ioengine=io_uring --fixedbufs --registerfiles
                         --iodepth_batch_submit="$qd" --iodepth_batch_complete_max="$qd") ;;
    libaio-batch) extra+=(--ioengine=libaio
                          --iodepth_batch_submit="$qd" --iodepth_batch_complete_max="$qd") ;;
    *) echo "io_vs_fio: unknown fio variant $v" >&2; exit 2 ;;
  esac
  fio --name=zinf-cmp --filename="$file" --direct=1 --rw="$op" \
      --bs="$bs" --iodepth="$qd" --size="$size" --invalidate=1 "${extra[@]}" \
      --output-format=json 2>/dev/null |
    python3 -c "import json,sys; j=json.load(sys.stdin)['jobs'][0]; print(j['$op']['bw_bytes']/1e9)"
}

fio_run() { # op bs qd -> best GB/s of the variants; each variant's figure goes to $tmp
  local op=$1 bs=$2 qd=$3 best=0 g v
  for v in $variants; do
    g=$(fio_one "$v" "$op" "$bs" "$qd")
    echo "$g" >> "$tmp/fio-$v-$op-$bs-$qd"
    best=$(python3 -c "print(max($best, $g))")
  done
  echo "$best"
}

zinf_run() { # bs qd -> "write_GBps read_GBps", exits non-zero on a failed row
  "$zinf" bench --path "$dir" --size "$size" --block-size "$1" --queue-depth "$2" --both \
      --keep --json > "$tmp/z.json"
  [ -n "$json_out" ] && cat "$tmp/z.json" >> "$json_out"
  python3 - "$tmp/z.json" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
by = {r['op']: r for r in rows}
for op in ('write', 'read'):
    if not by[op]['verified']:
        sys.exit('zinf bench: %s row not verified' % op)
print(by['write']['GBps'], by['read']['GBps'])
PY
}

echo "# io_vs_fio: $file, size $size, $rounds rounds, alternating zinf and fio"
echo "# $(uname -sr), $(nproc) cpus, fio $(fio --version); fio: best of $variants each round"
echo "# filesystem: $(df -T "$dir" | awk 'NR==2 {print $1, $2}')"
printf "# %6s %4s %6s %10s %10s %8s   (medians)\n" block qd op zinf_GB/s fio_GB/s zinf/fio
status=0
for c in $configs; do
  bs=${c%%:*} qd=${c##*:}
  # Lay the file out once, untimed, so every timed write overwrites allocated blocks.
  "$zinf" bench --path "$dir" --size "$size" --block-size "$bs" --queue-depth "$qd" --write \
      --keep --json >/dev/null
  zw=() zr=() fw=() fr=()
  for ((i = 0; i < rounds; i++)); do
    read -r w r < <(zinf_run "$bs" "$qd")
    zw+=("$w") zr+=("$r")
    fw+=("$(fio_run write "$bs" "$qd")")
    fr+=("$(fio_run read "$bs" "$qd")")
  done
  python3 - "$bs" "$qd" "${zw[*]}" "${fw[*]}" "${zr[*]}" "${fr[*]}" <<'PY' || status=1
import sys
bs, qd = sys.argv[1], sys.argv[2]
zw, fw, zr, fr = ([float(x) for x in a.split()] for a in sys.argv[3:7])
def median(v):
    v = sorted(v)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2
bad = False
for op, z, f in (('write', zw, fw), ('read', zr, fr)):
    ratio = median(z) / median(f)
    print("  %6s %4s %6s %10.3f %10.3f %8.3f   rounds zinf %s fio %s" % (
        bs, qd, op, median(z), median(f), ratio,
        ' '.join('%.2f' % x for x in z), ' '.join('%.2f' % x for x in f)))
    bad |= ratio < 0.95
sys.exit(1 if bad else 0)
PY
  for op in write read; do
    for v in $variants; do
      printf "#   fio %-12s %6s %4s %6s median %s GB/s\n" "$v" "$bs" "$qd" "$op" \
        "$(sort -g "$tmp/fio-$v-$op-$bs-$qd" | awk '{a[NR] = $1} END { printf "%.3f", a[int((NR + 1) / 2)] }')"
    done
  done
done
[ $status = 0 ] && echo "# target zinf/fio >= 0.95: met" || echo "# target zinf/fio >= 0.95: NOT met"
exit $status
