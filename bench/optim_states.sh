#!/usr/bin/env bash
# optim_states.sh - Adam's moments stored in fp32, bf16 and int8 (zinf.optimizer_state_dtype)
# side by side in one run, with the optimizer's states offloaded to NVMe:
#
#   1. a model of tens of millions of parameters (default 8 layers x 512: 25.7M), the
#      parameters on the (emulated) device and the optimizer's states on NVMe under a host
#      budget that holds a fraction of them, S steps per dtype, rounds alternating: the
#      median step time of steps 2..S, the NVMe bytes read and written a step (zinf train
#      --log: nvme_read_bytes, nvme_write_bytes, mean of steps 2..S), the states' bytes, and
#      each against fp32's;
#   2. the loss curves of a small model over CURVE_STEPS steps (default 300) in memory,
#      printed every CURVE_EVERY steps side by side, and the mean of the last 20 losses of
#      each dtype against fp32's (what compression costs in final loss).
#
# usage: bench/optim_states.sh DIR [ROUNDS]     (default 1)
#   ZINF=build/tools/zinf  LAYERS=8 DIM=512 HEADS=8 SEQ=64 BATCH=2 STEPS=6
#   DEVICE_BYTES=2G HOST_BYTES=48M (the large runs' budgets: by default the host holds
#   none of the dtypes' states whole)  DATA=a text file
#   CURVE="--layers 2 --dim 128 --heads 4 --seq 64 --batch 4"  CURVE_STEPS=300 CURVE_EVERY=50
#   DTYPES="fp32 bf16 int8"
set -euo pipefail

dir=${1:?usage: bench/optim_states.sh DIR [ROUNDS]}
rounds=${2:-1}
zinf=${ZINF:-build/tools/zinf}
L=${LAYERS:-8} C=${DIM:-512} H=${HEADS:-8} T=${SEQ:-64} B=${BATCH:-2} S=${STEPS:-6}
dev=${DEVICE_BYTES:-2G} host=${HOST_BYTES:-48M}
curve=${CURVE:---layers 2 --dim 128 --heads 4 --seq 64 --batch 4}
cs=${CURVE_STEPS:-300} every=${CURVE_EVERY:-50}
dtypes=${DTYPES:-fp32 bf16 int8}
data=${DATA:-/usr/share/common-licenses/GPL-3}
tmp=$(mktemp -d)
swap=$dir/optim-states-swap
trap 'rm -rf "$tmp" "$swap"' EXIT

for dt in $dtypes; do
    cat > "$tmp/$dt.json" <<JSON
{"zero_optimization": {"offload_param": {"device": "none"},
  "offload_optimizer": {"device": "nvme", "nvme_path": "$swap/$dt"}},
 "aio": {"block_size": 1048576, "queue_depth": 32},
 "zinf": {"device": "emulated", "device_bytes": "$dev", "host_bytes": "$host",
          "optimizer_state_dtype": "$dt"}}
JSON
    cat > "$tmp/curve-$dt.json" <<JSON
{"zinf": {"device": "emulated", "device_bytes": "1G", "host_bytes": "1G",
          "optimizer_state_dtype": "$dt"}}
JSON
done

echo "# $(date -u +%F) $(uname -m), $(nproc) cores; $L x $C, seq $T, batch $B, $S steps," \
     "optimizer on NVMe in $dir (device $dev, host $host), $rounds round(s)"
for r in $(seq 1 "$rounds"); do
    for dt in $dtypes; do
        rm -rf "$swap"
        mkdir -p "$swap/$dt"
        "$zinf" train --config "$tmp/$dt.json" --data "$data" --layers "$L" --dim "$C" \
            --heads "$H" --seq "$T" --batch "$B" --steps "$S" --log "$tmp/big-$dt-$r.jsonl" \
            > "$tmp/big-$dt-$r.out" 2>&1 || { cat "$tmp/big-$dt-$r.out"; exit 1; }
    done
done
for dt in $dtypes; do
    "$zinf" train --config "$tmp/curve-$dt.json" --data "$data" $curve --steps "$cs" \
        --log "$tmp/curve-$dt.jsonl" > "$tmp/curve-$dt.out" 2>&1 ||
        { cat "$tmp/curve-$dt.out"; exit 1; }
done

python3 - "$tmp" "$rounds" "$every" $dtypes <<'PY'
import json, statistics, sys
tmp, rounds, every, dts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
def lines(path):
    return [json.loads(l) for l in open(path)]
big = {}
for dt in dts:
    ms, rd, wr, last, sb = [], [], [], [], 0
    for r in range(1, rounds + 1):
        L = lines(f"{tmp}/big-{dt}-{r}.jsonl")
        st = [l for l in L if "step" in l and "loss" in l][1:]
        ms += [s["ms"] for s in st]
        rd += [s["nvme_read_bytes"] for s in st]
        wr += [s["nvme_write_bytes"] for s in st]
        last.append(st[-1]["loss"])
        sb = [l["summary"]["optimizer_state_bytes"] for l in L if "summary" in l][0]
    big[dt] = (statistics.median(ms), statistics.mean(rd), statistics.mean(wr), sb, last)
f = big.get("fp32")
print(f"{'states':6} {'state MB':>9} {'step ms':>9} {'read MB/step':>13} {'write MB/step':>14}"
      f" {'x fp32: state':>14} {'step':>6} {'read':>6} {'write':>6}  last loss")
for dt in dts:
    m, rd, wr, sb, last = big[dt]
    rat = (f"{sb / f[3]:14.3f} {m / f[0]:6.3f} {rd / f[1]:6.3f} {wr / f[2]:6.3f}" if f
           else "")
    print(f"{dt:6} {sb / 1e6:9.2f} {m:9.1f} {rd / 1e6:13.2f} {wr / 1e6:14.2f} {rat}  "
          + " ".join(f"{x:.4f}" for x in last))
curves = {dt: [l["loss"] for l in lines(f"{tmp}/curve-{dt}.jsonl") if "step" in l and "loss" in l]
          for dt in dts}
n = min(len(c) for c in curves.values())
print("\n# loss curves (small model, in memory)")
print(f"{'step':>6} " + " ".join(f"{dt:>9}" for dt in dts))
for s in list(range(every, n + 1, every)) + ([n] if n % every else []):
    print(f"{s:6d} " + " ".join(f"{curves[dt][s - 1]:9.4f}" for dt in dts))
tail = {dt: statistics.mean(c[n - 20:n]) for dt, c in curves.items()}
print("mean of the last 20: " + ", ".join(
    f"{dt} {tail[dt]:.4f}" + (f" ({tail[dt] - tail['fp32']:+.4f} vs fp32)" if "fp32" in tail
                               and dt != "fp32" else "") for dt in dts))
PY
