#!/usr/bin/env bash
# engine_bench.sh - the three engine benchmarks one after the other, on one swap directory,
# at each program's default sizes: swapin (NVMe -> device throughput against
# `zinf bench --read`), hitpath (fetch+release of a resident tensor) and eviction (NVMe
# bytes read per pass, LRU against eviction by next use). Each prints its own table; this
# script adds only the order and the exit status (non-zero when a program failed or read
# back a wrong byte). For other sizes, run the programs themselves (each takes --help).
#
# usage: bench/engine_bench.sh [DIR]      (default DIR: ./swap)
#   BUILD=build-dir        where the programs and tools/zinf were built (default: build)
#   DEVICE_KIND=auto|emulated   (default: auto)
#   JSON=file              print JSON rows instead of tables and append them there too
set -euo pipefail

dir=${1:-swap}
build=${BUILD:-build}
kind=${DEVICE_KIND:-auto}
json_out=${JSON:-}

for p in bench/swapin bench/hitpath bench/eviction tools/zinf; do
  [ -x "$build/$p" ] || { echo "engine_bench: $build/$p not built (ninja -C $build)" >&2; exit 2; }
done
mkdir -p "$dir"

status=0
run() { # name, options...
  local name=$1
  shift
  [ -z "$json_out" ] && echo "# ---- $name"
  if [ -n "$json_out" ]; then
    "$build/bench/$name" --path "$dir" --device-kind "$kind" --json "$@" | tee -a "$json_out" ||
      status=1
  else
    "$build/bench/$name" --path "$dir" --device-kind "$kind" "$@" || status=1
  fi
}
run swapin --zinf "$build/tools/zinf"
run hitpath
run eviction
exit $status
