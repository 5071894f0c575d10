#!/usr/bin/env bash
# ranks.sh - GPU ranks without a GPU: `zinf launch -n N -- zinf train` on the emulated CUDA
# device tier, the ranks' collectives over the emulated NCCL (emu_nccl.cpp), at ZeRO stages
# 1, 2 and 3, in fp32, bf16 and fp16, on 2 and 4 ranks, pipeline stages, tensor-parallel and
# sequence-parallel ranks, and mixture-of-experts blocks, on GPU ranks. run.sh calls it with
# the zinf it built (`tests/cuda_emu/run.sh ranks`):
#
#   tests/cuda_emu/ranks.sh ZINF WORKDIR [zero|pipeline|tp|sp|moe|faults|wire]
#
# (zero, pipeline, tp, sp, moe, faults, wire: those runs alone; EMU_RANKS=PART gives the same
# through run.sh.)
# wire: 2 GPU ranks with communication_data_type fp16 and bf16 at stages 1 and 2 (fp32
# weights): the same bits run twice, the losses within the 16-bit rounding (3e-2) of the fp32
# reduction's, half its gradient bytes a step, and within 3e-2 of 2 CPU ranks' 16-bit runs.
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
#     round, as without stages).
#   - tp: 2 tensor-parallel GPU ranks (tensor_parallel.autotp_size 2; 4 heads, 2 each; the
#     vocabulary is bytes, V 256, which 2 divides) in fp32, bf16 and fp16: their losses within
#     a relative 1e-6 (fp32, as the CPU tp tests) or 1e-3 (bf16, fp16: the partial sums and
#     input gradients are rounded at other places) of one GPU rank's (the row-parallel sums
#     and the vocab-parallel softmax add in another order: not bitwise), the same bits (loss
#     and digest) when run again, and within the CPU-against-GPU tolerance of 2 CPU
#     tensor-parallel ranks (zinf.device "emulated"); 2 stages x tp 2 on 4 GPU ranks
#     (fp32, bf16; --accumulate 2) within the same tolerances of one GPU rank of --accumulate 2.
#   - sp: sequence-parallel (Ulysses) GPU ranks, sequence_parallel_size 2 (fp32, bf16, fp16)
#     and 4 (fp32, bf16; the model's 4 heads and 32 positions split 4 ways): their losses are
#     within SP_TOL (fp32 1e-5, 16-bit 1e-3, relative) of one GPU rank's (not bitwise: the
#     loss and the parameter gradients are summed over the ranks' positions, which
#     reassociates the sums, and in bf16 and fp16 a weight a rounding apart narrows to
#     another 16-bit value); a second run logs bitwise the same losses and digests (the
#     exchanges copy bits, the kernels and NCCL's sums are deterministic); 2 GPU ranks are
#     within the CPU-against-GPU tolerance of 2 CPU sequence-parallel ranks; 2 sequence-
#     parallel ranks x 2 pipeline stages on 4 GPU ranks (3 blocks, --accumulate 4, fp32 and
#     bf16) log bitwise the losses and digests of 2 sequence-parallel GPU ranks without
#     stages, and are within SP_TOL of one GPU rank; every rank's summary names the CUDA
#     backend and its sp.
#   - moe: MoE blocks (4 experts, top-2) on one GPU rank within the CPU-against-GPU
#     tolerance of the CPU backend's run, and (fp32) bitwise the same run again; 2
#     expert-parallel GPU ranks (moe.ep_size 2) bitwise one GPU rank of --accumulate 2; in
#     fp32, bf16 and fp16; MoE blocks in 2 GPU pipeline stages (3 blocks, every other one MoE:
#     one in each stage; --accumulate 4) bitwise one GPU rank of --accumulate 4, and 2 copies
#     x 2 stages on 4 GPU ranks (moe.ep_size 2: the experts split across the copies; one
#     micro-batch each) bitwise one GPU rank of --accumulate 2 (losses, digests, gradient
#     norms, balancing losses, experts used), in fp32, bf16 and fp16.
#   - faults: a GPU rank killed at the start of a checkpoint, or after its rename, fails the
#     job, and --resume goes on bitwise as a run that was never killed; a LOCAL_RANK past
#     the GPUs is refused.
# Prints one line per run and a table of the figures; exits non-zero if any check fails.
set -uo pipefail
zinf=$1
work=$2
only=${3:-${EMU_RANKS:-}}
case $only in
  "" | zero | pipeline | tp | sp | moe | faults | wire) ;;
  *) echo "ranks.sh: unknown part '$only' (zero, pipeline, tp, sp, moe, faults or wire)" >&2
     exit 2 ;;
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
fi

