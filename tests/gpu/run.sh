#!/usr/bin/env bash
# run.sh - the GPU check, about 5 minutes on one GPU. It builds when this machine can (the
# project's own packages installed) and otherwise runs what tests/gpu/prepare.sh put in
# .gpu/. In order:
#   - the gpu suite: every CUDA kernel against its CPU twin (fp32, bf16, fp16), the trainer
#     on the GPU against the CPU (fp32, bf16 and fp16 with a real overflow, offloaded and
#     resident), the CUDA device tier and host pool, and the service's daemon sharing a GPU
#     arena with a client process through CUDA IPC;
#   - the swap-in benchmark NVMe -> pinned host -> device, next to a plain pinned cudaMemcpy
#     H2D figure from the same run;
#   - a short `zinf train` on the GPU with a device budget below the model's state, its
#     loss curve printed, in bf16 (the default) and again in fp16 with loss scaling;
#   - `zinf launch -n 1 -- zinf train` with --accumulate 2: a rank on LOCAL_RANK's GPU with
#     exact accumulation (the GPU ranks' folds and chunked norm);
#   - on a machine of 2 GPUs or more, `zinf launch -n 2` of 2 tensor-parallel GPU ranks;
#   - the step time with weights streamed from host memory against resident weights;
#   - bench/offload_step.sh on the GPU: the step with everything homed on NVMe against the
#     same step in memory and the IO floor.
# summary.txt, figures.json and logs.tar.gz (every log, the build's included) land in $OUT
# (or ./gpu-out): three files, since what comes back from such a machine is counted in
# files. The archive is refreshed after every step, and the steps share one deadline
# (BUDGET seconds, default 540: each step's timeout is cut to what is left), so that a run
# stopped from outside still leaves its summary and logs. DEVICE=emulated runs the same steps
# without a GPU (the gpu suite skips), to try the script itself. ONLY="name ..." runs only the
# steps named.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-out}
mkdir -p "$out"
out=$(cd "$out" && pwd)
logs=$(mktemp -d /tmp/zinf-gpu-logs.XXXXXX) # every log; archived into $out after each step
deadline=$((SECONDS + ${BUDGET:-540}))

if [ ! -x .gpu/bin/zinf ] && [ -f .gpu/gpu.tar.gz ]; then
  tar xzf .gpu/gpu.tar.gz -C .gpu || { echo "unpacking .gpu/gpu.tar.gz failed" | tee -a "$out/summary.txt"; exit 1; }
fi
if [ ! -x .gpu/bin/zinf ] && command -v meson > /dev/null; then
  echo "== building (.gpu/ is missing)" | tee -a "$out/summary.txt"
  tests/gpu/prepare.sh > "$logs/build.log" 2>&1 || {
    echo "build failed" | tee -a "$out/summary.txt"
    tar czf "$out/logs.tar.gz" -C "$logs" .
    exit 1
  }
