#!/bin/sh
# bench/moe.sh - zinf train's mixture-of-experts blocks against a dense model of about the
# same total parameters, both offloaded to NVMe with budgets far below the state: the NVMe
# bytes a step reads, the experts' share of them, the experts used of those that exist, and
# tokens/s. A MoE step reads the attention, the gates and the experts its tokens were routed
# to (and updates only those); the dense step reads everything.
#
#   bench/moe.sh [ZINF_BIN] [STEPS] [NVME_DIR]      (defaults: build/tools/zinf 6 a temp dir)
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
cfg dense 11 ''
for n in top1 top2 dense; do
    "$Z" train --config "$W/$n.json" --data $DATA --steps "$STEPS" --log "$W/$n.jsonl" > "$W/$n.out" 2>&1
done
python3 - "$W" <<'PY'
import json, sys
w = sys.argv[1]
print(f"{'model':<22}{'params':>12}{'NVMe read/step':>16}{'experts read':>14}{'experts used':>14}{'tokens/s':>10}")
for name, label in (("top1", "MoE 2 x 8, top-1"), ("top2", "MoE 2 x 8, top-2"), ("dense", "dense, 11 blocks")):
    steps, summ = [], None
    for line in open(f"{w}/{name}.jsonl"):
        d = json.loads(line)
        if "step" in d: steps.append(d)
        if "summary" in d: summ = d["summary"]
    later = steps[1:]  # the first step reads what the start wrote
    rd = sum(s["nvme_read_GBps"] * 1e9 * s["ms"] / 1e3 for s in later) / len(later)
    ex = sum(s.get("expert_bytes_read", 0) for s in later) / len(later)
    used = sum(s.get("experts_used", 0) for s in later) / len(later)
    have = later[0].get("experts", 0)
    tps = sum(s["tokens_per_s"] for s in later) / len(later)
    ustr = f"{used:.1f} of {have}" if have else "-"
    print(f"{label:<22}{summ['params']:>12}{rd / 2**20:>12.1f} MiB{ex / 2**20:>10.1f} MiB{ustr:>14}{tps:>10.0f}")
PY
