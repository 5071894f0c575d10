#!/usr/bin/env bash
# ranks.sh - GPU ranks without a GPU: `zinf launch -n N -- zinf train` on the emulated CUDA
# device tier, the ranks' collectives over the emulated NCCL (emu_nccl.cpp), at ZeRO stages
# 1, 2 and 3, in fp32, bf16 and fp16, on 2 and 4 ranks. run.sh calls it with the zinf it
# built (`tests/cuda_emu/run.sh ranks`):
#
#   tests/cuda_emu/ranks.sh ZINF WORKDIR
#
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
# Prints one line per run and a table of the figures; exits non-zero if any check fails.
set -uo pipefail
zinf=$1
work=$2
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

config() { # file device stage
  cat > "$1" <<JSON
{"zero_optimization": {"stage": $3,
  "offload_param": {"device": "none"}, "offload_optimizer": {"device": "none"}},
 "zinf": {"device": "$2", "device_bytes": "512M", "host_bytes": "256M"}}
JSON
}

run() { # name ranks device stage precision extra...
  local name=$1 n=$2 dev=$3 stage=$4 prec=$5
  shift 5
  local d=$work/run-$name
  mkdir -p "$d"
  config "$d/cfg.json" "$dev" "$stage"
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
for prec in fp32 bf16; do
  run "peak1-$prec" 1 cuda 3 "$prec" $big
  for n in 2 4; do
    run "peak$n-$prec" "$n" cuda 3 "$prec" $big
  done
done

python3 - "$work" <<'PY' || fails=$((fails + 1))
import json, os, sys
work = sys.argv[1]

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

tol = {'fp32': 1e-3, 'bf16': 3e-2, 'fp16': 3e-2}
rows = []
for prec in ('fp32', 'bf16', 'fp16'):
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
for prec in ('fp32', 'bf16'):
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
print('   figures (precision, ranks, stage, GPU ranks\' last loss, CPU ranks\' last loss; and '
      'at stage 3 the device peaks beyond fixed buffers of one rank and of the largest rank):')
for r in rows:
    print('    ', r)
sys.exit(1 if bad else 0)
PY
echo "cuda_emu ranks: $fails failure(s)"
[ $fails = 0 ]