# Tensor-parallel GPU ranks against one GPU rank, themselves run again, and CPU tp ranks;
# 2 stages x tp 2 on 4 GPU ranks against one GPU rank of the same micro-batches.
tp2='"tensor_parallel": {"autotp_size": 2}, '
if want tp; then
  for prec in fp32 bf16 fp16; do
    run "tp-ref-$prec" 1 cuda 1 "$prec"
    cfg_extra=$tp2 run "tp-gpu2-$prec" 2 cuda 1 "$prec"
    cfg_extra=$tp2 run "tp-gpu2-$prec-again" 2 cuda 1 "$prec"
    cfg_extra=$tp2 run "tp-cpu2-$prec" 2 emulated 1 "$prec"
  done
  for prec in fp32 bf16; do
    run "tp-ref-$prec-acc2" 1 cuda 1 "$prec" --accumulate 2
    cfg_extra="$tp2"'"pipeline": {"stages": 2}, ' run "tp-p2x2-$prec" 4 cuda 1 "$prec" \
      --accumulate 2
  done
fi

# Sequence-parallel ranks on GPUs, against one GPU rank, themselves, CPU ranks, and with
# pipeline stages (3 blocks, as above).
SP2='"sequence_parallel_size": 2, '
SP4='"sequence_parallel_size": 4, '
if want sp; then
  for prec in fp32 bf16 fp16; do
    run "sp-ref-$prec" 1 cuda 1 "$prec"
    cfg_extra=$SP2 run "sp2-$prec" 2 cuda 1 "$prec"
    cfg_extra=$SP2 run "sp2-$prec-again" 2 cuda 1 "$prec"
    cfg_extra=$SP2 run "sp2-cpu-$prec" 2 emulated 1 "$prec"
    [ $prec = fp16 ] && continue
    cfg_extra=$SP4 run "sp4-$prec" 4 cuda 1 "$prec"
    cfg_extra=$SP4 run "sp4-$prec-again" 4 cuda 1 "$prec"
  done
  for prec in fp32 bf16; do
    run "sp-ref-$prec-acc4" 1 cuda 1 "$prec" "${pipe[@]}" --accumulate 4
    cfg_extra=$SP2 run "sp2-$prec-acc4" 2 cuda 1 "$prec" "${pipe[@]}" --accumulate 4
    cfg_extra="$SP2"'"pipeline": {"stages": 2}, ' run "sp2xp2-$prec" 4 cuda 1 "$prec" \
      "${pipe[@]}" --accumulate 4
  done
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
  # MoE blocks in pipeline stages on GPUs: 3 blocks, every other one MoE (blocks 0 and 2, one
  # in each stage), against one GPU rank of the same micro-batches; 2 copies x 2 stages with
  # the experts split across the copies, one micro-batch each, against one GPU rank of 2.
  every='"moe": {"moe_every": 2}, '
  for prec in fp32 bf16 fp16; do
    cfg_extra=$every run "moe-pipe-ref-$prec-acc4" 1 cuda 1 "$prec" "${pipe[@]}" "${moe[@]}" \
      --accumulate 4
    cfg_extra=$every run "moe-pipe-ref-$prec-acc2" 1 cuda 1 "$prec" "${pipe[@]}" "${moe[@]}" \
      --accumulate 2
    cfg_extra="$every"'"pipeline": {"stages": 2}, ' run "moe-pipe-p2-$prec" 2 cuda 1 "$prec" \
      "${pipe[@]}" "${moe[@]}" --accumulate 4
    cfg_extra='"moe": {"moe_every": 2, "ep_size": 2}, "pipeline": {"stages": 2}, ' \
      run "moe-pipe-2x2-$prec" 4 cuda 1 "$prec" "${pipe[@]}" "${moe[@]}" --accumulate 1
  done
fi

# 16-bit gradient reductions over the emulated NCCL (ncclFloat16, ncclBfloat16).
if want wire; then
  for stage in 1 2; do
    run "wire-f32-s$stage" 2 cuda "$stage" fp32
    for dt in fp16 bf16; do
      cfg_extra='"communication_data_type": "'$dt'", ' run "wire-$dt-s$stage" 2 cuda "$stage" fp32
      cfg_extra='"communication_data_type": "'$dt'", ' run "wire-$dt-s$stage-again" 2 cuda \
        "$stage" fp32
      cfg_extra='"communication_data_type": "'$dt'", ' run "wire-$dt-s$stage-cpu" 2 emulated \
        "$stage" fp32
    done
  done
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
# Tensor-parallel GPU ranks: not bitwise one rank (the sums run in another order), within a
# relative tp_tol of its losses; bitwise themselves run again.
tp_tol = {'fp32': 1e-6, 'bf16': 1e-3, 'fp16': 1e-3}
def rel(a, b):
    worst = max((abs(x['loss'] - y['loss']) / abs(y['loss']) for x, y in zip(a, b)
                 if x['loss'] is not None and y['loss'] is not None), default=None)
    return worst if len(a) == 3 and len(b) == 3 else None
