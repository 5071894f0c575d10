#!/usr/bin/env bash
# service_soak.sh - the daemon under N client processes x 4 worker threads (plus a flusher
# and a re-registering thread each) of random fetch/release/write/read/flush on shared
# budgets, for SECONDS: build/tests/stress_api --service --clients N, every byte each
# client reads checked against what it last released. Meanwhile the process holding the
# daemon (and client 0) is sampled every INTERVAL seconds: its resident memory and its open
# file descriptors, which must stay flat.
#
# usage: bench/service_soak.sh [SECONDS] [CLIENTS]   (default 600 s, 8 clients)
#   STRESS=build/tests/stress_api INTERVAL=10 ZINF_TEST_TMPDIR=/tmp
set -euo pipefail
seconds=${1:-600}
clients=${2:-8}
stress=${STRESS:-build/tests/stress_api}
interval=${INTERVAL:-10}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$stress" "$seconds" --service --clients "$clients" > "$log" 2>&1 &
pid=$!
echo "# stress_api $seconds s through the daemon, $clients client processes; sampled every $interval s"
echo "#  t_s   rss_kib   fds"
first_rss= first_fds= last_rss= last_fds=
t=0
sleep 2
while kill -0 "$pid" 2> /dev/null; do
  rss=$(awk '/^VmRSS/ {print $2}' "/proc/$pid/status" 2> /dev/null || true)
  fds=$(ls "/proc/$pid/fd" 2> /dev/null | wc -l)
  if [ -n "$rss" ]; then
    printf '  %4d %9d %5d\n' "$t" "$rss" "$fds"
    # The first sample after the workers started is the baseline; samples from the end of
    # the run on see the check, the restart and the resume, not the workers.
    if [ -z "$first_rss" ] && [ "$t" -ge "$interval" ]; then first_rss=$rss first_fds=$fds; fi
    if [ "$t" -lt "$seconds" ]; then last_rss=$rss last_fds=$fds; fi
  fi
  sleep "$interval"
  t=$((t + interval))
done
status=0
wait "$pid" || status=$?
tail -2 "$log"
echo "# rss $first_rss -> $last_rss KiB, fds $first_fds -> $last_fds (from the sample at ${interval} s to the last before ${seconds} s)"
[ "$status" = 0 ] || { echo "service_soak: stress_api failed (exit $status)"; grep -m3 FAILED "$log"; exit 1; }
