#!/usr/bin/env bash
# tune_train.sh - `zinf tune --mode train`'s search against the exhaustive grid it searches,
# side by side in one run: the grid runs every point --reps times (--exhaustive), the search
# every point once and the best quarter to --reps. Both pick by tune's rule.
#
# Reported: each one's wall time and pick; the search's pick as the grid measured it, over the
# grid's best median, and the search's time over the grid's (a fraction). Runs of one point
# spread widely on a small shared machine (a third between runs), and the grid's best is the
# luckiest of many medians; so the search's pick, the grid's pick and the grid's best point
# are then run again side by side, alternating, VERIFY rounds each (default 5), and the
# target (the search's pick >= 0.9 x the best point) is judged on those medians.
#
# Both tunes' JSON lines are kept as DIR/tune-grid.json and DIR/tune-search.json.
#
# usage: bench/tune_train.sh DIR [EXTRA tune OPTIONS...]
#   ZINF=build/tools/zinf  LAYERS=4 DIM=256 HEADS=4 SEQ=64 GLOBAL=8  DATA=(a text file)
#   AXES="--ranks 1,2 --stages 1,3 --offload none:none,cpu:cpu,cpu:nvme,nvme:nvme --budgets 1,0.25"
#   VERIFY=5  REUSE=1: judge DIR/tune-grid.json and DIR/tune-search.json of an earlier run again
#   (the side-by-side rounds only)
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
if [ -z "${REUSE:-}" ]; then
  run grid --exhaustive "$@"
  run search "$@"
else
  for name in grid search; do
    cp "$dir/tune-$name.json" "$tmp/$name.json"
    echo "0 1" > "$tmp/$name.time"
  done
fi
python3 - "$tmp" "$zinf" "$data" "$dir" "${VERIFY:-5}" "$*" <<'PY'
import json, os, shutil, statistics as st, subprocess, sys
tmp, zinf, data, outdir, verify = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
extra = sys.argv[6].split()
steps = int(extra[extra.index("--steps") + 1]) if "--steps" in extra else 3
warmup = int(extra[extra.index("--warmup") + 1]) if "--warmup" in extra else 2
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

# Side by side: the points' configs, as tune writes them (the search's pick's config with the
# point's keys), run alternately.
base = spick["config"]
def config_of(p):
    c = json.loads(json.dumps(base))
    c["train_micro_batch_size_per_gpu"] = p["micro_batch"]
    c["gradient_accumulation_steps"] = p["accumulation"]
    z = c["zero_optimization"]
    z["stage"] = p["stage"]
    z["offload_param"]["device"] = p["param"]
    z["offload_optimizer"]["device"] = p["optimizer"]
    c["zinf"]["device_bytes"] = p["device_bytes"]
    c["zinf"]["host_bytes"] = p["host_bytes"]
    c["zinf"]["nvme_paths"] = [f"{tmp}/swap"]
    c["zinf"]["train"].pop("steps", None)
    return c
pts = {"search pick": sp, "grid pick": gp, "grid best": best}
seq = base["zinf"]["train"]["seq"]
tps = {k: [] for k in pts}
for r in range(verify):
    for name, p in pts.items():
        cfg, log = f"{tmp}/v.json", f"{tmp}/v.jsonl"
        json.dump(config_of(p), open(cfg, "w"))
        shutil.rmtree(f"{tmp}/swap", ignore_errors=True)
        if os.path.exists(log): os.unlink(log)
        cmd = [zinf, "train", "--config", cfg, "--data", data, "--steps", str(warmup + steps),
               "--overwrite", "--log", log]
        if p["ranks"] > 1:
            cmd = [zinf, "launch", "-n", str(p["ranks"]), "--"] + cmd
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rows = [json.loads(l) for l in open(log) if l.startswith('{"step"')]
        ms = sum(x["ms"] for x in rows if x["step"] > warmup)
        g = base["train_batch_size"]
        tps[name].append(g * seq * steps / (ms / 1e3))
print(f"side by side, {verify} rounds alternating (tokens/s of each run):")
med = {k: st.median(v) for k, v in tps.items()}
for k, v in tps.items():
    print(f"  {k:14s} {med[k]:7.0f}  [{' '.join(f'{x:.0f}' for x in v)}]  {desc(pts[k])}")
print(f"the search's pick / the grid's best point: {med['search pick'] / med['grid best']:.3f} "
      f"(target >= 0.9); the grid's pick / its best point: "
      f"{med['grid pick'] / med['grid best']:.3f}")
PY
