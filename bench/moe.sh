#!/bin/sh
# bench/moe.sh - zinf train's mixture-of-experts blocks against a dense model of about the
# same total parameters, both offloaded to NVMe with budgets far below the state: the NVMe
# bytes a step reads, the experts' share of them, the experts used of those that exist, and
# tokens/s. A MoE step reads the attention, the gates and the experts its tokens were routed
# to (and updates only those); the dense step reads everything.
#
#   bench/moe.sh [ZINF_BIN] [STEPS] [NVME_DIR]      (defaults: build/tools/zinf 6 a temp dir)
#
# Also: top-2 without asking for the experts ahead of their turn (--expert-prefetch 0),
# whose hit rate (the experts' tensor fetches that found them on the device) the prefetch
# is measured against; and at a global batch of 2 micro-batches, one rank accumulating
# them against 2 expert-parallel ranks (moe.ep_size 2: each holds, reads and updates 4 of
# each block's 8 experts): the NVMe bytes of all ranks a step (rank 0's besides the
# experts'), the state one rank holds (parameters, gradients, Adam's m and v).
#
# The models: width 256, 4 heads, sequences of 64, micro-batches of 2; MoE: 2 blocks of 8
# experts (top-1 and top-2); dense: 11 blocks (each MoE block holds 4 C^2 of attention and
# 8 x 8 C^2 of experts, 68 C^2, against a dense block's 12 C^2).
set -eu
Z=${1:-build/tools/zinf}
STEPS=${2:-6}
W=$(mktemp -d "${3:-${TMPDIR:-/tmp}}/zinf-moe-bench.XXXXXX")
trap 'rm -rf "$W"' EXIT
DATA=/usr/share/common-licenses/GPL-3
cfg() { # name layers moe
    printf '{"train_micro_batch_size_per_gpu": 2, %s "zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "%s/%s"}, "offload_optimizer": {"device": "nvme", "nvme_path": "%s/%s"}}, "zinf": {"device": "emulated", "device_bytes": "24M", "host_bytes": "24M", "train": {"layers": %s, "dim": 256, "heads": 4, "seq": 64, "seed": 5, "precision": "fp32"}}}\n' \
        "$3" "$W" "$1" "$W" "$1" "$2" > "$W/$1.json"
}
cfg top1 2 '"moe": {"num_experts": 8, "top_k": 1},'
cfg top2 2 '"moe": {"num_experts": 8, "top_k": 2},'
cfg top2np 2 '"moe": {"num_experts": 8, "top_k": 2},'
cfg top2acc 2 '"moe": {"num_experts": 8, "top_k": 2},'
cfg ep2 2 '"moe": {"num_experts": 8, "top_k": 2, "ep_size": 2},'
cfg dense 11 ''
run() { # name [zinf train options...]
    n=$1
    shift
    "$Z" train --config "$W/$n.json" --data $DATA --steps "$STEPS" --log "$W/$n.jsonl" "$@" > "$W/$n.out" 2>&1
}
run top1
run top2
run top2np --expert-prefetch 0
run dense
run top2acc --accumulate 2
"$Z" launch -n 2 -- "$Z" train --config "$W/ep2.json" --data $DATA --steps "$STEPS" --log "$W/ep2.jsonl" > "$W/ep2.out" 2>&1
python3 - "$W" <<'PY'
import json, sys
w = sys.argv[1]
print(f"{'model':<34}{'params':>10}{'NVMe read/step':>16}{'experts read':>14}{'used':>10}{'hit rate':>10}{'tokens/s':>10}{'state/rank':>12}")
rows = (("top1", "MoE 2 x 8, top-1"), ("top2", "MoE 2 x 8, top-2"),
        ("top2np", "MoE 2 x 8, top-2, no prefetch"), ("dense", "dense, 11 blocks"),
        ("top2acc", "top-2, 1 rank x 2 micro-batches"), ("ep2", "top-2, 2 expert-parallel ranks"))
for name, label in rows:
    steps, summ = [], None
    for line in open(f"{w}/{name}.jsonl"):
        d = json.loads(line)
        if "step" in d: steps.append(d)
        if "summary" in d: summ = d["summary"]
    later = steps[1:]  # the first step reads what the start wrote
    rd = sum(s["nvme_read_GBps"] * 1e9 * s["ms"] / 1e3 for s in later) / len(later)
    ex = sum(s.get("expert_bytes_read", 0) for s in later) / len(later)
    used = sum(s.get("experts_used", 0) for s in later) / len(later)
    fe = sum(s.get("expert_fetches", 0) for s in later)
    hi = sum(s.get("expert_hits", 0) for s in later)
    have = later[0].get("experts", 0)
    tps = sum(s["tokens_per_s"] for s in later) / len(later)
    ustr = f"{used:.1f}/{have}" if have else "-"
    hstr = f"{100 * hi / fe:.1f}%" if fe else "-"
    state = summ["model_state_bytes"] / 2**20
    print(f"{label:<34}{summ['params']:>10}{rd / 2**20:>12.1f} MiB{ex / 2**20:>10.1f} MiB{ustr:>10}{hstr:>10}{tps:>10.0f}{state:>8.1f} MiB")
PY
