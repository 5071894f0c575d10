#!/usr/bin/env bash
# ranks.sh - GPU ranks without a GPU: `zinf launch -n N -- zinf train` on the emulated CUDA
# device tier, the ranks' collectives over the emulated NCCL (emu_nccl.cpp), at ZeRO stages
# 1, 2 and 3, in fp32, bf16 and fp16, on 2 and 4 ranks, pipeline stages on GPU ranks, and
# mixture-of-experts blocks on GPU ranks.
# run.sh calls it with the zinf it built (`tests/cuda_emu/run.sh ranks`):
#
#   tests/cuda_emu/ranks.sh ZINF WORKDIR [zero|pipeline|faults|moe]
#
# (zero, pipeline, faults, moe: those runs alone; EMU_RANKS=PART gives the same through
# run.sh.)
# Checks, for every precision, stage and number of ranks N:
#   - N emulated GPU ranks log bitwise the losses and parameter digests of one emulated GPU
#     rank that accumulates N micro-batches (--accumulate N): the emulated NCCL sums in rank
#     order, and the one rank folds its micro-batches' gradients in the same order;
#   - their losses are within the CPU-against-GPU tolerance (fp32 1e-3, bf16 and fp16 3e-2,
#     relative) of N CPU ranks' (zinf.device "emulated": the shm backend and the CPU math);
#   - at stage 3 (on a wider model, fp32 and bf16), what a rank keeps on the device beyond
#     its fixed buffers (the gather and local-gradient buffers, which hold whole tensors:
#     the summary's device_scratch_bytes) is at most 1/N of what one rank keeps there, plus
#     10% for the shards' rounding and 512 KiB of transients.
#   - pipeline: 2 and 3 GPU stages of --accumulate 4 micro-batches (fp32, bf16, fp16; 3 blocks)
#     log bitwise the losses and digests of one GPU rank of --accumulate 4; 2 copies x 2
#     stages on 4 GPU ranks, one micro-batch each, bitwise one GPU rank of --accumulate 2, and
#     with 4 micro-batches each, bitwise 2 GPU ZeRO-1 ranks of --accumulate 4 (NCCL sums each
#     round, as without stages); tensor-parallel ranks on GPUs are refused, naming the key.
#   - moe: MoE blocks (4 experts, top-2) on one GPU rank within the CPU-against-GPU
#     tolerance of the CPU backend's run, and (fp32) bitwise the same run again; 2
#     expert-parallel GPU ranks (moe.ep_size 2) bitwise one GPU rank of --accumulate 2; in
#     fp32, bf16 and fp16; MoE blocks in pipeline stages on GPUs refused, naming the key.
#   - faults: a GPU rank killed at the start of a checkpoint, or after its rename, fails the
#     job, and --resume goes on bitwise as a run that was never killed; a LOCAL_RANK past
#     the GPUs is refused.
# Prints one line per run and a table of the figures; exits non-zero if any check fails.
set -uo pipefail
zinf=$1
work=$2
only=${3:-${EMU_RANKS:-}}
case $only in
  "" | zero | pipeline | faults | moe) ;;
  *) echo "ranks.sh: unknown part '$only' (zero, pipeline, faults or moe)" >&2; exit 2 ;;
