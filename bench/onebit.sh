#!/usr/bin/env bash
# onebit.sh - the gradients' communication across 4 CPU ranks (the shm backend), on the same
# model, data and seed: Adam with the fp32 reduction, with communication_data_type fp16 and
# bf16, and 1-bit Adam (OneBitAdam, freeze_step F: F steps of Adam without bias correction,
# then the momentum exchanged as signs). Prints, per run, the bytes each rank sent to the
# gradients' exchange a step (warm-up and compressed phase apart for 1-bit Adam), all the
# bytes it sent to collectives a step, the median step time past the freeze, and the loss
# (the mean of the last 20 steps, and of the 10 before the freeze), and draws the losses together (zinf plot, PNG beside).
# Clipping is off in every run (1-bit Adam cannot clip past the freeze: no rank holds the
# whole gradient).
#
# usage: bench/onebit.sh [OUTDIR]   (default ./bench-onebit: the logs and onebit.png)
#   ZINF=build/tools/zinf RANKS=4 LAYERS=4 DIM=128 HEADS=4 SEQ=64 BATCH=4 STEPS=300
#   FREEZE=100 LR=1e-3 BETAS="0.9, 0.999"
set -euo pipefail

out=${1:-bench-onebit}
zinf=${ZINF:-build/tools/zinf}
N=${RANKS:-4} L=${LAYERS:-4} C=${DIM:-128} H=${HEADS:-4} T=${SEQ:-64} B=${BATCH:-4}
S=${STEPS:-300} F=${FREEZE:-100} LR=${LR:-1e-3} BETAS=${BETAS:-0.9, 0.999}
data=${DATA:-/usr/share/common-licenses/GPL-3}
mkdir -p "$out"

config() { # name extra -> config path
  cat > "$out/$1.json" <<JSON
{"train_micro_batch_size_per_gpu": $B, "gradient_accumulation_steps": 1,
 "gradient_clipping": 0, $2
 "zinf": {"device": "emulated", "train": {"layers": $L, "dim": $C, "heads": $H, "seq": $T,
   "seed": 3}}}
JSON
  echo "$out/$1.json"
}

adam='"optimizer": {"type": "Adam", "params": {"lr": '$LR', "betas": ['$BETAS']}},'
onebit='"optimizer": {"type": "OneBitAdam", "params": {"lr": '$LR', "betas": ['$BETAS'],
 "freeze_step": '$F'}},'
runs=(adam-fp32 adam-fp16 adam-bf16 onebit)
extra=("$adam" "$adam \"communication_data_type\": \"fp16\","
       "$adam \"communication_data_type\": \"bf16\"," "$onebit")
echo "# $N CPU ranks, --layers $L --dim $C --heads $H --seq $T, micro-batch $B, $S steps, lr $LR, betas ($BETAS), no clipping; 1-bit Adam's freeze_step $F"
printf "# %-10s %14s %14s %14s %10s %10s %10s\n" run "grad B/step" "(compressed)" "all B/step" \
  "step ms" "loss" "loss@$F"
for k in "${!runs[@]}"; do
  name=${runs[$k]}
  cfg=$(config "$name" "${extra[$k]}")
  "$zinf" launch -n "$N" -- "$zinf" train --config "$cfg" --data "$data" --steps "$S" \
    --log "$out/$name.jsonl" > "$out/$name.out" 2>&1 || { tail -20 "$out/$name.out"; exit 1; }
  python3 - "$out/$name.jsonl" "$F" "$name" <<'PY'
import json, sys
path, F, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
st = [j for j in map(json.loads, open(path)) if "step" in j]
warm = [j for j in st if j["step"] <= F]
comp = [j for j in st if j["step"] > F + 1]  # F + 1 gathers m and v once
mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
g0 = mean([j["grad_comm_bytes"] for j in warm])
g1 = mean([j["grad_comm_bytes"] for j in comp])
allb = mean([j["comm_bytes"] for j in comp])
ms = sorted(j["ms"] for j in comp)[len(comp) // 2]
loss = mean([j["loss"] for j in st[-20:]])
atF = mean([j["loss"] for j in st if F - 10 < j["step"] <= F])
print("  %-10s %14.0f %14s %14.0f %10.2f %10.4f %10.4f" % (
    name, g0, "%.0f" % g1 if name == "onebit" else "-", allb, ms, loss, atF))
PY
done
logs=()
for name in "${runs[@]}"; do logs+=("$out/$name.jsonl"); done
"$zinf" plot "${logs[@]}" -o "$out/onebit.png" --title "gradient communication, $N CPU ranks" \
  >/dev/null 2>&1 || echo "# (zinf plot failed: gnuplot missing?)"
echo "# logs and onebit.png in $out"
