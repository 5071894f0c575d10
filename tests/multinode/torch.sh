#!/bin/sh
# torch.sh - zinf.torch across nodes under torchrun, each node a set of Linux namespaces on
# this machine (nodes.sh) sharing its network: gloo over 127.0.0.1, each rank's engine
# swapping to its node's own folder behind one common path. 2 nodes of 2 ranks run stages 1,
# 2 and 3 in turn (the static rendezvous: node0's agent holds the store), 3 nodes of 1 rank
# stage 3 (the c10d rendezvous: ranks by arrival). Checked: every rank's losses and final
# parameters within 1e-6 relative of one process accumulating the same global batch; each
# node's folder holds its own ranks' files and no others'; at stage 3 each engine homes about
# 1/N of the bytes. Then a rank of node1 dies mid-step (SIGKILL, then os._exit), and one
# hangs: both nodes' torchrun must exit non-zero within 60 s, and no rank be left.
#
# Not here: one node's ranks (tests/python/test_torch_dist.py), what the ranks run
# (tests/python/torch_nodes_train.py), zinf train across nodes (train.sh).
#
# Environment: ZINF_TORCH_PY (a Python with torch), ZINF_PYTHONPATH (where the zinf package
# is), ZINF_TEST_TMPDIR (where to work).

here=$(cd "$(dirname "$0")" && pwd)
. "$here/nodes.sh"
nodes_need
PY=${ZINF_TORCH_PY:?ZINF_TORCH_PY: a Python with torch}
"$PY" -c 'import torch.distributed as d; assert d.is_available() and d.is_gloo_available()' \
    2>/dev/null || nodes_skip "$PY has no torch.distributed with gloo"
export PYTHONPATH=${ZINF_PYTHONPATH:?ZINF_PYTHONPATH: the folder holding the zinf package}
train=$here/../python/torch_nodes_train.py
mkdir -p "${ZINF_TEST_TMPDIR:-/tmp}"
dir=$(mktemp -d "$(cd "${ZINF_TEST_TMPDIR:-/tmp}" && pwd)/torch-nodes.XXXXXX") || exit 1
swap=$dir/swap # every node's own folder is mounted here, in that node
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
DEADLINE=60
failed=0

fail()
{
    echo "FAIL: $*" >&2
    failed=1
}

# A port for the rendezvous no one listens on (bound and let go by the kernel's choice).
port()
{
    "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# across RDZV NODES PERNODE OUT SUB ARGS...: torchrun on each node at once, the rendezvous
# static (node k's ranks are k*PERNODE...; node0's agent holds the store) or c10d (ranks by
# arrival; the store is the first agent's). The nodes share the host's network namespace, so
# 127.0.0.1 reaches node0; --local-addr, since a node's host name resolves nowhere. Each
# node's torchrun's exit status in OUT/rc<k>, the time (s) it ended in OUT/end<k>.
across()
{
    rdzv=$1 n=$2 per=$3 out=$4 sub=$5
    shift 5
    mkdir -p "$out"
    p=$(port)
    case "$rdzv" in
    static) how="--master-addr 127.0.0.1 --master-port $p" ;;
    c10d) how="--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:$p --rdzv-id $sub --rdzv-conf join_timeout=60" ;;
    esac
    k=0
    pids=""
    while [ "$k" -lt "$n" ]; do
        (
            nodes_in "$k" "$PY" -m torch.distributed.run --nnodes "$n" --nproc-per-node "$per" \
                --node-rank "$k" $how --local-addr 127.0.0.1 --max-restarts 0 \
                --monitor-interval 0.5 "$train" rank --out "$out" --swap "$swap/$sub" "$@" \
                >"$out/node$k.txt" 2>&1
            echo $? >"$out/rc$k"
            date +%s.%N >"$out/end$k"
        ) &
        pids="$pids $!"
        k=$((k + 1))
    done
    # Those alone: the shell's other children are the nodes, which stay.
    wait $pids
}

nodes_up 3 "$dir" "$swap" || exit 1

# run RDZV NODES PERNODE STAGES: the one process, the job and the checks.
run()
{
    what="stages $4, $2 nodes x $3 ranks ($1 rendezvous)"
    sub=run-$1-$2x$3
    out=$dir/$sub
    mkdir -p "$out"
    t0=$(date +%s)
    "$PY" "$train" ref --out "$out" --swap "$dir/one-$sub" --world $(($2 * $3)) \
        >"$out/ref.txt" 2>&1 || fail "$what: the one process failed: $(tail -n 5 "$out/ref.txt")"
    across "$1" "$2" "$3" "$out" "$sub" --stages "$4"
    k=0
    while [ "$k" -lt "$2" ]; do
        [ "$(cat "$out/rc$k")" = 0 ] ||
            fail "$what: node$k's torchrun exited $(cat "$out/rc$k"): $(tail -n 20 "$out/node$k.txt")"
        k=$((k + 1))
    done
    "$PY" "$train" check --out "$out" --stages "$4" --nodes "$dir" --sub "$sub" --hosts "$2" ||
        fail "$what: the ranks differ from one process, or their swap folders mix"
    echo "$what: $(($(date +%s) - t0)) s"
}

run static 2 2 1,2,3
run c10d 3 1 3

# dies HOW TIMEOUT: a rank of node1 ends in its second step, after its first micro-batch's
# backward (HOW: kill, SIGKILL; hang, it sleeps on), the collectives' timeout TIMEOUT s: both
# nodes' torchrun must exit non-zero within DEADLINE s of it, leaving no rank behind.
dies()
{
    case "$1" in
    kill) what="2 nodes, a rank of node1 killed (timeout $2 s)" ;;
    exit) what="2 nodes, a rank of node1 exiting (timeout $2 s)" ;;
    *) what="2 nodes, a rank of node1 hung (timeout $2 s)" ;;
    esac
    out=$dir/$1
    export ZINF_TEST_DIE=node1:1:1 ZINF_TEST_DIE_HOW="$1"
    across static 2 2 "$out" "$1" --stages 3 --steps 4 --timeout "$2"
    unset ZINF_TEST_DIE ZINF_TEST_DIE_HOW
    died=$(sed -n 's/.* '"$1"'s in step .* at \([0-9.]*\)$/\1/p' "$out/node1.txt")
    if [ -z "$died" ]; then
        fail "$what: rank 3 did not $1 where it was told to: $(tail -n 20 "$out/node1.txt")"
        return
    fi
    for k in 0 1; do
        rc=$(cat "$out/rc$k")
        took=$(awk -v a="$(cat "$out/end$k")" -v b="$died" 'BEGIN { printf "%.1f", a - b }')
        echo "$what: node$k's torchrun exited $rc, $took s after"
        [ "$rc" != 0 ] || fail "$what: node$k's torchrun exited 0"
        awk -v t="$took" -v d="$DEADLINE" 'BEGIN { exit !(t <= d) }' ||
            fail "$what: node$k's torchrun took $took s to end after it"
    done
    if pgrep -f "$train rank --out $out" >/dev/null; then
        fail "$what: ranks left running: $(pgrep -a -f "$train rank --out $out")"
    fi
}

# Killed or exiting (os._exit), a rank's sockets close and gloo fails its peers' collectives
# at once, whatever the timeout: the default's 30 minutes here. Hung, only the timeout ends
# the others' waits.
dies kill 1800
dies exit 1800
dies hang 10

if [ "$failed" = 0 ]; then
    nodes_down
    rm -rf "$dir"
    echo "ok"
else
    echo "the runs' output: $dir" >&2
fi
exit "$failed"