esac
want() { [ -z "$only" ] || [ "$only" = "$1" ]; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
mkdir -p "$work"
work=$(cd "$work" && pwd)
rm -rf "$work"/run-*
cat "$root"/README.md "$root"/src/*/*.c > "$work/data.txt"
model="--layers 2 --dim 64 --heads 4 --seq 32 --batch 2 --steps 3 --lr 3e-3 --seed 7"
fails=0
# Each rank takes the GPU of its LOCAL_RANK: the emulation shows four.
export EMU_DEVICES=4

config() { # file device stage [extra: more of the top object, with its trailing comma]
  cat > "$1" <<JSON
{${4:-}"zero_optimization": {"stage": $3,
  "offload_param": {"device": "none"}, "offload_optimizer": {"device": "none"}},
 "zinf": {"device": "$2", "device_bytes": "512M", "host_bytes": "256M"}}
JSON
}

run() { # name ranks device stage precision extra... (cfg_extra: config's 4th argument)
  local name=$1 n=$2 dev=$3 stage=$4 prec=$5
  shift 5
  local d=$work/run-$name
  mkdir -p "$d"
  config "$d/cfg.json" "$dev" "$stage" "${cfg_extra:-}"
  local t0=$SECONDS rc
  if [ "$n" = 1 ]; then
    "$zinf" train --config "$d/cfg.json" --data "$work/data.txt" $model --precision "$prec" \
      --log "$d/log.jsonl" "$@" > "$d/out.txt" 2>&1
  else
    "$zinf" launch -n "$n" --no-bind --name "emu-$name-$$" -- "$zinf" train --config "$d/cfg.json" \
      --data "$work/data.txt" $model --precision "$prec" --log "$d/log.jsonl" "$@" \
      > "$d/out.txt" 2>&1
  fi
  rc=$?
  echo "   $name: rc=$rc ($((SECONDS - t0)) s)"
  if [ $rc != 0 ]; then
    tail -15 "$d/out.txt" | sed 's/^/   | /'
    fails=$((fails + 1))
  fi
}

want zero &&
for prec in fp32 bf16 fp16; do
  for n in 2 4; do
    run "gpu1-$prec-acc$n" 1 cuda 3 "$prec" --accumulate "$n"
    for stage in 1 2 3; do
      run "gpu$n-$prec-s$stage" "$n" cuda "$stage" "$prec"
      run "cpu$n-$prec-s$stage" "$n" emulated "$stage" "$prec"
    done
  done
done
# The device's peaks, on a model whose tensors are large next to a shard's rounding.
big="--dim 256 --heads 4 --steps 1"
want zero &&
for prec in fp32 bf16; do
  run "peak1-$prec" 1 cuda 3 "$prec" $big
  for n in 2 4; do
    run "peak$n-$prec" "$n" cuda 3 "$prec" $big
  done
done

# Pipeline stages on GPU ranks: 3 blocks, so that 3 stages have one each. The references are
# GPU ranks without stages of the same micro-batches.
pipe=(--layers 3)
if want pipeline; then
  for prec in fp32 bf16 fp16; do
    run "pipe-ref-$prec-acc4" 1 cuda 1 "$prec" "${pipe[@]}" --accumulate 4
    run "pipe-ref-$prec-acc2" 1 cuda 1 "$prec" "${pipe[@]}" --accumulate 2
    run "pipe-dp2-$prec-acc4" 2 cuda 1 "$prec" "${pipe[@]}" --accumulate 4
    cfg_extra='"pipeline": {"stages": 2}, ' run "pipe-p2-$prec" 2 cuda 1 "$prec" "${pipe[@]}" \
      --accumulate 4
    cfg_extra='"pipeline": {"stages": 3}, ' run "pipe-p3-$prec" 3 cuda 1 "$prec" "${pipe[@]}" \
      --accumulate 4
    cfg_extra='"pipeline": {"stages": 2}, ' run "pipe-2x2-$prec-acc1" 4 cuda 1 "$prec" \
      "${pipe[@]}" --accumulate 1
    cfg_extra='"pipeline": {"stages": 2}, ' run "pipe-2x2-$prec-acc4" 4 cuda 1 "$prec" \
      "${pipe[@]}" --accumulate 4
  done
  # Tensor-parallel ranks compute on the CPU only: on GPUs they are refused, naming the key.
  d=$work/run-pipe-tp-refused
  mkdir -p "$d"
  config "$d/cfg.json" cuda 1 '"tensor_parallel": {"autotp_size": 2}, '
  "$zinf" launch -n 2 --no-bind --name "emu-tp-$$" -- "$zinf" train --config "$d/cfg.json" \
    --data "$work/data.txt" $model > "$d/out.txt" 2>&1
  rc=$?
  if [ $rc != 0 ] && grep -q "tensor_parallel.autotp_size 2 on GPUs" "$d/out.txt"; then
    echo "   ok   tensor-parallel ranks on GPUs are refused (rc=$rc)"
  else
    echo "   FAIL tensor-parallel ranks on GPUs: rc=$rc"
    tail -5 "$d/out.txt" | sed 's/^/   | /'
    fails=$((fails + 1))
  fi
fi

# MoE blocks on GPU ranks: 4 experts, top-2, every block, fp32. The CPU backend's run is the
# reference within tolerance; expert-parallel GPU ranks are held bitwise to one GPU rank.
moe=(--experts 4 --top-k 2)
if want moe; then
  run moe-gpu1-again 1 cuda 1 fp32 "${moe[@]}"
  for prec in fp32 bf16 fp16; do
    run "moe-gpu1-$prec" 1 cuda 1 "$prec" "${moe[@]}"
    run "moe-cpu1-$prec" 1 emulated 1 "$prec" "${moe[@]}"
    run "moe-gpu1-$prec-acc2" 1 cuda 1 "$prec" "${moe[@]}" --accumulate 2
    cfg_extra='"moe": {"ep_size": 2}, ' run "moe-gpu2-$prec-ep2" 2 cuda 1 "$prec" "${moe[@]}"
  done
  d=$work/run-moe-pipe-refused
  mkdir -p "$d"
  config "$d/cfg.json" cuda 1 '"pipeline": {"stages": 2}, '
  "$zinf" launch -n 2 --no-bind --name "emu-moepp-$$" -- "$zinf" train --config "$d/cfg.json" \
    --data "$work/data.txt" $model "${moe[@]}" > "$d/out.txt" 2>&1
  rc=$?
  if [ $rc != 0 ] && grep -q "pipeline stages on the CUDA backend" "$d/out.txt"; then
    echo "   ok   MoE blocks in pipeline stages on GPUs are refused (rc=$rc)"
  else
    echo "   FAIL MoE blocks in pipeline stages on GPUs: rc=$rc"
    tail -5 "$d/out.txt" | sed 's/^/   | /'
    fails=$((fails + 1))
  fi
fi

# Faults: 2 bf16 GPU ranks at stage 3 with checkpoints every 2 steps, rank 1 killed at the
# start of the step-2 checkpoint (a dead rank fails the job) and after its rename (the
# checkpoint commits as one); each job fails, and --resume on 2 ranks goes on from the
# newest step both hold, bitwise as a run that was never killed.
fault_cfg() { # dir
  cat > "$1/cfg.json" <<JSON
{"zero_optimization": {"stage": 3,
  "offload_param": {"device": "nvme", "nvme_path": "$1/swap"}, "offload_optimizer": {"device": "cpu"}},
 "zinf": {"device": "cuda", "device_bytes": "512M", "host_bytes": "256M"}}
JSON
}
fault() { # name kill-point (empty: the run that is never killed)
  local d=$work/run-fault-$1 rc
  mkdir -p "$d"
  fault_cfg "$d"
  local args=(--config "$d/cfg.json" --data "$work/data.txt" $model --steps 4 --checkpoint-every 2
              --precision bf16)
  ZINF_TEST_KILL_AT=${2:+$2:1:2} "$zinf" launch -n 2 --no-bind --name "emu-f$1-$$" -- "$zinf" train \
    "${args[@]}" --log "$d/a.jsonl" > "$d/a.out" 2>&1
  rc=$?
  if [ -z "$2" ]; then
    echo "   fault-$1 (never killed): rc=$rc"
    [ $rc = 0 ] || { tail -15 "$d/a.out" | sed 's/^/   | /'; fails=$((fails + 1)); }
    return
  fi
  echo "   fault-$1 (rank 1 killed at $2 of the step-2 checkpoint): rc=$rc"
  if [ $rc = 0 ] || ! grep -q "rank 1" "$d/a.out"; then
    echo "   FAIL the job did not fail naming rank 1"
    tail -15 "$d/a.out" | sed 's/^/   | /'
    fails=$((fails + 1))
  fi
  "$zinf" launch -n 2 --no-bind --name "emu-r$1-$$" -- "$zinf" train "${args[@]}" --resume \
    --log "$d/b.jsonl" > "$d/b.out" 2>&1
  rc=$?
  echo "   fault-$1 resumed: rc=$rc"
  [ $rc = 0 ] || { tail -15 "$d/b.out" | sed 's/^/   | /'; fails=$((fails + 1)); }
}
if want faults; then
fault ref ""
fault barrier before-barrier
fault rename after-rename
# A LOCAL_RANK past the GPUs there are (four here) is refused before anything is made
# (exit 2, as bad usage).
d=$work/run-local-rank
mkdir -p "$d"
config "$d/cfg.json" cuda 1
WORLD_SIZE=2 RANK=0 LOCAL_RANK=5 ZINF_COMM_NAME=emu-lr-$$ "$zinf" train --config "$d/cfg.json" \
  --data "$work/data.txt" $model > "$d/out.txt" 2>&1
rc=$?
if [ $rc = 2 ] && grep -q "LOCAL_RANK 5: this node has 4 usable GPUs" "$d/out.txt"; then
  echo "   ok   LOCAL_RANK 5 of 4 GPUs is refused"
else
  echo "   FAIL LOCAL_RANK 5 of 4 GPUs: rc=$rc"
  tail -5 "$d/out.txt" | sed 's/^/   | /'
  fails=$((fails + 1))
fi
fi

python3 - "$work" "$only" <<'PY' || fails=$((fails + 1))
import json, os, sys
work, only = sys.argv[1], sys.argv[2]

def log(name, rank=0):
    p = os.path.join(work, 'run-' + name, 'log.jsonl' + ('.rank-%d' % rank if rank else ''))
    steps, summ = [], None
    if not os.path.exists(p):
        return steps, summ
    for l in open(p):
        r = json.loads(l)
        if 'step' in r:
            steps.append(r)
        elif 'summary' in r:
            summ = r['summary']
    return steps, summ

bad = 0
def check(ok, what):
    global bad
    print('   %s %s' % ('ok  ' if ok else 'FAIL', what))
    bad += not ok

def want(part):
    return only in ('', part)

tol = {'fp32': 1e-3, 'bf16': 3e-2, 'fp16': 3e-2}
rows = []
for prec in ('fp32', 'bf16', 'fp16') if want('zero') else ():
    for n in (2, 4):
        ref, rsum = log('gpu1-%s-acc%d' % (prec, n))
        for stage in (1, 2, 3):
            g, gsum = log('gpu%d-%s-s%d' % (n, prec, stage))
            c, _ = log('cpu%d-%s-s%d' % (n, prec, stage))
            what = '%s, %d GPU ranks, stage %d' % (prec, n, stage)
            same = len(g) == 3 and len(ref) == 3 and all(
                a['loss'] == b['loss'] and a.get('digest') == b.get('digest') for a, b in zip(g, ref))
            check(same, what + ': bitwise the one GPU rank of --accumulate %d (loss and digest)' % n)
            worst = max((abs(a['loss'] - b['loss']) / abs(b['loss']) for a, b in zip(g, c)
                         if a['loss'] is not None and b['loss'] is not None), default=None)
            check(worst is not None and len(c) == 3 and worst <= tol[prec],
                  what + ': within %g of %d CPU ranks (largest %s)' % (tol[prec], n, worst))
            rows.append((prec, n, stage, g[-1]['loss'] if g else None,
                         c[-1]['loss'] if c else None))
for prec in ('fp32', 'bf16') if want('zero') else ():
    _, one = log('peak1-' + prec)
    for n in (2, 4):
        peaks = []
        for r in range(n):
            _, s = log('peak%d-%s' % (n, prec), r)
            if s:
                peaks.append(s['device']['peak_bytes'] - s['device_scratch_bytes'])
        base = one['device']['peak_bytes'] - one['device_scratch_bytes'] if one else 0
        # 10% for the shards' rounding to whole 4 KiB, and 512 KiB of transients.
        ok = one is not None and len(peaks) == n and max(peaks) <= 1.1 * base / n + (512 << 10)
        check(ok, '%s, %d GPU ranks at stage 3: device peak beyond the fixed buffers %s per rank; '
              'one rank %d, 1/%d of it %d' % (prec, n, peaks, base, n, base // n))
        rows.append((prec, n, 'peak beyond fixed buffers', base, max(peaks) if peaks else None))
def bitwise(a, b, n):
    """Runs a and b logged the same n steps, each with a digest, bitwise."""
    return len(a) == n and len(b) == n and all(
        x['loss'] == y['loss'] and x.get('digest') is not None and x.get('digest') == y.get('digest')
        for x, y in zip(a, b))

for prec in ('fp32', 'bf16', 'fp16') if want('pipeline') else ():
    pipes = (('p2-' + prec, 2, 2, 'ref-%s-acc4', 'one GPU rank of --accumulate 4'),
             ('p3-' + prec, 3, 3, 'ref-%s-acc4', 'one GPU rank of --accumulate 4'),
             ('2x2-%s-acc1' % prec, 4, 2, 'ref-%s-acc2', 'one GPU rank of --accumulate 2'),
             ('2x2-%s-acc4' % prec, 4, 2, 'dp2-%s-acc4', '2 GPU ZeRO-1 ranks of --accumulate 4'))
    for name, n, P, ref, what in pipes:
        g, _ = log('pipe-' + name)
        r, _ = log('pipe-' + ref % prec)
        check(bitwise(g, r, 3), '%s, %d GPU ranks, %d stages: bitwise %s (loss and digest)'
              % (prec, n, P, what))
        # Every rank ran its stage on its GPU, and the stages sent what crossed.
        ok = True
        for k in range(n):
            _, s = log('pipe-' + name, k)
            ok = ok and bool(s) and s.get('pp') == P and s.get('pp_stage') == k % P and \
                s.get('pipeline_bytes', 0) > 0 and s.get('backend') == 'cuda'
        check(ok, '%s, %d GPU ranks, %d stages: each rank\'s summary names its stage, the CUDA '
              'backend and bytes sent' % (prec, n, P))
        rows.append((prec, n, 'stages %d' % P, g[-1]['loss'] if g else None,
                     r[-1]['loss'] if r else None))
for prec in ('fp32', 'bf16', 'fp16') if want('moe') else ():
    g, gsum = log('moe-gpu1-' + prec)
    c, _ = log('moe-cpu1-' + prec)
    if prec == 'fp32':
        again, _ = log('moe-gpu1-again')
        check(bitwise(g, again, 3), 'MoE fp32, one GPU rank: the same run twice, bitwise')
    worst = max((abs(a['loss'] - b['loss']) / abs(b['loss']) for a, b in zip(g, c)
                 if a['loss'] is not None and b['loss'] is not None), default=None)
    check(worst is not None and len(g) == 3 and len(c) == 3 and worst <= tol[prec],
          'MoE %s, one GPU rank: within %g of the CPU backend (largest %s)'
          % (prec, tol[prec], worst))
    check(bool(gsum) and gsum.get('backend') == 'cuda' and gsum.get('experts', 0) > 0,
          'MoE %s, one GPU rank: the summary names the CUDA backend and its experts' % prec)
    e, _ = log('moe-gpu2-%s-ep2' % prec)
    r, _ = log('moe-gpu1-%s-acc2' % prec)
    check(bitwise(e, r, 3), 'MoE %s, 2 expert-parallel GPU ranks: bitwise one GPU rank of '
          '--accumulate 2 (loss and digest)' % prec)
    rows.append((prec + ' MoE', 1, '-', g[-1]['loss'] if g else None,
                 c[-1]['loss'] if c else None))
    rows.append((prec + ' MoE ep', 2, '-', e[-1]['loss'] if e else None,
                 r[-1]['loss'] if r else None))
def steps_of(path):
    return {r['step']: r for r in (json.loads(l) for l in open(path)) if 'step' in r} \
        if os.path.exists(path) else {}
ref = steps_of(os.path.join(work, 'run-fault-ref', 'a.jsonl'))
for name in ('barrier', 'rename') if want('faults') else ():
    d = os.path.join(work, 'run-fault-' + name)
    before, after = steps_of(os.path.join(d, 'a.jsonl')), steps_of(os.path.join(d, 'b.jsonl'))
    same = len(ref) == 4 and set(before) >= {1, 2} and max(after, default=0) == 4 and all(
        ref[k]['loss'] == r['loss'] and ref[k]['digest'] == r['digest']
        for k, r in list(before.items()) + list(after.items()))
    check(same, 'fault at %s: steps %s before and %s after the resume are bitwise the '
          'never-killed run\'s' % (name, sorted(before), sorted(after)))
print('   figures (precision, ranks, stage, GPU ranks\' last loss, CPU ranks\' last loss; '
      'at stage 3 the device peaks beyond fixed buffers of one rank and of the largest rank; '
      'for stages, their last loss and the reference\'s):')
for r in rows:
    print('    ', r)
sys.exit(1 if bad else 0)
PY
echo "cuda_emu ranks: $fails failure(s)"
[ $fails = 0 ]
