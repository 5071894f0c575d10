#!/usr/bin/env bash
# test.sh - install what is missing, build, and run every test: the normal build, then
# the same suite under AddressSanitizer + UndefinedBehaviorSanitizer. GPU tests skip where
# no GPU is usable.
set -euo pipefail
cd "$(dirname "$0")/.."

jobs=${TEST_JOBS:-$(nproc)}
BUILD_DIR=build scripts/setup.sh
meson test -C build --print-errorlogs --num-processes "$jobs"

# Sanitizers. CUDA's runtime maps memory where ASan keeps its shadow gap, hence
# protect_shadow_gap=0 (set in tests/meson.build's environment).
BUILD_DIR=build-san scripts/setup.sh -Db_sanitize=address,undefined -Db_lundef=false \
  -Dbuildtype=debug
meson test -C build-san --print-errorlogs --num-processes "$jobs"
