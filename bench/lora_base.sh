#!/usr/bin/env bash
# lora_base.sh - NVMe bytes a `zinf serve` daemon reads per step for three LoRA fine-tunes
# run at once on one shared base job (zinf.base_job, zinf job share), against three
# fine-tunes each on a base job of its own (the same weights): the shared base is one copy
# in the daemon's memory for the three, three bases are three.
#
# usage: bench/lora_base.sh DIR [ROUNDS]
#   DIR: a scratch folder (its swap files and logs; removed at the start)
# Environment: ZINF (the binary; build/tools/zinf), LAYERS DIM HEADS SEQ BATCH (the model;
# 4 32 2 16 4), STEPS (20), DEVICE_BYTES HOST_BYTES (the fine-tunes' daemon's budgets per
# job; 320K 64K: less than the base with the sets the jobs pin, so it is read from NVMe
# every step). The bases are pretrained 2 steps by a daemon with 64M budgets, which then
# stops; the fine-tunes' daemon opens them from the swap files.
# Prints, per round, the bytes read from NVMe for the bases per step in all, and the losses'
# agreement (each shared-base run against its own-base twin, same seed).
set -euo pipefail
dir=${1:?usage: bench/lora_base.sh DIR [ROUNDS]}
rounds=${2:-1}
zinf=${ZINF:-$(cd "$(dirname "$0")/.." && pwd)/build/tools/zinf}
model="--layers ${LAYERS:-4} --dim ${DIM:-32} --heads ${HEADS:-2} --seq ${SEQ:-16} --batch ${BATCH:-4}"
lora="--lora-rank 4 --lora-alpha 8 --lora-targets c_attn,c_proj,c_fc --lr 1e-2"
steps=${STEPS:-20}
sock="$dir/zinf.sock"

rm -rf "$dir"
mkdir -p "$dir"
for i in $(seq 300); do echo "line $i of the text the byte model learns from."; done >"$dir/data.txt"
serve_cfg() { # name device host
    printf '{"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "%s/swap"}},
 "aio": {"block_size": 65536}, "zinf": {"device": "emulated", "device_bytes": "%s", "host_bytes": "%s"}}\n' \
        "$dir" "$2" "$3" >"$dir/$1"
}
train_cfg() { # name base
    printf '{"zero_optimization": {"offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"}},
 "zinf": {"connect": "%s"%s}}\n' "$sock" "${2:+, \"base_job\": \"$2\"}" >"$dir/$1"
}
serve_cfg big.json 64M 64M
serve_cfg small.json "${DEVICE_BYTES:-320K}" "${HOST_BYTES:-64K}"
train_cfg plain.json ""
train_cfg shared.json base
for k in 1 2 3; do train_cfg own$k.json base$k; done
trap '"$zinf" serve --stop --socket "$sock" >/dev/null 2>&1 || true' EXIT

"$zinf" serve --socket "$sock" --config "$dir/big.json" --log "$dir/serve.log" >/dev/null
for b in base base1 base2 base3; do
    "$zinf" train --config "$dir/plain.json" --job $b --data "$dir/data.txt" $model --steps 2 \
        >"$dir/$b.out" 2>&1
done
"$zinf" serve --stop --socket "$sock" >/dev/null
"$zinf" serve --socket "$sock" --config "$dir/small.json" --log "$dir/serve.log" >/dev/null
for b in base base1 base2 base3; do "$zinf" job share $b --socket "$sock" >/dev/null; done

reads() { # NVMe bytes read for the base jobs
    "$zinf" stat --socket "$sock" --json | python3 -c '
import json, sys
print(sum(j["stats"]["nvme_bytes_read"] for j in json.load(sys.stdin)["jobs"] if j["job"].startswith("base")))'
}
three() { # tag cfg1 cfg2 cfg3
    local tag=$1
    shift
    for k in 1 2 3; do
        "$zinf" train --config "$dir/$1" --job "$tag$k" --data "$dir/data.txt" $model $lora \
            --steps "$steps" --seed $k >"$dir/$tag$k.out" 2>&1 &
        shift
    done
    wait
}
losses() { grep -E '^ +[0-9]+ ' "$1" | awk '{print $2}'; }

base_bytes=$(grep -o 'model state [0-9.]* [KMG]iB' "$dir/base.out" | head -1)
echo "# $model, $steps steps, daemon budgets ${DEVICE_BYTES:-320K} device ${HOST_BYTES:-64K} host per job; base $base_bytes (with its optimizer state)"
printf '# %5s %16s %16s %8s %s\n' round shared_B/step own_B/step ratio losses_equal
for r in $(seq "$rounds"); do
    a=$(reads)
    three "s$r-" shared.json shared.json shared.json
    b=$(reads)
    three "o$r-" own1.json own2.json own3.json
    c=$(reads)
    same=yes
    for k in 1 2 3; do
        [ "$(losses "$dir/s$r-$k.out")" = "$(losses "$dir/o$r-$k.out")" ] || same=no
        [ "$(losses "$dir/s$r-$k.out" | wc -l)" = "$steps" ] || same=no
    done
    awk -v r="$r" -v s=$((b - a)) -v o=$((c - b)) -v n="$steps" -v q="$same" \
        'BEGIN { printf "  %5d %16.0f %16.0f %8.3f %s\n", r, s / n, o / n, s / o, q }'
done
