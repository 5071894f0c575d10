#!/usr/bin/env bash
# test-emu.sh - the GPU code on a machine without a GPU: tests/cuda_emu/run.sh over its
# default programs (the kernels against their CPU twins, the GPU trainer, the device and host
# tiers, the communicator), `ranks` (GPU ranks of `zinf launch -- zinf train` over the
# emulated NCCL) and, where mpirun is installed, `ranks-mpi` (the same under mpirun, in
# logical nodes), under ASan and UBSan. A change to src/comm, src/train, src/tiers or kernels/
# runs it and quotes its last lines. Not part of scripts/test.sh (it builds the library a
# fourth time, with the kernels turned into C++: 20-40 minutes on 2 cores); --no-sanitize
# builds without the sanitizers (faster). Exits 77 where no CUDA toolkit's headers are found.
#
#   scripts/test-emu.sh [--no-sanitize] [--stress]
set -uo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
progs=(test_kernels test_train_gpu test_device test_host test_comm ranks)
if command -v mpirun > /dev/null; then
  progs+=(ranks-mpi)
else
  echo "test-emu.sh: no mpirun (openmpi-bin): ranks-mpi left out"
fi
tests/cuda_emu/run.sh "$@" "${progs[@]}"
rc=$?
echo "test-emu.sh: exit status $rc in $((SECONDS - t0)) s"
exit $rc
