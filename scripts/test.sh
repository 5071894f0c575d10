#!/usr/bin/env bash
# test.sh - install what is missing, build, and run every test: the normal build, the unit
# suite of a build that finds no CUDA toolkit, the whole suite under AddressSanitizer +
# UndefinedBehaviorSanitizer, then the API stress program under ThreadSanitizer. GPU tests
# skip where no GPU is usable. Each leg's time (its build and its tests) is printed at the
# end. The long sweeps run a part of their points here; scripts/test-soak.sh runs them whole.
set -euo pipefail
cd "$(dirname "$0")/.."

jobs=${TEST_JOBS:-$(nproc)}

# leg NAME: the leg that starts now (and the end of the one before).
legs=()
leg_name=
leg_start=$SECONDS
leg() {
  [ -z "$leg_name" ] || legs+=("$(printf '%-34s %4d s' "$leg_name" $((SECONDS - leg_start)))")
  leg_name=$1
  leg_start=$SECONDS
}
report() {
  local rc=$?
  leg ""
  local how=
  [ "$rc" = 0 ] || how=" (exit status $rc)"
  echo "test.sh: each leg's time, its build included$how:"
  printf '  %s\n' "${legs[@]}"
  printf '  %-34s %4d s\n' total "$SECONDS"
}

# PATH with every directory that holds program $1 replaced by one, under $2, of links to
# all else in it: $1 is not found, everything else is.
path_without() {
  local prog=$1 tmp=$2 d out= i=0
  local -a dirs
  IFS=: read -ra dirs <<<"$PATH"
  for d in "${dirs[@]}"; do
    if [ -e "$d/$prog" ]; then
      mkdir "$tmp/$i"
      ln -s "$d"/* "$tmp/$i/"
      rm "$tmp/$i/$prog"
      d=$tmp/$i
    fi
    out=${out:+$out:}$d
    i=$((i + 1))
  done
  printf '%s\n' "$out"
}

trap report EXIT
leg "plain build"
BUILD_DIR=build scripts/setup.sh
meson test -C build --print-errorlogs --num-processes "$jobs"

# No CUDA toolkit: what a machine without one builds, found by autodetection and not by
# -Dcuda=disabled. cudatoolkit_dir points nowhere and no nvcc is on PATH, so the build
# must come out with the device tier emulated and no kernels, and the unit suite pass but
# for its slow programs (the CLI's and the trainer's end to end, the daemon's soak), which
# run no code that differs without the toolkit.
leg "no CUDA toolkit (unit, not slow)"
nonvcc=$(mktemp -d)
trap 'rm -rf "$nonvcc"; report' EXIT
nocuda_path=$(path_without nvcc "$nonvcc")
PATH=$nocuda_path BUILD_DIR=build-nocuda env -u CUDA_HOME -u CUDA_PATH scripts/setup.sh \
  -Dcudatoolkit_dir=/nonexistent
grep -q '^#define ZINF_HAVE_CUDA 0' build-nocuda/zinf_build.h &&
  grep -q '^#define ZINF_HAVE_KERNELS 0' build-nocuda/zinf_build.h ||
  { echo "test.sh: the build without a CUDA toolkit found CUDA" >&2; exit 1; }
PATH=$nocuda_path env -u CUDA_HOME -u CUDA_PATH \
  meson test -C build-nocuda --suite unit --no-suite slow --print-errorlogs \
  --num-processes "$jobs"

# Sanitizers. CUDA's runtime maps memory where ASan keeps its shadow gap, hence
# protect_shadow_gap=0 (set in tests/meson.build's environment).
leg "ASan+UBSan"
BUILD_DIR=build-san scripts/setup.sh -Db_sanitize=address,undefined -Db_lundef=false \
  -Dbuildtype=debug
# The multinode suite runs alone (several ranks on each of several namespace nodes); its zinf
# code is checked under the sanitizers by comm_mpi (the communicator across nodes) and the
# CLI's rank tests (the trainer's), so here it would only add minutes.
meson test -C build-san --print-errorlogs --num-processes "$jobs" --no-suite multinode

# ThreadSanitizer: the API stress program from many threads (a plain program: Criterion's
# runner cannot start under TSan). Only that target is built. The one race the contract
# allows (a caller writing through its pin while a load of the other tier or a flush reads
# the copy) is annotated where the program writes, not suppressed: a suppression matches
# only a stack the runtime could restore (tests/tsan.supp says more). The program runs that
# race in every round of its first phase, so an annotation that stopped working fails here
# every time, not by luck.
leg "TSan (stress_api, the daemon)"
if [ ! -f build-tsan/build.ninja ]; then
  meson setup build-tsan -Db_sanitize=thread -Db_lundef=false -Dcuda=disabled -Dfuzz=disabled
fi
ninja -C build-tsan tests/stress_api
mkdir -p build-tsan/tests/tmp
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$PWD/tests/tsan.supp" \
  ZINF_TEST_TMPDIR=$PWD/build-tsan/tests/tmp build-tsan/tests/stress_api 10
# The same through the daemon (in the program's own process): its connection threads, the
# sessions' pins and the client's pool of connections.
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$PWD/tests/tsan.supp" \
  ZINF_TEST_TMPDIR=$PWD/build-tsan/tests/tmp build-tsan/tests/stress_api 5 --service
# Traced (ZINF_TRACE): every thread's ring and the one writer draining them.
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$PWD/tests/tsan.supp" \
  ZINF_TRACE=$PWD/build-tsan/tests/tmp/stress-trace.json \
  ZINF_TEST_TMPDIR=$PWD/build-tsan/tests/tmp build-tsan/tests/stress_api 3
python3 -c "import json, sys; json.load(open(sys.argv[1]))" build-tsan/tests/tmp/stress-trace.json
# The daemon under ThreadSanitizer: its workers, epoll loop, limits, idle jobs closing and
# staged writes, under the soak's load and hostile client (the soak program itself is the
# normal build's; it needs root to act as a second user, and says 77 without).
ninja -C build-tsan tools/zinf
rc=0
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$PWD/tests/tsan.supp" \
  ZINF_BIN=$PWD/build-tsan/tools/zinf ZINF_TEST_TMPDIR=$PWD/build-tsan/tests/tmp \
  build/tests/soak_serve --seconds 15 --limits --atomic-write || rc=$?
[ "$rc" = 0 ] || [ "$rc" = 77 ] || exit "$rc"
# The communicator's worker thread and callbacks, in ranks started by the launcher.
ninja -C build-tsan tests/comm_rank
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" build/tools/zinf launch -n 3 -- \
  build-tsan/tests/comm_rank
# The trainer across two ranks at ZeRO stage 3 (engines, communicators, gathers ahead,
# reductions behind the backward folded on the comm thread, and checkpoints
# together), one OpenMP and OpenBLAS thread each: their runtimes are not instrumented.
ninja -C build-tsan tools/zinf
zdir=$(mktemp -d)
cat > "$zdir/zero.json" <<JSON
{"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "$zdir/swap"},
 "offload_optimizer": {"device": "nvme", "nvme_path": "$zdir/swap"}},
 "zinf": {"device": "emulated", "device_bytes": "16M", "host_bytes": "16M"}}
JSON
OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
  TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$PWD/tests/tsan.supp" \
  build/tools/zinf launch -n 2 -- build-tsan/tools/zinf train --config "$zdir/zero.json" \
  --data README.md --layers 2 --dim 32 --heads 2 --seq 16 --batch 2 --steps 3 --checkpoint-every 1 \
  --accumulate 2 --trace "$zdir/trace.json"
# One rank with each update deferred to the next forward: the update's thread runs a block
# ahead of the forward's compute, under tight budgets (its sets may find no room ahead and be
# read again alone), with checkpoints, evaluations and a sample finishing an update.
cat > "$zdir/fwd.json" <<JSON
{"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "$zdir/fswap"},
 "offload_optimizer": {"device": "nvme", "nvme_path": "$zdir/fswap"}},
 "zinf": {"device": "emulated", "device_bytes": "256K", "host_bytes": "512K",
          "train": {"update_in_forward": true}}}
JSON
OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
  TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$PWD/tests/tsan.supp" \
  build-tsan/tools/zinf train --config "$zdir/fwd.json" --data README.md --layers 4 --dim 32 \
  --heads 2 --seq 16 --batch 2 --steps 6 --checkpoint-every 2 --eval-every 3 --sample-every 5 \
  --trace "$zdir/fwd-trace.json"
rm -rf "$zdir"