def on_cuda(name, n):
    ok = True
    for k in range(n):
        _, s = log(name, k)
        ok = ok and bool(s) and s.get('backend') == 'cuda'
    return ok
for prec in ('fp32', 'bf16', 'fp16') if want('tp') else ():
    ref, _ = log('tp-ref-' + prec)
    g, _ = log('tp-gpu2-' + prec)
    again, _ = log('tp-gpu2-%s-again' % prec)
    c, _ = log('tp-cpu2-' + prec)
    w = rel(g, ref)
    check(w is not None and w <= tp_tol[prec],
          '%s, tp 2 on GPUs: within %g of one GPU rank (largest %s)' % (prec, tp_tol[prec], w))
    check(bitwise(g, again, 3), '%s, tp 2 on GPUs: bitwise the same run again (loss and digest)'
          % prec)
    w = rel(g, c)
    check(w is not None and w <= tol[prec],
          '%s, tp 2 on GPUs: within %g of tp 2 on CPU ranks (largest %s)' % (prec, tol[prec], w))
    check(on_cuda('tp-gpu2-' + prec, 2), '%s, tp 2: each rank\'s summary names the CUDA backend'
          % prec)
    rows.append((prec, 2, 'tp 2', g[-1]['loss'] if g else None, c[-1]['loss'] if c else None,
                 ref[-1]['loss'] if ref else None))
for prec in ('fp32', 'bf16') if want('tp') else ():
    ref, _ = log('tp-ref-%s-acc2' % prec)
    g, _ = log('tp-p2x2-' + prec)
    w = rel(g, ref)
    check(w is not None and w <= tp_tol[prec],
          '%s, 2 stages x tp 2 on 4 GPU ranks: within %g of one GPU rank of --accumulate 2 '
          '(largest %s)' % (prec, tp_tol[prec], w))
    check(on_cuda('tp-p2x2-' + prec, 4), '%s, 2 stages x tp 2: each rank\'s summary names the '
          'CUDA backend' % prec)
    rows.append((prec, 4, '2 stages x tp 2', g[-1]['loss'] if g else None,
                 ref[-1]['loss'] if ref else None))
sp_tol = {'fp32': 1e-5, 'bf16': 1e-3, 'fp16': 1e-3}

def worst_rel(a, b, n):
    """The largest relative difference of a's losses from b's, both n steps long."""
    if len(a) != n or len(b) != n or any(x['loss'] is None or y['loss'] is None
                                         for x, y in zip(a, b)):
        return None
    return max(abs(x['loss'] - y['loss']) / abs(y['loss']) for x, y in zip(a, b))

def on_gpus(name, n, sp):
    """Every rank of run name summarised the CUDA backend and its sequence-parallel size."""
    ok = True
    for k in range(n):
        _, s = log(name, k)
        ok = ok and bool(s) and s.get('backend') == 'cuda' and s.get('sp') == sp
    return ok

for prec in ('fp32', 'bf16', 'fp16') if want('sp') else ():
    ref, _ = log('sp-ref-' + prec)
    for n in (2, 4) if prec != 'fp16' else (2,):
        g, _ = log('sp%d-%s' % (n, prec))
        again, _ = log('sp%d-%s-again' % (n, prec))
        what = '%s, sequence_parallel_size %d on %d GPU ranks' % (prec, n, n)
        w = worst_rel(g, ref, 3)
        check(w is not None and w <= sp_tol[prec],
              what + ': within %g of one GPU rank (largest %s)' % (sp_tol[prec], w))
        check(bitwise(g, again, 3), what + ': bitwise its own run again (loss and digest)')
        check(on_gpus('sp%d-%s' % (n, prec), n, n),
              what + ': each rank\'s summary names the CUDA backend and sp %d' % n)
        rows.append((prec, n, 'sp %d' % n, g[-1]['loss'] if g else None,
                     ref[-1]['loss'] if ref else None, w))
    g, _ = log('sp2-' + prec)
    c, _ = log('sp2-cpu-' + prec)
    w = worst_rel(g, c, 3)
    check(w is not None and w <= tol[prec], '%s, sequence_parallel_size 2: GPU ranks within %g of '
          'CPU ranks (largest %s)' % (prec, tol[prec], w))
    rows.append((prec, 2, 'sp 2 against CPUs', g[-1]['loss'] if g else None,
                 c[-1]['loss'] if c else None, w))
