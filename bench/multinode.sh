#!/usr/bin/env bash
# multinode.sh - what crossing nodes costs `zinf train`: the same model, data and global batch
# (4 ranks of --batch B) run three ways at ZeRO stages 1 and 3:
#   2 nodes x 2 ranks, hierarchical  `zinf launch --hostfile` (the default: shared memory in a
#                                    node, point-to-point MPI between one leader per node)
#   2 nodes x 2 ranks, flat          the same with ZINF_COMM_RANKS_PER_NODE=1 given to the ranks:
#                                    every rank its own node, talking MPI to every other
#   1 node x 4 ranks                 `zinf launch -n 4` (shared memory only)
# For each it prints the bytes that crossed between the nodes per step (the --log summaries'
# net_bytes_out summed over every rank, over the steps run), the collectives that crossed,
# and the step time (rank 0's median of the steps after the first); then the ratios flat over
# hierarchical bytes and 2 x 2 over 1 x 4 time, and whether the three runs' losses and
# parameter digests are bitwise the same (zinf compare), as they must be.
#
# The nodes are tests/multinode/nodes.sh's: Linux namespaces on this one machine (root
# needed), each with its own host name, /dev/shm and swap folder; MPI between them goes over
# loopback TCP, and they share this machine's CPUs and memory. The byte counts are exact
# whatever the machine; the time ratio is what this machine shows, not what a network would.
#
# Not here: more than 2 nodes, GPUs (NCCL), one rank's run (bench/zero_train.sh compares the
# ranks with one rank accumulating).
#
# usage: bench/multinode.sh [DIR]   (default ./multinode-bench; removed at the end)
#   ZINF=build/tools/zinf LAYERS=8 DIM=768 HEADS=12 SEQ=64 BATCH=1 STEPS=4 STAGES="1 3"
#   OFFLOAD=nvme (parameters and optimizer states in each node's swap folder under DIR) or cpu
#   (in each rank's host tier); DEVICE_BYTES / HOST_BYTES: each rank's budgets (default
#   256M / 512M with nvme, 256M / 2G with cpu)
#   RESULTS=FILE: the output is also appended to FILE
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
dir=${1:-multinode-bench}
zinf=${ZINF:-build/tools/zinf}
L=${LAYERS:-8} C=${DIM:-768} H=${HEADS:-12} T=${SEQ:-64} B=${BATCH:-1} S=${STEPS:-4}
stages=${STAGES:-1 3}
offload=${OFFLOAD:-nvme}
case "$offload" in
nvme) dev=${DEVICE_BYTES:-256M} host=${HOST_BYTES:-512M} ;;
cpu) dev=${DEVICE_BYTES:-256M} host=${HOST_BYTES:-2G} ;;
*) echo "multinode.sh: OFFLOAD=$offload: nvme or cpu" >&2; exit 2 ;;
esac
data=${DATA:-/usr/share/common-licenses/GPL-3}
[ "$S" -ge 2 ] || { echo "multinode.sh: STEPS=$S: at least 2 (the first step is not timed)" >&2; exit 2; }
[ -x "$zinf" ] || { echo "multinode.sh: ZINF=$zinf is not a program (build first)" >&2; exit 2; }
[ -r "$data" ] || { echo "multinode.sh: DATA=$data cannot be read" >&2; exit 2; }
case "$zinf" in /*) ;; *) zinf=$PWD/$zinf ;; esac
case "$data" in /*) ;; *) data=$PWD/$data ;; esac

. "$here/../tests/multinode/nodes.sh"
nodes_need
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
swap=$dir/swap # each node's own folder (DIR/nodes/nodeK) is mounted here, in that node
nodes_up 2 "$dir/nodes" "$swap" || exit 1
trap 'nodes_down; rm -rf "$dir"' EXIT
hostfile=$dir/nodes/hostfile
if [ -n "${RESULTS:-}" ]; then
  exec > >(tee -a "$RESULTS")
fi
# Four ranks on this machine's CPUs: one thread each in every run, so that the sums inside a
# rank (OpenBLAS's depend on the thread count) are the same whatever the layout.
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive

config() { # stage run -> config path
  local f=$dir/s$1-$2.json
  if [ "$offload" = nvme ]; then
    cat > "$f" <<JSON
{"zero_optimization": {"stage": $1,
 "offload_param": {"device": "nvme", "nvme_path": "$swap/$2"},
 "offload_optimizer": {"device": "nvme", "nvme_path": "$swap/$2"}},
 "aio": {"block_size": 1048576, "queue_depth": 16},
 "zinf": {"device": "emulated", "device_bytes": "$dev", "host_bytes": "$host"}}
JSON
  else
    cat > "$f" <<JSON
{"zero_optimization": {"stage": $1,
 "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
 "zinf": {"device": "emulated", "device_bytes": "$dev", "host_bytes": "$host"}}
JSON
  fi
  echo "$f"
}

args=(--data "$data" --layers "$L" --dim "$C" --heads "$H" --seq "$T" --batch "$B" --steps "$S")

# run NAME STAGE LAYOUT: one run, its logs DIR/NAME.jsonl(.rank-R), its output DIR/NAME.out.
run() {
  local cfg log=$dir/$1.jsonl t0 rc=0
  cfg=$(config "$2" "$1")
  t0=$(date +%s)
  case "$3" in
  hier) nodes_run "$zinf" launch --hostfile "$hostfile" -- "$zinf" train --config "$cfg" \
          "${args[@]}" --log "$log" > "$dir/$1.out" 2>&1 || rc=$? ;;
  flat) nodes_run env ZINF_COMM_RANKS_PER_NODE=1 "$zinf" launch --hostfile "$hostfile" -- \
          "$zinf" train --config "$cfg" "${args[@]}" --log "$log" > "$dir/$1.out" 2>&1 || rc=$? ;;
  one) nodes_in 0 "$zinf" launch -n 4 -- "$zinf" train --config "$cfg" "${args[@]}" \
         --log "$log" > "$dir/$1.out" 2>&1 || rc=$? ;;
  esac
  if [ "$rc" != 0 ]; then
    echo "multinode.sh: $1 failed ($rc):" >&2
    tail -n 20 "$dir/$1.out" >&2
    exit 1
  fi
  rm -rf "$dir/nodes/node0/$1" "$dir/nodes/node1/$1"
  echo "$(($(date +%s) - t0))" > "$dir/$1.wall"
}

# stats NAME -> "bytes/step ops/step ms min-max nodes sent=received params": the four ranks'
# logs; ms is rank 0's median step after the first, min-max those steps' spread.
stats() {
  python3 - "$dir/$1.jsonl" <<'PY'
import json, statistics, sys
base = sys.argv[1]
def rows(path):
    return [json.loads(l) for l in open(path)]
r0 = rows(base)
s0 = [x["summary"] for x in r0 if "summary" in x][0]
world, steps = s0["world"], s0["steps_run"]
out = inn = ops = 0
for r in range(world):
    s = [x["summary"] for x in rows(base if r == 0 else "%s.rank-%d" % (base, r)) if "summary" in x][0]
    out += s["net_bytes_out"]; inn += s["net_bytes_in"]; ops += s["net_ops"]
ms = [x["ms"] for x in r0 if "step" in x]
print("%d %.1f %.0f %.0f-%.0f %d %s %d" % (out // steps, ops / steps, statistics.median(ms[1:]),
      min(ms[1:]), max(ms[1:]), s0["nodes"],
      "yes" if out == inn else "NO", s0["params"]))
PY
}

echo "# zinf train across nodes: 2 nodes x 2 ranks (hierarchical, and flat:"
echo "#   ZINF_COMM_RANKS_PER_NODE=1) against 1 node x 4 ranks; same model, data, global batch"
echo "# $(getconf _NPROCESSORS_ONLN) cpus: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), $(free -g | awk '/Mem:/ {print $2}') GiB;" \
  "the 2 \"nodes\" are namespaces of this machine sharing its CPUs and memory, MPI between them over loopback TCP"
echo "# model: --layers $L --dim $C --heads $H --seq $T --batch $B (x 4 ranks), $S steps," \
  "OMP_NUM_THREADS=1 per rank; budgets per rank: device $dev, host $host;" \
  "$([ "$offload" = nvme ] && echo "parameters and optimizer states on NVMe in each node's own swap folder" ||
     echo "parameters and optimizer states in each rank's host tier")"
printf "# %5s %-22s %16s %10s %9s %13s %7s %6s  %s\n" stage run "net bytes/step" "net ops" "step ms" "(min-max)" \
  "wall s" nodes losses
for stage in $stages; do
  run "s$stage-one" "$stage" one
  run "s$stage-hier" "$stage" hier
  run "s$stage-flat" "$stage" flat
  declare -A b o m x w n ok
  for lay in hier flat one; do
    read -r b[$lay] o[$lay] m[$lay] x[$lay] n[$lay] ok[$lay] params < <(stats "s$stage-$lay")
    w[$lay]=$(cat "$dir/s$stage-$lay.wall")
    [ "${ok[$lay]}" = yes ] || echo "# warning: s$stage-$lay: the bytes the ranks sent and received across nodes differ" >&2
  done
  same=yes
  for lay in hier flat; do
    "$zinf" compare "$dir/s$stage-one.jsonl" "$dir/s$stage-$lay.jsonl" > "$dir/cmp" 2>&1 || same=no
  done
  if [ "$same" = yes ]; then
    [ "${b[hier]}" -gt 0 ] && [ "${b[one]}" = 0 ] || same="no (bytes)"
  fi
  for lay in hier flat one; do
    case $lay in
    hier) label="2 nodes x 2, hier" ;;
    flat) label="2 nodes x 2, flat" ;;
    one) label="1 node x 4" ;;
    esac
    printf "  %5s %-22s %16s %10s %9s %13s %7s %6s  %s\n" "$stage" "$label" "${b[$lay]}" "${o[$lay]}" \
      "${m[$lay]}" "(${x[$lay]})" "${w[$lay]}" "${n[$lay]}" "$([ "$lay" = one ] && echo reference || echo "$same")"
  done
  python3 - "${b[flat]}" "${b[hier]}" "${m[hier]}" "${m[one]}" "$stage" "$params" <<'PY'
import sys
flat, hier, t2, t1, stage, params = (float(x) for x in sys.argv[1:])
print("# stage %d (%d parameters): bytes between nodes per step flat/hier %.3f (%.1f MiB against %.1f MiB);"
      " step time 2 nodes x 2 / 1 node x 4 %.3f (%.0f ms against %.0f ms)"
      % (stage, params, flat / hier, flat / 2**20, hier / 2**20, t2 / t1, t2, t1))
PY
  echo "# stage $stage bitwise: $same (the losses and parameter digests of every step, all three runs)"
  [ "$same" = yes ] || { cat "$dir/cmp" >&2; }
  unset b o m x w n ok
done
