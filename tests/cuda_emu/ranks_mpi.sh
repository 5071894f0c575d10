#!/usr/bin/env bash
# ranks_mpi.sh - GPU ranks across nodes without a GPU: `mpirun -np N zinf train` on the
# emulated CUDA device tier, ZINF_COMM_RANKS_PER_NODE=L making logical nodes of L
# consecutive ranks on this machine. Each rank's NCCL communicator spans the world, its
# unique id made by world rank 0 and broadcast over MPI (the emulated NCCL of emu_nccl.cpp
# meets in a shared-memory segment that id names, so every rank must run on this machine);
# its barriers and the host communicator go through each node's segment and the leaders'
# MPI exchange. run.sh calls it with the zinf and comm_nccl_mpi_rank it built
# (`tests/cuda_emu/run.sh ranks-mpi`):
#
#   tests/cuda_emu/ranks_mpi.sh ZINF COMM_NCCL_MPI_RANK WORKDIR [comm]
#
# (comm: the communicator's part alone, `run.sh comm-mpi`.)
# Checks:
#   - comm_nccl_mpi_rank (the nccl backend with comm_opts.mpi alone, every collective on
#     device buffers, exact sums) passes on 4 ranks as 2 nodes of 2, 2 as 2 nodes of 1 and 3
#     as 2 + 1; a rank of it killed inside NCCL collectives fails the job within seconds;
#   - for each of those layouts, at ZeRO stages 1, 2 and 3 in fp32 (and bf16 at stage 3 on
#     4 ranks), the N ranks log bitwise the losses and parameter digests of one emulated GPU
#     rank that accumulates N micro-batches (--accumulate N), as ranks.sh checks for
#     `zinf launch`, and each rank's summary says its node of the layout;
#   - a rank of node 1 (4 ranks as 2 nodes of 2, stage 3, bf16, swapping to NVMe) killed at
#     its step-2 checkpoint fails the job within 20 s, leaves no rank running, and --resume
#     under mpirun goes on bitwise as one rank of --accumulate 4 that was never killed.
# Prints one line per run; exits non-zero if any check fails.
set -uo pipefail
zinf=$1
rankprog=$2
work=$3
only=${4:-}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
mkdir -p "$work"
work=$(cd "$work" && pwd)
rm -rf "$work"/mpi-*
cat "$root"/README.md "$root"/src/*/*.c > "$work/data.txt"
model="--layers 2 --dim 64 --heads 4 --seq 32 --batch 2 --steps 3 --lr 3e-3 --seed 7"
fails=0
if ! command -v mpirun > /dev/null; then
  echo "cuda_emu ranks-mpi: skipped: mpirun is not on PATH (install openmpi-bin)"
  exit 77
fi
# Each rank takes the GPU of its local rank on this machine: the emulation shows four. One
# thread a rank: four ranks share two cores.
export EMU_DEVICES=4 OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Under ASan, the leak check leaves out Open MPI's own allocations, as test_comm_mpi's does.
export LSAN_OPTIONS=${LSAN_OPTIONS:-fast_unwind_on_malloc=0:suppressions=$root/tests/lsan-mpi.supp}
unset WORLD_SIZE RANK LOCAL_RANK ZINF_COMM_NAME ZINF_COMM_SECRET ZINF_TEST_KILL_AT

mpi() { # ranks ranks-per-node command...
  local n=$1 per=$2
  shift 2
  mpirun -np "$n" --oversubscribe --bind-to none --mca btl_vader_single_copy_mechanism none \
    -x ZINF_COMM_RANKS_PER_NODE="$per" "$@"
}

config() { # file stage [nvme-folder: the parameters swap there, the optimizer on the host]
  local off='"offload_param": {"device": "none"}, "offload_optimizer": {"device": "none"}'
  [ -z "${3:-}" ] ||
    off="\"offload_param\": {\"device\": \"nvme\", \"nvme_path\": \"$3\"}, \"offload_optimizer\": {\"device\": \"cpu\"}"
  cat > "$1" <<JSON
{"zero_optimization": {"stage": $2, $off},
 "zinf": {"device": "cuda", "device_bytes": "512M", "host_bytes": "256M"}}
JSON
}

fail() {
  echo "   FAIL $*"
  fails=$((fails + 1))
}

# The communicator alone.
layouts="4:2 2:1 3:2"
for lay in $layouts; do
  n=${lay%:*} per=${lay#*:}
  out=$work/mpi-comm-$n-$per.out
  t0=$SECONDS
  mpi "$n" "$per" "$rankprog" check > "$out" 2>&1
  rc=$?
  oks=$(grep -c '^rank [0-9]* ok' "$out")
  echo "   comm, $n ranks in nodes of $per: rc=$rc, $oks of $n ranks ok ($((SECONDS - t0)) s)"
  if [ $rc != 0 ] || [ "$oks" != "$n" ]; then
    tail -15 "$out" | sed 's/^/   | /'
    fail "comm, $n ranks in nodes of $per"
  fi
done
out=$work/mpi-comm-die.out
t0=$SECONDS
mpi 4 2 "$rankprog" die 2 > "$out" 2>&1
rc=$?
took=$((SECONDS - t0))
echo "   comm, 4 ranks in nodes of 2, rank 2 killed in NCCL collectives: rc=$rc ($took s)"
if [ $rc = 0 ] || ! grep -q 'rank 2: killing itself' "$out" || ! grep -qi 'signal 9' "$out" ||
  [ $took -gt 30 ]; then
  tail -15 "$out" | sed 's/^/   | /'
  fail "comm: the job with rank 2 killed did not fail within 30 s naming the signal"
fi

if [ "$only" = comm ]; then
  echo "cuda_emu comm-mpi: $fails failure(s)"
  [ $fails = 0 ]
  exit
fi

run() { # name ranks per-node stage precision extra... (ranks 1: one rank, no mpirun)
  local name=$1 n=$2 per=$3 stage=$4 prec=$5
  shift 5
  local d=$work/mpi-$name
  mkdir -p "$d"
  config "$d/cfg.json" "$stage"
  local t0=$SECONDS rc
  if [ "$n" = 1 ]; then
    "$zinf" train --config "$d/cfg.json" --data "$work/data.txt" $model --precision "$prec" \
      --log "$d/log.jsonl" "$@" > "$d/out.txt" 2>&1
  else
    mpi "$n" "$per" "$zinf" train --config "$d/cfg.json" --data "$work/data.txt" $model \
      --precision "$prec" --log "$d/log.jsonl" "$@" > "$d/out.txt" 2>&1
  fi
  rc=$?
  echo "   $name: rc=$rc ($((SECONDS - t0)) s)"
  if [ $rc != 0 ]; then
    tail -15 "$d/out.txt" | sed 's/^/   | /'
    fails=$((fails + 1))
  fi
}

for lay in $layouts; do
  n=${lay%:*} per=${lay#*:}
  run "gpu1-fp32-acc$n" 1 1 3 fp32 --accumulate "$n"
  for stage in 1 2 3; do
    run "gpu$n-$per-fp32-s$stage" "$n" "$per" "$stage" fp32
  done
done
run gpu1-bf16-acc4 1 1 3 bf16 --accumulate 4
run gpu4-2-bf16-s3 4 2 3 bf16

# A rank of node 1 killed at the start of its step-2 checkpoint, then --resume.
d=$work/mpi-kill
mkdir -p "$d"
config "$d/cfg.json" 3 "$d/swap"
config "$d/one.json" 3 "$d/one-swap"
args=(--data "$work/data.txt" $model --steps 4 --checkpoint-every 2 --precision bf16)
"$zinf" train --config "$d/one.json" "${args[@]}" --accumulate 4 --log "$d/ref.jsonl" \
  > "$d/ref.out" 2>&1 || fail "kill: one rank of --accumulate 4 failed"
t0=$SECONDS
ZINF_TEST_KILL_AT=before-barrier:2:2 mpi 4 2 -x ZINF_TEST_KILL_AT "$zinf" train \
  --config "$d/cfg.json" "${args[@]}" --log "$d/a.jsonl" > "$d/a.out" 2>&1
rc=$?
end=$(date +%s)
last=$(stat -c %Y "$d/a.jsonl.rank-2" 2> /dev/null || echo 0)
echo "   kill: rank 2 (node 1's leader) killed at its step-2 checkpoint: rc=$rc, the job ended" \
  "$((end - last)) s after its last log line ($((SECONDS - t0)) s in all)"
if [ $rc = 0 ] || ! grep -q 'rank 2' "$d/a.out"; then
  tail -15 "$d/a.out" | sed 's/^/   | /'
  fail "kill: the job did not fail naming rank 2"
fi
[ $((end - last)) -le 20 ] || fail "kill: the job took $((end - last)) s to end after the kill"
if pgrep -f "train --config $d/cfg.json" > /dev/null; then
  fail "kill: ranks left running: $(pgrep -a -f "train --config $d/cfg.json")"
fi
t0=$SECONDS
mpi 4 2 "$zinf" train --config "$d/cfg.json" "${args[@]}" --resume --log "$d/b.jsonl" \
  > "$d/b.out" 2>&1
rc=$?
echo "   kill: resumed: rc=$rc ($((SECONDS - t0)) s)"
[ $rc = 0 ] || { tail -15 "$d/b.out" | sed 's/^/   | /'; fail "kill: --resume failed"; }

python3 - "$work" "$layouts" <<'PY' || fails=$((fails + 1))
import json, os, sys
work, layouts = sys.argv[1], sys.argv[2].split()

def log(path):
    steps, summ = [], None
    if os.path.exists(path):
        for l in open(path):
            r = json.loads(l)
            if 'step' in r:
                steps.append(r)
            elif 'summary' in r:
                summ = r['summary']
    return steps, summ

def run(name, rank=0):
    return log(os.path.join(work, 'mpi-' + name, 'log.jsonl' + ('.rank-%d' % rank if rank else '')))

bad = 0
def check(ok, what):
    global bad
    print('   %s %s' % ('ok  ' if ok else 'FAIL', what))
    bad += not ok

def same(a, b):
    return len(a) == len(b) and len(a) > 0 and all(
        x['loss'] == y['loss'] and x.get('digest') == y.get('digest') for x, y in zip(a, b))

cases = [(int(l.split(':')[0]), int(l.split(':')[1]), 'fp32', s) for l in layouts
         for s in (1, 2, 3)] + [(4, 2, 'bf16', 3)]
for n, per, prec, stage in cases:
    ref, _ = run('gpu1-%s-acc%d' % (prec, n))
    name = 'gpu%d-%d-%s-s%d' % (n, per, prec, stage)
    g, _ = run(name)
    what = '%s, %d GPU ranks under mpirun in nodes of %d, stage %d' % (prec, n, per, stage)
    check(len(g) == 3 and same(g, ref),
          what + ': bitwise the one GPU rank of --accumulate %d (loss and digest)' % n)
    nodes = [(run(name, r)[1] or {}).get('node') for r in range(n)]
    want = [r // per for r in range(n)]
    counts = {(run(name, r)[1] or {}).get('nodes') for r in range(n)}
    check(nodes == want and counts == {(n + per - 1) // per},
          what + ': the ranks\' nodes %s of %s, the layout\'s %s of %d'
          % (nodes, sorted(counts, key=str), want, (n + per - 1) // per))

def steps_of(path):
    return {r['step']: r for r in (json.loads(l) for l in open(path)) if 'step' in r} \
        if os.path.exists(path) else {}
d = os.path.join(work, 'mpi-kill')
ref = steps_of(os.path.join(d, 'ref.jsonl'))
before, after = steps_of(os.path.join(d, 'a.jsonl')), steps_of(os.path.join(d, 'b.jsonl'))
ok = len(ref) == 4 and set(before) >= {1, 2} and max(after, default=0) == 4 and all(
    ref[k]['loss'] == r['loss'] and ref[k]['digest'] == r['digest']
    for k, r in list(before.items()) + list(after.items()))
check(ok, 'kill: steps %s before and %s after the resume are bitwise one rank\'s of '
      '--accumulate 4' % (sorted(before), sorted(after)))
sys.exit(1 if bad else 0)
PY
echo "cuda_emu ranks-mpi: $fails failure(s)"
[ $fails = 0 ]
