#!/usr/bin/env bash
# test-soak.sh - the long runs the default suite (scripts/test.sh) samples, whole: a nightly
# job, not CI. A build in build-soak configured with -Dsoak=true, whose tests run every point
# of their sweeps (each kill point on each rank, every stage on every number of ranks, every
# odd shape, the whole budget grid: tests/helpers.h, test_soak()) and the daemon's soak for
# 10 minutes, then the API stress program for longer under ThreadSanitizer. Takes an hour or
# more on 2 cores. Prints each part's time at the end.
#
#   scripts/test-soak.sh [MESON TEST ARGS...]     (e.g. cli-zero-resume train-a)
set -euo pipefail
cd "$(dirname "$0")/.."

jobs=${TEST_JOBS:-$(nproc)}
t0=$SECONDS
BUILD_DIR=build-soak scripts/setup.sh -Dsoak=true
meson test -C build-soak --print-errorlogs --num-processes "$jobs" \
  --timeout-multiplier "${TIMEOUT_MULTIPLIER:-4}" "$@"
t1=$SECONDS
if [ $# -eq 0 ]; then
  if [ ! -f build-tsan/build.ninja ]; then
    meson setup build-tsan -Db_sanitize=thread -Db_lundef=false -Dcuda=disabled -Dfuzz=disabled
  fi
  ninja -C build-tsan tests/stress_api
  mkdir -p build-tsan/tests/tmp
  TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$PWD/tests/tsan.supp" \
    ZINF_TEST_TMPDIR=$PWD/build-tsan/tests/tmp build-tsan/tests/stress_api 100
fi
echo "test-soak.sh: the soak build's tests $((t1 - t0)) s, ThreadSanitizer $((SECONDS - t1)) s"
