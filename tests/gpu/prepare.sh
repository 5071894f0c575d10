#!/usr/bin/env bash
# prepare.sh - build here what tests/gpu/run.sh runs on a machine with a GPU, which has
# CUDA (runtime, cuBLAS) but not this project's other libraries (liburing, hwloc, jansson,
# Criterion, OpenBLAS): the GPU-facing test programs, the benchmarks and the CLI, built in
# build-gpu/ for sm_80 and sm_90, are copied into .gpu/ (ignored by git) with every shared
# library they need except the C runtime's and CUDA's own (cuBLAS alone is larger than what
# a run may carry; the GPU machine's toolkit provides it).
set -euo pipefail
cd "$(dirname "$0")/../.."

BUILD_DIR=build-gpu scripts/setup.sh -Dbuildtype=release -Dcuda=enabled
rm -rf .gpu && mkdir -p .gpu/bin .gpu/lib
progs=(build-gpu/tests/test_kernels build-gpu/tests/test_train_gpu build-gpu/tests/test_device
       build-gpu/tests/test_host build-gpu/tests/test_engine build-gpu/tests/test_service
       build-gpu/tests/test_comm
       build-gpu/tools/zinf
       build-gpu/bench/swapin build-gpu/bench/hitpath build-gpu/bench/eviction)
for p in "${progs[@]}"; do
  cp "$p" .gpu/bin/
  strip .gpu/bin/"$(basename "$p")"
done
cp bench/train_offload.sh bench/offload_step.sh .gpu/bin/
cp -L build-gpu/src/libzinf.so.0 .gpu/lib/ 2>/dev/null || cp -L build-gpu/src/libzinf.so* .gpu/lib/
for p in "${progs[@]}"; do ldd "$p"; done | awk '$3 ~ /^\// {print $3}' | sort -u |
  grep -vE '/(libc|libm|libpthread|libdl|librt|libresolv|libgcc_s|libstdc\+\+)\.so|ld-linux' |
  grep -vE '/lib(cuda|cudart|cublas|cublasLt|nccl|nvidia-ml)\.so' |
  while read -r lib; do cp -L "$lib" .gpu/lib/; done
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
# What travels to the GPU machine is bounded (64 MiB with the working tree) and OpenBLAS alone
# is over half of that: .gpu/ holds one gzip archive, which run.sh unpacks where it runs.
tar czf gpu.tar.gz -C .gpu bin lib
rm -rf .gpu/bin .gpu/lib && mv gpu.tar.gz .gpu/
du -sh .gpu