for prec in ('fp32', 'bf16') if want('sp') else ():
    g, _ = log('sp2xp2-' + prec)
    r, _ = log('sp2-%s-acc4' % prec)
    one, _ = log('sp-ref-%s-acc4' % prec)
    what = '%s, sp 2 x 2 pipeline stages on 4 GPU ranks' % prec
    check(bitwise(g, r, 3), what + ': bitwise 2 sequence-parallel GPU ranks (loss and digest)')
    w = worst_rel(g, one, 3)
    check(w is not None and w <= sp_tol[prec],
          what + ': within %g of one GPU rank (largest %s)' % (sp_tol[prec], w))
    check(on_gpus('sp2xp2-' + prec, 4, 2), what + ': each rank\'s summary names the CUDA '
          'backend and sp 2')
    rows.append((prec, 4, 'sp 2 x stages 2', g[-1]['loss'] if g else None,
                 one[-1]['loss'] if one else None, w))
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
for stage in (1, 2) if want('wire') else ():
    f32, _ = log('wire-f32-s%d' % stage)
    for dt in ('fp16', 'bf16'):
        g, gsum = log('wire-%s-s%d' % (dt, stage))
        again, _ = log('wire-%s-s%d-again' % (dt, stage))
        c, _ = log('wire-%s-s%d-cpu' % (dt, stage))
        what = 'communication_data_type %s, 2 GPU ranks, stage %d' % (dt, stage)
        check(bitwise(g, again, 3), what + ': the same run twice, bitwise')
        worst = max((abs(a['loss'] - b['loss']) / abs(b['loss']) for a, b in zip(g, f32)),
                    default=None)
        check(worst is not None and len(f32) == 3 and worst <= 3e-2,
              what + ': within 3e-2 of the fp32 reduction (largest %s)' % worst)
        half = len(g) == 3 and all(a['grad_comm_bytes'] * 2 == b['grad_comm_bytes'] > 0
                                   for a, b in zip(g, f32))
        check(half, what + ': half the fp32 reduction\'s gradient bytes (%s against %s)'
              % (g[0]['grad_comm_bytes'] if g else None, f32[0]['grad_comm_bytes'] if f32 else None))
        worst = max((abs(a['loss'] - b['loss']) / abs(b['loss']) for a, b in zip(g, c)),
                    default=None)
        check(worst is not None and len(c) == 3 and worst <= 3e-2,
              what + ': within 3e-2 of 2 CPU ranks in %s (largest %s)' % (dt, worst))
        rows.append((dt + ' wire', 2, stage, g[-1]['loss'] if g else None,
                     c[-1]['loss'] if c else None))
for prec in ('fp32', 'bf16', 'fp16') if want('moe') else ():
    for name, n, ref, what in (('p2', 2, 'acc4', 'one GPU rank of --accumulate 4'),
                               ('2x2', 4, 'acc2', 'one GPU rank of --accumulate 2')):
        g, _ = log('moe-pipe-%s-%s' % (name, prec))
        r, _ = log('moe-pipe-ref-%s-%s' % (prec, ref))
        what_n = 'MoE %s, %d GPU ranks, 2 stages%s' % (
            prec, n, ', 2 copies, moe.ep_size 2' if n == 4 else '')
        same = bitwise(g, r, 3) and all(
            x.get(k) == y.get(k) for x, y in zip(g, r)
            for k in ('grad_norm', 'moe_aux_loss', 'experts_used', 'experts'))
        check(same, '%s: bitwise %s (loss, digest, gradient norm, balancing loss, experts '
              'used)' % (what_n, what))
        ok = True
        for k in range(n):
            _, s = log('moe-pipe-%s-%s' % (name, prec), k)
            ok = ok and bool(s) and s.get('pp') == 2 and s.get('pp_stage') == k % 2 and \
                s.get('backend') == 'cuda' and s.get('experts', 0) > 0
        check(ok, '%s: each rank\'s summary names its stage, the CUDA backend and the experts'
              % what_n)
        rows.append((prec + ' MoE stages', n, '-', g[-1]['loss'] if g else None,
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
      'for stages, their last loss and the reference\'s; for tp, the GPU ranks\', the CPU '
      'ranks\' and one GPU rank\'s last loss; for sp, the GPU ranks\' last loss, one GPU '
      'rank\'s (or the CPU ranks\') and the largest relative difference):')
for r in rows:
    print('    ', r)
sys.exit(1 if bad else 0)
PY
echo "cuda_emu ranks: $fails failure(s)"
[ $fails = 0 ]
