#!/usr/bin/env bash
# check-deepspeed.sh - zinf against DeepSpeed's own code, from PyPI in a venv (not CI: it
# downloads torch and deepspeed, several GB, once): every learning-rate schedule zinf train
# runs (WarmupLR log and linear, WarmupDecayLR, WarmupCosineLR, LRRangeTest with and
# without its staircase, OneCycle with its momentum, stairs and decay) step for step against
# deepspeed.runtime.lr_schedules over 1000 steps, equal as doubles (bench/ds_schedules.py);
# Adam with adam_w_mode false against DeepSpeedCPUAdam and LAMB against FusedLamb (its
# kernel's arithmetic where its CUDA op does not load), to fp32 rounding (bench/ds_optim.py);
# zinf train --export-hf loaded by transformers' GPT2LMHeadModel, its loss on zinf's batches
# zinf's to fp32 rounding, and --init of that export (bench/hf_check.py).
#   VENV=/var/tmp/zinf-ds-venv (bench/ds_env.sh)  STEPS=1000
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=build scripts/setup.sh >/dev/null
NEED_AIO=0 . bench/ds_env.sh
echo "check-deepspeed: $("$py" -c 'import deepspeed, torch; print("deepspeed", deepspeed.__version__, "torch", torch.__version__)' 2>/dev/null)"
"$py" bench/ds_schedules.py build/tools/zinf "${STEPS:-1000}"
"$py" bench/ds_optim.py build/bench/optim_ref
"$py" bench/hf_check.py build/tools/zinf
