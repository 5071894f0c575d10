#!/usr/bin/env bash
# huge_pages.sh - what huge pages for the IO buffers do to raw reads and writes: `zinf bench`
# with its default buffers (transparent huge pages, as the engine's host arena) and with
# --no-huge-pages, alternating, ROUNDS times for each block size x queue depth, every byte
# verified. Each run's line also shows what reached the block device (requests, merges,
# average request size, as `zinf bench --json` reports them), so the cause is seen next to
# the speed.
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

field() { sed -n "s/.*\"$1\": \([0-9.a-z]*\).*/\1/p" | tail -n 1; }

declare -A runs
echo "# zinf bench on $dir ($(df --output=source "$dir" | tail -n 1)), $size, rounds $rounds, blocks $blocks, depths $depths"
echo "# pages  op     block  qd  round   GB/s  dev_reqs  merges  avg_req_KiB  verified"
for bs in $blocks; do
  for qd in $depths; do
    for r in $(seq 1 "$rounds"); do
      for mode in huge small; do
        extra=
        [ "$mode" = small ] && extra=--no-huge-pages
        for op in read write; do
          out=$("$zinf" bench --path "$dir" --size "$size" --block-size "$bs" --queue-depth "$qd" \
                --"$op" --keep $extra --json | tail -n 1)
          gbps=$(printf '%s\n' "$out" | field GBps)
          ok=$(printf '%s\n' "$out" | field verified)
          n=$(printf '%s\n' "$out" | field requests)
          m=$(printf '%s\n' "$out" | field merges)
          avg=$(printf '%s\n' "$out" | field avg_request_bytes)
          avg=$([ -n "$avg" ] && echo $((avg / 1024)) || echo -)
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
