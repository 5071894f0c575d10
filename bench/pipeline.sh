#!/bin/sh
# bench/pipeline.sh - zinf train's model-parallel layouts against ZeRO ranks on this
# machine's CPU ranks, at one global batch: one rank accumulating M micro-batches, ZeRO-1 and
# ZeRO-3 over N ranks (M / N each), N pipeline stages (M micro-batches through them), N
# tensor-parallel ranks and N sequence-parallel ranks (M each, every rank a share of each).
# Prints each layout's tokens/s, its per-rank peaks, and the pipeline's bubble, measured and
# 1F1B's.
#
#   bench/pipeline.sh [ZINF_BIN] [N] [M] [STEPS]     (defaults: build/tools/zinf 2 8 4)
#
# The model: 8 blocks of width 512 (25.3M parameters), sequences of 128, micro-batches of 2.
set -eu
Z=${1:-build/tools/zinf}
N=${2:-2}
M=${3:-8}
STEPS=${4:-4}
DATA=/usr/share/common-licenses/GPL-3
W=$(mktemp -d "${TMPDIR:-/tmp}/zinf-pipe-bench.XXXXXX")
trap 'rm -rf "$W"' EXIT
model='"layers": 8, "dim": 512, "heads": 8, "seq": 128, "seed": 5'
cfg() { # name accum extra
    printf '{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": %s, %s "zinf": {"device": "emulated", "train": {%s}}}\n' \
        "$2" "$3" "$model" > "$W/$1.json"
}
cfg one "$M" ''
cfg z1 $((M / N)) '"zero_optimization": {"stage": 1},'
cfg z3 $((M / N)) '"zero_optimization": {"stage": 3},'
cfg pp "$M" "\"pipeline\": {\"stages\": $N},"
cfg tp "$M" "\"tensor_parallel\": {\"autotp_size\": $N},"
cfg sp "$M" "\"sequence_parallel_size\": $N,"
run() { # name ranks
    if [ "$2" = 1 ]; then
        "$Z" train --config "$W/$1.json" --data $DATA --steps "$STEPS" --log "$W/$1.jsonl" > "$W/$1.out" 2>&1
    else
        "$Z" launch -n "$2" -- "$Z" train --config "$W/$1.json" --data $DATA --steps "$STEPS" \
            --log "$W/$1.jsonl" > "$W/$1.out" 2>&1
    fi
}
run one 1
run z1 "$N"
run z3 "$N"
run pp "$N"
run tp "$N"
run sp "$N"
python3 - "$W" "$N" <<'PY'
import glob, json, sys
w, n = sys.argv[1], int(sys.argv[2])
def rows(name):
    out = []
    for f in sorted(glob.glob(f"{w}/{name}.jsonl*")):
        steps, summ = [], None
        for line in open(f):
            d = json.loads(line)
            if "step" in d: steps.append(d)
            if "summary" in d: summ = d["summary"]
        out.append((steps, summ))
    return out
base = None
print(f"{'layout':<24}{'tokens/s':>10}{'vs 1 rank':>10}{'host peak/rank':>16}{'dev peak/rank':>15}{'loss':>10}")
for name, label in (("one", "1 rank"), ("z1", f"ZeRO-1 x{n}"), ("z3", f"ZeRO-3 x{n}"),
                    ("pp", f"pipeline x{n}"), ("tp", f"tensor parallel x{n}"),
                    ("sp", f"sequence parallel x{n}")):
    r = rows(name)
    steps = r[0][0]
    later = steps[1:] or steps  # the first step warms the tiers
    tps = sum(s["tokens_per_s"] for s in later) / len(later)
    host = max(s["host"]["peak_bytes"] for _, s in r) / 2**20
    dev = max(s["device"]["peak_bytes"] for _, s in r) / 2**20
    if base is None: base = tps
    print(f"{label:<24}{tps:>10.0f}{tps / base:>10.2f}{host:>13.1f} MiB{dev:>12.1f} MiB{steps[-1]['loss']:>10.4f}")
    if name == "pp":
        for _, s in r:
            print(f"  stage {s['pp_stage']}: blocks {s['first_block']}-{s['first_block'] + s['blocks'] - 1}, "
                  f"bubble {100 * s['pipeline_bubble']:.1f}% (1F1B at equal stages {100 * s['pipeline_bubble_ideal']:.1f}%), "
                  f"waited {s['pipeline_wait_seconds']:.2f} s, sent {s['pipeline_bytes'] / 2**20:.1f} MiB")
PY
