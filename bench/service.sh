#!/usr/bin/env bash
# service.sh - the engine embedded against the same engine through `zinf serve`: starts a
# daemon from a config in DIR (the embedded engine's twin: the same budgets and IO
# settings, its own swap folder), runs build/bench/service (the hit path and the swap-in,
# alternating embedded and daemon) against it, stops the daemon. Arguments after DIR go to
# the benchmark (--rounds, --pairs, --tensors, --tensor-size, --steps).
#
# usage: bench/service.sh DIR [benchmark options]
#   ZINF=build/tools/zinf BENCH=build/bench/service DEVICE_BYTES=128M HOST_BYTES=128M
set -euo pipefail
dir=${1:?usage: bench/service.sh DIR [benchmark options]}
shift
zinf=${ZINF:-build/tools/zinf}
bench=${BENCH:-build/bench/service}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
# The same budgets and IO settings for both; each its own swap folder on the same drive.
for who in embedded daemon; do
  cat > "$dir/$who.json" <<JSON
{"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "$dir/swap-$who"}},
 "aio": {"block_size": 1048576, "queue_depth": 32},
 "zinf": {"device": "emulated", "device_bytes": "${DEVICE_BYTES:-128M}",
          "host_bytes": "${HOST_BYTES:-128M}"}}
JSON
done
sock=$dir/zinf.sock
"$zinf" serve --socket "$sock" --config "$dir/daemon.json" --log "$dir/serve.log" > "$dir/serve.out"
pid=$(sed -n 's/.*(pid \([0-9]*\)).*/\1/p' "$dir/serve.out")
trap 'kill "$pid" 2> /dev/null || true' EXIT
"$bench" --config "$dir/embedded.json" --connect "$sock" "$@"
