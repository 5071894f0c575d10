#!/usr/bin/env bash
# check-deepspeed.sh - zinf against DeepSpeed's own code, from PyPI in a venv (not CI: it
# downloads torch and deepspeed, several GB, once): every learning-rate schedule zinf train
# runs (WarmupLR log and linear, WarmupDecayLR, WarmupCosineLR, LRRangeTest with and
# without its staircase) step for step against deepspeed.runtime.lr_schedules over 1000
# steps, equal as doubles (bench/ds_schedules.py).
#   VENV=/var/tmp/zinf-ds-venv (bench/ds_env.sh)  STEPS=1000
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=build scripts/setup.sh >/dev/null
NEED_AIO=0 . bench/ds_env.sh
echo "check-deepspeed: $("$py" -c 'import deepspeed, torch; print("deepspeed", deepspeed.__version__, "torch", torch.__version__)' 2>/dev/null)"
"$py" bench/ds_schedules.py build/tools/zinf "${STEPS:-1000}"
