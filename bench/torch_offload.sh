#!/usr/bin/env bash
# torch_offload.sh - a GPT trained three ways, side by side in one run, rounds interleaved:
# plain PyTorch in memory, zinf.torch with the whole state on NVMe under device and host
# budgets of a tenth of it, and DeepSpeed ZeRO-3 with parameters and optimizer states on NVMe
# (its CPU accelerator, one process). The model is the example's GPT
# (examples/torch_offload.py), or transformers' GPT2LMHeadModel or LlamaForCausalLM built
# from a config (MODEL=hf-gpt2, hf-llama), its parameters in fp32 or bf16 (DTYPE). Each run
# is bench/torch_offload.py; this prints each run's median step and the ratios of the medians.
#
# usage: bench/torch_offload.sh DIR [ROUNDS]          (default 2)
#   MODEL=gpt|hf-gpt2|hf-llama DTYPE=fp32|bf16 VOCAB=4096 (hf-*)
#   LAYERS=8 DIM=512 HEADS=8 CONTEXT=256 BATCH=4 STEPS=6 BUDGET=0.1 TEXT=/usr/share/common-licenses/GPL-3
#   OVERLAP=1 (zinf.torch.AdamW(overlap=): 0 updates inside step())
#   MODES="plain zinf deepspeed"  VENV (bench/ds_env.sh: torch and deepspeed from PyPI;
#   transformers too for the hf-* models)
#   FLOOR=1: `zinf bench` on DIR first (ZINF=build/tools/zinf, 2 GiB, block 1M, qd 32), and
#   zinf's step against its bounds: plain's step, the IO floor (its NVMe bytes a step over
#   zinf bench's rates) and the CPU floor (its CPU seconds a step over the cores)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:?usage: bench/torch_offload.sh DIR [ROUNDS]}
rounds=${2:-2}
modes=${MODES:-plain zinf deepspeed}
model=${MODEL:-gpt}
. bench/ds_env.sh
if [ "$model" != gpt ] && ! "$py" -c 'import transformers' >/dev/null 2>&1; then
  "${py%/python}/pip" install -q transformers
fi
args=(--model "$model" --dtype "${DTYPE:-fp32}" --vocab "${VOCAB:-0}" --text "${TEXT:-/usr/share/common-licenses/GPL-3}" --layers "${LAYERS:-8}" --dim "${DIM:-512}"
      --heads "${HEADS:-8}" --context "${CONTEXT:-256}" --batch "${BATCH:-4}"
      --steps "${STEPS:-6}" --budget "${BUDGET:-0.1}" --overlap "${OVERLAP:-1}")
ls build/python/zinf/_zinf*.so >/dev/null 2>&1 ||
  { echo "torch_offload.sh: build the project first (scripts/setup.sh)" >&2; exit 1; }
