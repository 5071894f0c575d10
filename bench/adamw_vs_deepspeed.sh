#!/usr/bin/env bash
# adamw_vs_deepspeed.sh - zinf's AdamW step (bench/adamw: src/train/adamw.c next to this
# machine's STREAM-like bandwidth bound, measured in the same run) against DeepSpeed's CPU
# AdamW (bench/ds_adam_bench.py: DeepSpeedCPUAdam, the cpu_adam op ZeRO-Offload runs), with
# the same element count, hyperparameters and threads. The two take turns at going first,
# one run each per round, ROUNDS times; prints each round, the medians, the spread (min-max),
# the ratio zinf/DeepSpeed (target >= 1.0) and zinf's fraction of the bound (target >= 0.95).
#
#   bench/adamw_vs_deepspeed.sh [ELEMS] [THREADS] [ROUNDS]      (defaults: 64M, 2, 5)
#   ADAMW=build/bench/adamw  VENV=/var/tmp/zinf-ds-venv  REPS=10
#
# A round's figure for each side is its best of REPS timed steps (bench/adamw reports each
# row's best; DeepSpeed's median step is printed beside it). zinf's figure is its
# adamw/<kernel chosen at run time> row at THREADS threads; its bound is the best of its
# bandwidth rows at THREADS threads / 28 B per element, and its fraction is bench/adamw's
# ratio_to_bound for that row. Both check their results: bench/adamw against its scalar
# reference and a bit-exact replay of the timed steps on sampled elements, DeepSpeed's
# against a float64 replay on sampled elements.
#
# Sets up what it needs when missing, as bench/io_vs_deepspeed.sh does: a venv with torch and
# deepspeed from PyPI (several GB, once); DeepSpeed builds its cpu_adam op on first use
# (minutes, once; done here before the first round). Not part of the test suite; figures go
# to bench/RESULTS.md.
set -euo pipefail
elems=${1:-64M}
threads=${2:-2}
rounds=${3:-5}
adamw=${ADAMW:-build/bench/adamw}
venv=${VENV:-/var/tmp/zinf-ds-venv}
reps=${REPS:-10}
here=$(cd "$(dirname "$0")" && pwd)

NEED_AIO=0 . "$here/ds_env.sh"
# The op is built (or found built) before anything is timed.
"$py" -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(verbose=False)' \
  >/dev/null 2>&1

run_zinf() {
  local out
  out=$(OMP_NUM_THREADS=$threads "$adamw" --elems "$elems" --threads "$threads" --reps "$reps" \
        --json) || { echo "bench/adamw failed: $out" >&2; exit 1; }
  read -r z zb zf kern zok <<<"$(printf '%s\n' "$out" | "$py" -c '
import json, sys
rows = [json.loads(l) for l in sys.stdin if l.startswith("{")]
s = [r for r in rows if r.get("summary")][0]
t = int(sys.argv[1])
row = [r for r in rows if r.get("kernel") == "adamw/" + s["kernel"] and r.get("threads") == t][0]
ok = all(r["verified"] for r in rows)
print("%.4f %.4f %.4f %s %s" % (row["gelem_per_s"], s["threads_%d" % t]["bound_gelem_per_s"],
      row["ratio_to_bound"], s["kernel"], "true" if ok else "false"))' "$threads")"
  [ "$zok" = true ] || { echo "bench/adamw not verified: $out" >&2; exit 1; }
}
run_ds() {
  local out
  out=$("$py" "$here/ds_adam_bench.py" --elems "$elems" --threads "$threads" --reps "$reps" \
        2>/dev/null) || { echo "deepspeed cpu_adam failed: $out" >&2; exit 1; }
  read -r d dmed simd dok <<<"$(printf '%s\n' "$out" | "$py" -c '
import json, sys
o = [json.loads(l) for l in sys.stdin if l.startswith("{")][-1]
print(o["best_gelem_per_s"], o["median_gelem_per_s"], o["simd"], "true" if o["verified"] else "false")')"
  [ "$dok" = true ] || { echo "deepspeed cpu_adam not verified: $out" >&2; exit 1; }
}

ver=$("$py" -c 'import importlib.metadata as m; print(m.version("deepspeed"), m.version("torch"))')
echo "# adamw_vs_deepspeed: $elems fp32 elements, $threads threads, best of $reps steps per run, $rounds rounds"
echo "# $(uname -sr), $(nproc) cpus ($(grep -m 1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')), load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# deepspeed ${ver% *}, torch ${ver#* }, $("$py" -V); lr 1e-4, betas 0.9 0.95, eps 1e-8, weight_decay 0.1, bias correction, adamw_mode"
echo "# Gelem/s: elements / step time (28 B per element moved); bound: bench/adamw's best bandwidth row at $threads threads / 28 B"
echo "# round  first  zinf_Gelem/s  ds_Gelem/s (median step)  zinf/ds  bound_Gelem/s  zinf/bound"
zs= ds= bs= fs=
for r in $(seq 1 "$rounds"); do
  if [ $((r % 2)) = 1 ]; then first=zinf; run_zinf; run_ds
  else first=ds; run_ds; run_zinf; fi
  zs+="$z "; ds+="$d "; bs+="$zb "; fs+="$zf "
  printf '# %5s %6s %13.4f %11.4f %13s %8.3f %14.4f %11.3f\n' "$r" "$first" "$z" "$d" "($dmed)" \
    "$(ratio "$z" "$d")" "$zb" "$zf"
done

read -r zm zlo zhi <<<"$(echo "$zs" | stats)"
read -r dm dlo dhi <<<"$(echo "$ds" | stats)"
read -r bm blo bhi <<<"$(echo "$bs" | stats)"
read -r fm flo fhi <<<"$(echo "$fs" | stats)"
rd=$(ratio "$zm" "$dm")
echo
printf '%-30s %8s %17s\n' side Gelem/s "min-max"
printf '%-30s %8.4f %17s\n' "zinf adamw/$kern" "$zm" "$zlo-$zhi"
printf '%-30s %8.4f %17s\n' "deepspeed cpu_adam ($simd)" "$dm" "$dlo-$dhi"
printf '%-30s %8.4f %17s\n' "bound (bench/adamw)" "$bm" "$blo-$bhi"
echo "ratio zinf/deepspeed (medians): $rd (target >= 1.0: $(met "$rd" 1.0))"
echo "zinf / bound (median of rounds): $fm, min-max $flo-$fhi (target >= 0.95: $(met "$fm" 0.95))"
echo "every run verified"
