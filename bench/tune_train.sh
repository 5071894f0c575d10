#!/usr/bin/env bash
# tune_train.sh - `zinf tune --mode train`'s search against the exhaustive grid it searches,
# side by side in one run: the grid runs every point --reps times (--exhaustive), the search
# every point once and the best quarter to --reps. Both pick by tune's rule.
#
# Reported: each one's wall time and pick; the search's pick as the grid measured it, over the
# grid's best median (the target: >= 0.9), and the search's time over the grid's (a fraction).
#
# Both tunes' JSON lines are kept as DIR/tune-grid.json and DIR/tune-search.json.
#
# usage: bench/tune_train.sh DIR [EXTRA tune OPTIONS...]
#   ZINF=build/tools/zinf  LAYERS=4 DIM=256 HEADS=4 SEQ=64 GLOBAL=8  DATA=(a text file)
#   AXES="--ranks 1,2 --stages 1,3 --offload none:none,cpu:cpu,cpu:nvme,nvme:nvme --budgets 1,0.25"
set -euo pipefail

dir=${1:?usage: bench/tune_train.sh DIR [EXTRA tune OPTIONS...]}
shift
zinf=${ZINF:-build/tools/zinf}
L=${LAYERS:-4} C=${DIM:-256} H=${HEADS:-4} T=${SEQ:-64} G=${GLOBAL:-8}
data=${DATA:-/usr/share/common-licenses/GPL-3}
axes=${AXES:---ranks 1,2 --stages 1,3 --offload none:none,cpu:cpu,cpu:nvme,nvme:nvme --budgets 1,0.25}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

cat > "$tmp/base.json" <<JSON
{"train_batch_size": $G,
 "zinf": {"device": "emulated", "train": {"layers": $L, "dim": $C, "heads": $H, "seq": $T}}}
JSON

run() { # NAME EXTRA...: one tune, its JSON lines in $tmp/NAME.json and its seconds
    local name=$1
    shift
    local t0 t1
    t0=$(date +%s.%N)
    # shellcheck disable=SC2086
    "$zinf" tune --mode train --config "$tmp/base.json" --data "$data" --path "$dir" $axes \
        --json "$@" > "$tmp/$name.json" 2> "$tmp/$name.err" ||
        { tail -5 "$tmp/$name.err" >&2; exit 1; }
    t1=$(date +%s.%N)
    echo "$t0 $t1" > "$tmp/$name.time"
    cp "$tmp/$name.json" "$dir/tune-$name.json"
}

echo "# zinf tune --mode train: search against the exhaustive grid, ${L}x${C}, seq $T, global batch $G"
echo "# axes: $axes $*"
run grid --exhaustive "$@"
run search "$@"
python3 - "$tmp" <<'PY'
import json, sys
tmp = sys.argv[1]
def load(name):
    pts, pick = [], None
    for l in open(f"{tmp}/{name}.json"):
        if not l.startswith("{"):
            continue
        j = json.loads(l)
        if "config" in j:
            pick = j
        else:
            pts.append(j)
    t0, t1 = map(float, open(f"{tmp}/{name}.time").read().split())
    return pts, pick, t1 - t0
def key(p):
    return (p["ranks"], p["stage"], p["micro_batch"], p["param"], p["optimizer"],
            p["device_bytes"], p["host_bytes"])
def desc(p):
    return (f'{p["ranks"]} rank(s) stage {p["stage"]}, micro {p["micro_batch"]} x '
            f'{p["accumulation"]}, {p["param"]}/{p["optimizer"]}, '
            f'{p["device_bytes"] >> 20}M/{p["host_bytes"] >> 20}M')
grid, gpick, gsec = load("grid")
search, spick, ssec = load("search")
gm = {key(p): p for p in grid if "median" in p}
best = max(gm.values(), key=lambda p: p["median"])
gp = next(p for p in grid if p.get("picked"))
sp = next(p for p in search if p.get("picked"))
pruned = sum(1 for p in grid if "pruned" in p)
runs_g = sum(len(p.get("tokens_per_s", [])) for p in grid)
runs_s = sum(len(p.get("tokens_per_s", [])) for p in search)
print(f"points: {len(grid)}, pruned by the budget check: {pruned}")
print(f"grid:   {runs_g} runs in {gsec:.0f} s; best median {best['median']:.0f} tokens/s "
      f"({desc(best)})")
print(f"        picked {desc(gp)}: {gp['median']:.0f} tokens/s")
print(f"search: {runs_s} runs in {ssec:.0f} s; picked {desc(sp)}: "
      f"{sp['median']:.0f} tokens/s in its own runs")
g_of_s = gm.get(key(sp))
if g_of_s:
    print(f"the search's pick as the grid measured it: {g_of_s['median']:.0f} tokens/s = "
          f"{g_of_s['median'] / best['median']:.3f} x the grid's best median "
          f"(target >= 0.9); the grid's own pick: {gp['median'] / best['median']:.3f}")
else:
    print("the search's pick was not measured by the grid")
print(f"time: search / grid = {ssec / gsec:.3f}")
print("the grid's five best medians (tokens/s of each run):")
for p in sorted(gm.values(), key=lambda p: -p["median"])[:5]:
    runs = " ".join(f"{x:.0f}" for x in p["tokens_per_s"])
    mark = " <- picked" if p.get("picked") else " tie" if p.get("tie") else ""
    print(f"  {p['median']:7.0f}  [{runs}]  {desc(p)}{mark}")
PY
