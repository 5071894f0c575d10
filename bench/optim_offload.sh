#!/usr/bin/env bash
# optim_offload.sh - the offloaded optimizer step (build/bench/optim_offload: AdamW over
# param, grad, m, v with an NVMe home, the engine reading ahead and writing back) against
# the same step in memory, plus the drive's raw rates from `zinf bench` on the same path
# with the same block size and queue depth, measured right before, so that the program
# can say how close the step comes to its IO bound.
#
# usage: bench/optim_offload.sh DIR [ELEMS] [STEPS]   (defaults: 64M 5)
#   ZINF=build/tools/zinf  PROG=build/bench/optim_offload  CHUNKS=32  THREADS=$(nproc)
#   BLOCK=1M  QD=32  BATCH=0  HOST_BYTES (default: a quarter of the state)
set -euo pipefail

dir=${1:?usage: bench/optim_offload.sh DIR [ELEMS] [STEPS]}
elems=${2:-64M} steps=${3:-5}
zinf=${ZINF:-build/tools/zinf} prog=${PROG:-build/bench/optim_offload}
chunks=${CHUNKS:-32} threads=${THREADS:-$(nproc)}
block=${BLOCK:-1M} qd=${QD:-32} batch=${BATCH:-0}
mkdir -p "$dir"
[ -x "$prog" ] || { echo "optim_offload.sh: $prog is not built (ninja -C build)" >&2; exit 1; }

# The raw rates: one write+read pass the size of the state (16 bytes a parameter).
size=$(python3 -c "import sys; u={'K':1<<10,'M':1<<20,'G':1<<30}; s=sys.argv[1]; \
print(int(float(s[:-1])*u[s[-1].upper()]) * 16 if s[-1].upper() in u else int(s) * 16)" "$elems")
raw=$("$zinf" bench --path "$dir" --size "$size" --block-size "$block" --queue-depth "$qd" \
        --submit-batch "$batch" --json)
rr=$(printf '%s\n' "$raw" | python3 -c 'import json,sys
rows=[json.loads(l) for l in sys.stdin]
assert all(r["verified"] for r in rows), "zinf bench: bytes read back wrong"
print(next(r["GBps"] for r in rows if r["op"]=="read"))')
rw=$(printf '%s\n' "$raw" | python3 -c 'import json,sys
print(next(json.loads(l)["GBps"] for l in sys.stdin if json.loads(l)["op"]=="write"))')
echo "# $(uname -sr), $(nproc) cpus; filesystem: $(df --output=source,fstype "$dir" | tail -1)"
echo "# zinf bench on DIR, $size bytes, block $block, qd $qd: write $rw GB/s, read $rr GB/s"
extra=()
[ -n "${HOST_BYTES:-}" ] && extra+=(--host-bytes "$HOST_BYTES")
"$prog" --path "$dir" --elems "$elems" --chunks "$chunks" --steps "$steps" --threads "$threads" \
  --block-size "$block" --queue-depth "$qd" --submit-batch "$batch" \
  --raw-read "$rr" --raw-write "$rw" "${extra[@]}"
