#!/usr/bin/env bash
# io_vs_deepspeed.sh - zinf bench against DeepSpeed's async IO handle (deepspeed.ops.aio,
# what ds_io and ZeRO-Infinity's swapper use) on the same drive, alternating, ROUNDS times
# for each block size x queue depth, every byte of both verified; prints medians, the spread
# (min-max) and the ratio zinf/DeepSpeed.
#
#   bench/io_vs_deepspeed.sh DIR [SIZE] [ROUNDS]      (defaults: 2G, 5)
#   ZINF=build/tools/zinf  BLOCKS="1M 4M"  DEPTHS="8 32"  VENV=/var/tmp/zinf-ds-venv
#   ZINF_ARGS="--submit-batch 8" (more options for every zinf bench run)
#
# Sets up what it needs when missing: libaio-dev (apt-get, which DeepSpeed's aio op builds
# against) and a venv with torch and deepspeed from PyPI (several GB, once). DeepSpeed builds
# its aio op on first use (minutes, once). Reads: `zinf bench --write --keep` writes the
# file with zinf's pattern once; both read it from a cold page cache. Writes: each writes its
# own file of SIZE and fdatasyncs it inside the timing. Not part of the test suite; figures
# go to bench/RESULTS.md.
set -euo pipefail
dir=${1:?usage: bench/io_vs_deepspeed.sh DIR [SIZE] [ROUNDS]}
size=${2:-2G}
rounds=${3:-5}
zinf=${ZINF:-build/tools/zinf}
blocks=${BLOCKS:-1M 4M}
depths=${DEPTHS:-8 32}
zargs=${ZINF_ARGS:-} # more options for zinf bench, e.g. "--submit-batch 8"
venv=${VENV:-/var/tmp/zinf-ds-venv}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$dir"

. "$here/ds_env.sh"

bytes() { numfmt --from=iec "$1"; }
nbytes=$(bytes "$size")
zfile="$dir/zinf-bench.dat"
dsfile="$dir/ds-aio-write.dat"
trap 'rm -f "$dsfile"' EXIT

echo "# $("$zinf" version | head -n 1) against deepspeed $("$py" -c 'import importlib.metadata as m; print(m.version("deepspeed"))')"
echo "# $dir on $(df --output=source "$dir" | tail -n 1), $size, $rounds rounds, blocks $blocks, depths $depths"
echo "# zinf bench options: ${zargs:-(defaults)}"
echo "# the pattern file for the reads:"
"$zinf" bench --path "$dir" --size "$size" --write --keep --json | sed 's/^/#   /'

gb() { sed -n 's/.*"GBps": \([0-9.]*\).*/\1/p' | tail -n 1; }
ok() { grep -q '"verified": true'; }
declare -A runs
echo "# engine     op  block  qd  round   GB/s"
for bs in $blocks; do
  b=$(bytes "$bs")
  for qd in $depths; do
    for r in $(seq 1 "$rounds"); do
      for op in read write; do
        zout=$("$zinf" bench --path "$dir" --size "$size" --block-size "$bs" --queue-depth "$qd" \
               --"$op" --keep --json $zargs)
        printf '%s\n' "$zout" | ok || { echo "zinf $op not verified: $zout" >&2; exit 1; }
        if [ "$op" = read ]; then
          dout=$("$py" "$here/ds_aio_bench.py" --file "$zfile" --op read --block-size "$b" \
                 --queue-depth "$qd" 2>/dev/null)
        else
          dout=$("$py" "$here/ds_aio_bench.py" --file "$dsfile" --op write --size "$nbytes" \
                 --block-size "$b" --queue-depth "$qd" 2>/dev/null)
        fi
        printf '%s\n' "$dout" | ok || { echo "deepspeed $op not verified: $dout" >&2; exit 1; }
        # A zinf write pass leaves the pattern file as it was: the reads stay verifiable.
        z=$(printf '%s\n' "$zout" | gb); d=$(printf '%s\n' "$dout" | gb)
        printf '# %-9s %5s %6s %3s %5s %7s\n' zinf "$op" "$bs" "$qd" "$r" "$z"
        printf '# %-9s %5s %6s %3s %5s %7s\n' deepspeed "$op" "$bs" "$qd" "$r" "$d"
        runs["zinf $op $bs $qd"]+="$z "
        runs["ds $op $bs $qd"]+="$d "
      done
    done
  done
done

echo
printf '%-5s %6s %3s %10s %15s %10s %15s %7s\n' op block qd zinf_GBps zinf_range ds_GBps \
  ds_range ratio
for bs in $blocks; do
  for qd in $depths; do
    for op in read write; do
      read -r zm zlo zhi <<<"$(echo "${runs["zinf $op $bs $qd"]}" | stats)"
      read -r dm dlo dhi <<<"$(echo "${runs["ds $op $bs $qd"]}" | stats)"
      printf '%-5s %6s %3s %10s %15s %10s %15s %7s\n' "$op" "$bs" "$qd" "$zm" "$zlo-$zhi" "$dm" \
        "$dlo-$dhi" "$(awk -v z="$zm" -v d="$dm" 'BEGIN { printf "%.3f", (d > 0 ? z / d : 0) }')"
    done
  done
done