mkdir -p "$dir"
out=$dir/runs.jsonl
: >"$out"
rates="0 0"
if [ -n "${FLOOR:-}" ]; then
  rates=$("${ZINF:-build/tools/zinf}" bench --path "$dir" --size 2G --block-size 1M \
    --queue-depth 32 --json | python3 -c 'import json,sys
rows={r["op"]: r for r in map(json.loads, sys.stdin)}
assert all(r["verified"] for r in rows.values())
print(rows["read"]["GBps"], rows["write"]["GBps"])')
  rm -f "$dir/zinf-bench.dat"
fi
for r in $(seq "$rounds"); do
  for m in $modes; do
    rm -rf "${dir:?}/$m"
    PYTHONPATH=build/python "$py" bench/torch_offload.py --mode "$m" --nvme "$dir/$m" "${args[@]}" \
      2>"$dir/$m.err" | tail -1 | tee -a "$out" ||
      { echo "torch_offload.sh: $m failed:" >&2; tail -20 "$dir/$m.err" >&2; exit 1; }
  done
done
python3 - "$out" $rates "$(nproc)" <<'EOF'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
brd, bwr, cores = float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
by = {}
for r in runs:
    by.setdefault(r["mode"], []).append(r)
med = {m: statistics.median(x["median_ms"] for x in rs) for m, rs in by.items()}
r0 = runs[0]
print(f"\n{r0.get('model', 'gpt')} {r0.get('dtype', 'fp32')}: {r0['params'] / 1e6:.1f}M parameters, "
      f"state {r0['state_bytes'] / 2**20:.0f} MiB; median step over {len(by[r0['mode']])} runs "
      f"of each:")
for m, rs in by.items():
    rss = max(x["max_rss_bytes"] for x in rs) / 2**20
    cpu = statistics.median(x.get("cpu_s_per_step", float("nan")) for x in rs)
    extra = ""
    if m == "zinf":
        z = rs[-1]
        n = len(z["steps_ms"])
        extra = (f"  budgets {z['budget_bytes'] / 2**20:.0f} MiB "
                 f"({z.get('budget_fraction', 0):.2f} of the state), peaks device "
                 f"{z['device_peak_bytes'] / 2**20:.0f} host {z['host_peak_bytes'] / 2**20:.0f} MiB, "
                 f"NVMe read {z['nvme_read_per_step'] / 2**20:.0f} written "
                 f"{z['nvme_written_per_step'] / 2**20:.0f} MiB/step (steps 2..), blocked "
                 f"{z['blocked_ms'] / n:.0f} ms/step")
    print(f"  {m:9s} {med[m]:8.0f} ms   CPU {cpu:6.2f} s/step   max RSS {rss:6.0f} MiB{extra}")
    ph = [x["phases_ms"] for x in rs if "phases_ms" in x]
    if ph:
        bl = [x.get("blocked_phases_ms") for x in rs] if m == "zinf" else []
        print("            median ms by phase: " + ", ".join(
            f"{k} {statistics.median(p[k] for p in ph):.0f}" +
            (f" (blocked {statistics.median(b[k] for b in bl):.0f})" if bl and bl[0] else "")
            for k in ph[0]))
    th = rs[-1].get("cpu_s_per_step_by_thread")
    if th:
        print("            CPU s/step by thread: " + ", ".join(
            f"{k} {v:.2f}" for k, v in sorted(th.items(), key=lambda kv: -kv[1]) if v >= 0.005))
if "plain" in med:
    for m in med:
        if m != "plain":
            print(f"  {m} / plain: {med[m] / med['plain']:.2f}x the time")
if brd and "zinf" in by:
    zs = by["zinf"]
    rd = statistics.median(x["nvme_read_per_step"] for x in zs)
    wr = statistics.median(x["nvme_written_per_step"] for x in zs)
    io = (rd / (brd * 1e9) + wr / (bwr * 1e9)) * 1e3
    cpu = statistics.median(x["cpu_s_per_step"] for x in zs) / cores * 1e3
    bounds = {"IO floor": io, "CPU floor": cpu}
    if "plain" in med:
        bounds["plain"] = med["plain"]
    which = max(bounds, key=bounds.get)
    print(f"  zinf bench on DIR: read {brd} GB/s, write {bwr} GB/s; zinf's IO floor {io:.0f} ms "
          f"({rd / 1e9:.3f} GB read, {wr / 1e9:.3f} written a step), CPU floor {cpu:.0f} ms "
          f"(its CPU seconds a step over {cores} cores)")
    print(f"  zinf / max(plain, IO floor, CPU floor) = {med['zinf']:.0f} / "
          f"{bounds[which]:.0f} ({which}): {med['zinf'] / bounds[which]:.2f}x")
if "zinf" in med and "deepspeed" in med:
    print(f"  zinf / deepspeed: {med['zinf'] / med['deepspeed']:.2f}x the time "
          f"(deepspeed {by['deepspeed'][0].get('deepspeed')})")
for m, rs in by.items():
    if m != "plain" and "plain" in by:
        a, b = by["plain"][0]["losses"], rs[0]["losses"]
        gap = max(abs(x - y) / abs(x) for x, y in zip(a, b))
        print(f"  losses of {m} against plain: worst relative gap {gap:.1e}")
EOF
