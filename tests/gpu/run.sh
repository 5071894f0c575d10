#!/usr/bin/env bash
# run.sh - the GPU check, on a machine with a GPU, from what tests/gpu/prepare.sh put in
# .gpu/: the CUDA kernels against their CPU twins, the CUDA device tier (arena, streams,
# events, pinned host registration), and the engine's swap-in and hit path with the device
# tier on the GPU. Every log and a summary land in $OUT (or ./gpu-out).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-out}
mkdir -p "$out"
export LD_LIBRARY_PATH="$PWD/.gpu/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
bin=.gpu/bin
swap=$(mktemp -d /tmp/zinf-gpu.XXXXXX)
status=0

step() { # name timeout command...
  local name=$1 t=$2
  shift 2
  echo "== $name: $*" | tee -a "$out/summary.txt"
  timeout "$t" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -5 "$out/$name.log" | sed 's/^/   /' | tee -a "$out/summary.txt"
  echo "   rc=$rc" | tee -a "$out/summary.txt"
  [ $rc = 0 ] || status=1
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
step version 30 $bin/zinf version
step topo 30 $bin/zinf topo
step kernels 120 $bin/test_kernels --verbose
step device_gpu 180 $bin/test_device --filter 'device_gpu/*' --verbose
step host 120 $bin/test_host --verbose
step swapin 240 $bin/swapin --path "$swap" --device-kind auto --zinf $bin/zinf --json
step hitpath 120 $bin/hitpath --path "$swap" --device-kind auto
rm -rf "$swap"
echo "status $status" | tee -a "$out/summary.txt"
exit $status
