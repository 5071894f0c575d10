#!/usr/bin/env bash
# huge_pages.sh - what huge pages for the IO buffers do to raw reads and writes: `zinf bench`
# with its default buffers (transparent huge pages, as the engine's host arena) and with
# --no-huge-pages, alternating, ROUNDS times for each block size x queue depth, every byte
# verified. For each run it also reads what reached the block device from
# /sys/class/block/DEV/stat (requests, merges, average request size), so the cause is seen
# next to the speed.
#
#   bench/huge_pages.sh DIR [SIZE] [ROUNDS]     (defaults: 2G, 3)
#   ZINF=build/tools/zinf  BLOCKS="1M 4M"  DEPTHS="8 32"
#
# Prints one line per run (# lines) and then a table of medians with the ratio
# huge/no-huge. Not part of the test suite: the figures go to bench/RESULTS.md.
set -euo pipefail
dir=${1:?usage: bench/huge_pages.sh DIR [SIZE] [ROUNDS]}
size=${2:-2G}
rounds=${3:-3}
zinf=${ZINF:-build/tools/zinf}
blocks=${BLOCKS:-1M 4M}
depths=${DEPTHS:-8 32}
mkdir -p "$dir"

# The block device under dir (a partition has its own stat file).
src=$(df --output=source "$dir" | tail -n 1)
dev=$(basename "$(readlink -f "$src")")
stat=/sys/class/block/$dev/stat
[ -r "$stat" ] || { echo "huge_pages.sh: no $stat for $src; block-layer columns are blank" >&2; stat=; }

# fields: reads, read merges, read sectors, ..., writes (5), write merges (6), write sectors (7)
snap() { [ -n "$stat" ] && awk '{print $1, $2, $3, $5, $6, $7}' "$stat" || echo "0 0 0 0 0 0"; }

declare -A runs
echo "# zinf bench on $dir ($dev), $size, rounds $rounds, blocks $blocks, depths $depths"
echo "# pages  op     block  qd  round   GB/s  dev_reqs  merges  avg_req_KiB  verified"
for bs in $blocks; do
  for qd in $depths; do
    for r in $(seq 1 "$rounds"); do
      for mode in huge small; do
        extra=
        [ "$mode" = small ] && extra=--no-huge-pages
        for op in read write; do
          s0=$(snap)
          out=$("$zinf" bench --path "$dir" --size "$size" --block-size "$bs" --queue-depth "$qd" \
                --"$op" --keep $extra --json)
          s1=$(snap)
          gbps=$(printf '%s\n' "$out" | sed -n 's/.*"GBps": \([0-9.]*\).*/\1/p' | tail -n 1)
          ok=$(printf '%s\n' "$out" | sed -n 's/.*"verified": \([a-z]*\).*/\1/p' | tail -n 1)
          read -r a0 b0 c0 d0 e0 f0 <<<"$s0"
          read -r a1 b1 c1 d1 e1 f1 <<<"$s1"
          if [ "$op" = read ]; then n=$((a1 - a0)); m=$((b1 - b0)); sec=$((c1 - c0));
          else n=$((d1 - d0)); m=$((e1 - e0)); sec=$((f1 - f0)); fi
          avg=$(awk -v s="$sec" -v n="$n" 'BEGIN { printf "%.0f", n ? s * 512 / 1024 / n : 0 }')
          printf '# %-5s %-5s %6s %3s %6s %7s %9s %7s %12s %9s\n' "$mode" "$op" "$bs" "$qd" "$r" \
            "$gbps" "$n" "$m" "$avg" "$ok"
          runs["$mode $op $bs $qd"]+="$gbps "
          [ "$ok" = true ] || { echo "huge_pages.sh: a run was not verified" >&2; exit 1; }
        done
      done
    done
  done
done

median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR] = $1} END { print a[int((NR + 1) / 2)] }'; }
echo
printf '%-5s %6s %3s %12s %12s %8s\n' op block qd huge_GBps small_GBps ratio
for bs in $blocks; do
  for qd in $depths; do
    for op in read write; do
      h=$(echo "${runs["huge $op $bs $qd"]}" | median)
      s=$(echo "${runs["small $op $bs $qd"]}" | median)
      printf '%-5s %6s %3s %12s %12s %8s\n' "$op" "$bs" "$qd" "$h" "$s" \
        "$(awk -v h="$h" -v s="$s" 'BEGIN { printf "%.3f", (s > 0 ? h / s : 0) }')"
    done
  done
done