fi
# CUDA's libraries come from this machine: its toolkit, or the Python wheels of its image.
cudalibs=/usr/local/cuda/lib64
for d in /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib \
         /opt/torch/.venv/lib/python3*/site-packages/nvidia/*/lib; do
  [ -d "$d" ] && cudalibs="$cudalibs:$d"
done
export LD_LIBRARY_PATH="$PWD/.gpu/lib:$cudalibs:${LD_LIBRARY_PATH:-}"
bin=$PWD/.gpu/bin
device=${DEVICE:-cuda}
swap=$(mktemp -d /tmp/zinf-gpu.XXXXXX)
status=0
# Training text: the project's own sources and docs.
cat README.md docs/*.md src/*/*.c src/*/*.h > "$swap/data.txt"

step() { # name timeout command...
  local name=$1 t=$2
  shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  local left=$((deadline - SECONDS))
  [ "$t" -le "$left" ] || t=$left
  echo "== $name: $*" | tee -a "$out/summary.txt"
  if [ "$t" -lt 5 ]; then
    echo "   not run: the run's deadline (BUDGET) is reached" | tee -a "$out/summary.txt"
    status=1
    return
  fi
  local t0=$SECONDS
  timeout "$t" "$@" > "$logs/$name.log" 2>&1
  local rc=$?
  tail -8 "$logs/$name.log" | sed 's/^/   /' | tee -a "$out/summary.txt"
  echo "   rc=$rc ($((SECONDS - t0)) s)" | tee -a "$out/summary.txt"
  [ $rc = 0 ] || status=1
  tar czf "$out/logs.tar.gz" -C "$logs" .
}

# The pinned host tier is mlocked: lift the limit where allowed, and say what it is.
ulimit -l unlimited 2> /dev/null || true
echo "memlock limit: $(ulimit -l) (KiB; pinned runs need more than their host budget)" |
  tee -a "$out/summary.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max \
  --format=csv > "$logs/gpu.txt" 2>&1
cat "$logs/gpu.txt" | tee -a "$out/summary.txt"
step version 20 "$bin/zinf" version
step topo 20 "$bin/zinf" topo
step kernels 60 "$bin/test_kernels" --verbose
step train_gpu 90 "$bin/test_train_gpu" --verbose
step device_gpu 30 "$bin/test_device" --filter 'device_gpu/*' --verbose
step host 30 "$bin/test_host" --verbose
# The service's daemon (a child process) sharing a GPU arena with a client through CUDA IPC,
# and putting back a GPU copy a client abandoned half-written.
step service_gpu 60 "$bin/test_service" --filter 'service/*gpu*' --verbose
# NCCL with one rank (libnccl loaded at run time from the machine's install).
step comm_nccl 60 "$bin/test_comm" --filter 'comm/nccl*' --verbose
step swapin 70 "$bin/swapin" --path "$swap/swapin" --device-kind "${device/cuda/auto}" --device-bytes 1G \
  --tensors 48 --tensor-size 64M --steps 4 --zinf "$bin/zinf" --json

# A short run on the GPU, the model's state several times the device budget.
mkdir -p "$swap/train"
cat > "$swap/train.json" <<JSON
{"zero_optimization": {"stage": 3,
 "offload_param": {"device": "nvme", "nvme_path": "$swap/train", "pin_memory": true},
 "offload_optimizer": {"device": "nvme", "nvme_path": "$swap/train", "pin_memory": true}},
 "aio": {"block_size": 1048576, "queue_depth": 32},
 "zinf": {"device": "$device", "device_bytes": "160M", "host_bytes": "1G"}}
JSON
step train 60 "$bin/zinf" train --config "$swap/train.json" --data "$swap/data.txt" --layers 8 \
  --dim 512 --heads 8 --seq 256 --batch 8 --steps 30 --lr 5e-4 --log "$logs/train.jsonl"
# The same model in fp16 with DeepSpeed's dynamic loss scaling, over a fresh swap directory.
step train16 45 "$bin/zinf" train --config "$swap/train.json" --data "$swap/data.txt" --layers 8 \
  --dim 512 --heads 8 --seq 256 --batch 8 --steps 15 --lr 5e-4 --precision fp16 --overwrite \
  --log "$logs/train16.jsonl"
# One rank through zinf launch (LOCAL_RANK 0's GPU) with two micro-batches a step: the
# exact accumulation of GPU ranks (the folds and the norm's chunk sums on the device). NCCL
# refuses two ranks on one GPU, so the GPU ranks' collectives across ranks are checked in
# the CPU emulation only (tests/cuda_emu/run.sh ranks); here NCCL runs at world 1
# (comm_nccl above).
step train_launch1 60 "$bin/zinf" launch -n 1 -- "$bin/zinf" train --config "$swap/train.json" \
  --data "$swap/data.txt" --layers 4 --dim 256 --heads 4 --seq 128 --batch 4 --steps 6 \
  --accumulate 2 --lr 5e-4 --overwrite --log "$logs/train_launch1.jsonl"
# Two tensor-parallel ranks, one GPU each, their sums over NCCL on device memory: only where
# the machine has 2 GPUs (NCCL refuses two ranks on one).
ngpu=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU')
if [ "$device" = cuda ] && [ "$ngpu" -ge 2 ]; then
  cat > "$swap/tp2.json" <<JSON
{"tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 1},
 "zinf": {"device": "cuda", "device_bytes": "2G", "host_bytes": "1G"}}
JSON
  step train_tp2 60 "$bin/zinf" launch -n 2 -- "$bin/zinf" train --config "$swap/tp2.json" \
    --data "$swap/data.txt" --layers 4 --dim 256 --heads 4 --seq 128 --batch 4 --steps 6 \
    --lr 5e-4 --log "$logs/train_tp2.jsonl"
fi
# Weights streamed from host memory against resident ones (the optimizer on the host in both).
step stream 90 env ZINF="$bin/zinf" MODE=host DEVICE="$device" LAYERS=6 DIM=1024 HEADS=16 SEQ=512 \
  BATCH=8 STEPS=4 DEVICE_BYTES=256M HOST_BYTES=4G RES_DEVICE_BYTES=4G RES_HOST_BYTES=4G \
  DATA="$swap/data.txt" bash "$bin/train_offload.sh" "$swap/stream" 2
# The offloaded step against its bounds (in memory, the IO floor) at 12 x 768, batch 4 x 64,
# and 16 x 128, everything homed on NVMe under 128M device / 256M host, with the GPU's copy
# engines.
mkdir -p "$swap/step"
step offload_step 240 env ZINF="$bin/zinf" DEVICE="$device" RUNS="mem memh on off" \
  DATA="$swap/data.txt" bash "$bin/offload_step.sh" "$swap/step" 2
step offload_step16 240 env ZINF="$bin/zinf" DEVICE="$device" RUNS="mem memh on off" \
  BATCH=16 SEQ=128 \
  DATA="$swap/data.txt" bash "$bin/offload_step.sh" "$swap/step" 2
rm -rf "$swap"

python3 - "$logs" "$out" <<'PY' || status=1
import json, os, re, sys
logs, out = sys.argv[1], sys.argv[2]
fig = {}
def lines(name):
    p = os.path.join(logs, name)
    return open(p, errors="replace").read().splitlines() if os.path.exists(p) else []
for l in lines("swapin.log"):
    if l.startswith("{") and '"summary": true' in l:
        fig["swapin"] = json.loads(l)
curve = [json.loads(l) for l in lines("train.jsonl") if l.startswith("{")]
fig["train_losses"] = [r["loss"] for r in curve if "step" in r]
fig["train_summary"] = next((r["summary"] for r in curve if "summary" in r), None)
curve16 = [json.loads(l) for l in lines("train16.jsonl") if l.startswith("{")]
fig["train16_losses"] = [r["loss"] for r in curve16 if "step" in r]
fig["train16_summary"] = next((r["summary"] for r in curve16 if "summary" in r), None)
curve_l = [json.loads(l) for l in lines("train_launch1.jsonl") if l.startswith("{")]
fig["train_launch1_losses"] = [r["loss"] for r in curve_l if "step" in r]
curve_tp = [json.loads(l) for l in lines("train_tp2.jsonl") if l.startswith("{")]
fig["train_tp2_losses"] = [r["loss"] for r in curve_tp if "step" in r]
for l in lines("stream.log"):
    m = re.search(r"median step-time ratio offloaded / resident: ([0-9.]+)", l)
    if m:
        fig["stream_ratio"] = float(m.group(1))
for name in ("offload_step", "offload_step16"):
    for l in lines(name + ".log"):
        m = re.search(r"offloaded / max\(in memory, IO floor, CPU floor\) = .*: ([0-9.]+)", l)
        if m:
            fig[name + "_ratio"] = float(m.group(1))
    fig[name] = [l for l in lines(name + ".log") if l.startswith("#")]
fig["kernels"] = [l for l in lines("kernels.log") if "largest" in l]
fig["train_gpu"] = [l for l in lines("train_gpu.log") if "largest" in l or "step" in l]
json.dump(fig, open(os.path.join(out, "figures.json"), "w"), indent=1)
# A loss that was not finite is logged as null.
show = lambda xs: " ".join("%.3f" % x if x is not None else "null" for x in xs)
print("loss curve:", show(fig["train_losses"]))
print("fp16 loss curve:", show(fig["train16_losses"]))
PY
echo "status $status" | tee -a "$out/summary.txt"
# Everything but the summary and the figures in one archive.
tar czf "$out/logs.tar.gz" -C "$logs" .
rm -rf "$logs"
exit $status
