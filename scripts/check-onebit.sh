#!/usr/bin/env bash
# check-onebit.sh - zinf's 1-bit Adam against DeepSpeed's OnebitAdam and compressed_allreduce,
# their arithmetic transcribed in numpy (bench/onebit_check.py), on small tensors for 1 to 4
# ranks over a few warm-up and compressed steps: the parameters, momentum, variance and both
# error-feedback buffers to fp32 rounding, every sign the same. Needs numpy, from PyPI in a
# venv once (not CI).
#   VENV=/var/tmp/zinf-onebit-venv
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f build/build.ninja ] || BUILD_DIR=build scripts/setup.sh >/dev/null
ninja -C build -j2 bench/onebit_ref >/dev/null
venv=${VENV:-/var/tmp/zinf-onebit-venv}
if ! "$venv/bin/python" -c 'import numpy' >/dev/null 2>&1; then
  echo "# setting up $venv (numpy from PyPI)"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q numpy
fi
"$venv/bin/python" bench/onebit_check.py build/bench/onebit_ref
