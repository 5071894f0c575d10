#!/bin/sh
# train.sh - zinf train across nodes: `zinf launch --hostfile` on 2 and 3 nodes of 2 ranks
# (Linux namespaces on this machine, nodes.sh), each node's ranks swapping to that node's own
# folder behind the config's one nvme_path. Checked: every step's loss and parameter digest
# is bitwise one rank's accumulating the same global batch (stages 1 and 3); each node's
# folder holds its own ranks' shards and no others'; the bytes between the machines (the
# summaries' net_bytes_*) are the nodes' leaders' alone, more when every rank is its own node
# (ZINF_COMM_RANKS_PER_NODE=1, bitwise the same run), and none on one machine; a rank on node1 killed (SIGKILL) in a
# checkpoint fails the whole job, on every node, within seconds; and --resume on the same
# nodes continues bitwise as the run that never stopped.
#
# Not here: the communicator's own tests (test_comm), one node's ranks (test_cli).
#
# Environment: ZINF_BIN (the zinf program), ZINF_TEST_TMPDIR (where to work).

here=$(cd "$(dirname "$0")" && pwd)
. "$here/nodes.sh"
nodes_need
ZINF=${ZINF_BIN:?ZINF_BIN: the zinf program}
case "$ZINF" in /*) ;; *) ZINF=$PWD/$ZINF ;; esac
mkdir -p "${ZINF_TEST_TMPDIR:-/tmp}"
dir=$(mktemp -d "$(cd "${ZINF_TEST_TMPDIR:-/tmp}" && pwd)/multinode.XXXXXX") || exit 1
swap=$dir/swap # every node's own folder is mounted here, in that node
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
# Odd sizes: B*T = 51, dims not a multiple of 8's.
model="--layers 2 --dim 48 --heads 2 --seq 17 --batch 3"
failed=0

fail()
{
    echo "FAIL: $*" >&2
    failed=1
}

for i in $(seq 0 299); do echo "line $i of the text the byte model learns from."; done >"$dir/data.txt"

# config STAGE SWAPDIR: a config at that stage with everything on NVMe under SWAPDIR.
config()
{
    f=$dir/stage$1-$(echo "$2" | tr / _).json
    cat >"$f" <<CFG
{"zero_optimization": {"stage": $1, "offload_param": {"device": "nvme", "nvme_path": "$2"},
 "offload_optimizer": {"device": "nvme", "nvme_path": "$2"}},
 "aio": {"block_size": 65536, "queue_depth": 4},
 "zinf": {"device": "emulated", "device_bytes": "32M", "host_bytes": "32M"}}
CFG
    echo "$f"
}

# Each step of a --log file as "STEP LOSS DIGEST", one line a step (a step logged again by a
# resume must be logged the same: two lines then).
steps()
{
    sed -n 's/^{"step":\([0-9]*\),"loss":\([^,]*\),.*"digest":\("[0-9a-f]*"\|null\).*/\1 \2 \3/p' \
        "$1" | sort -u -n -k1,1 -k2,2 -k3,3 | sort -n -s -k1,1
}

# same REF GOT WHAT: the two logs' steps are the same, and there are some.
same()
{
    a=$(steps "$1")
    b=$(steps "$2")
    if [ -z "$a" ] || [ "$a" != "$b" ]; then
        fail "$3: the steps differ from one rank's"
        printf 'one rank:\n%s\nranks:\n%s\n' "$a" "$b" >&2
    fi
}

# across HOSTFILE ARGS...: zinf train across the nodes, under zinf launch, from node0.
across()
{
    hf=$1
    shift
    nodes_run "$ZINF" launch --hostfile "$hf" -- "$ZINF" train --data "$dir/data.txt" $model "$@" \
        >>"$dir/out.txt" 2>&1
}

nodes_up 3 "$dir" "$swap" || exit 1
head -n 2 "$dir/hostfile" >"$dir/hostfile2"
cp "$dir/hostfile" "$dir/hostfile3"

for stage in 1 3; do
    for n in 2 3; do
        what="stage $stage, $n nodes x 2 ranks"
        ranks=$((2 * n))
        ref=$dir/ref$stage-$n.jsonl
        "$ZINF" train --config "$(config $stage "$dir/one$stage-$n")" --data "$dir/data.txt" \
            $model --steps 3 --accumulate $ranks --log "$ref" >>"$dir/out.txt" 2>&1 ||
            fail "$what: one rank of --accumulate $ranks failed"
        log=$dir/run$stage-$n.jsonl
        t0=$(date +%s)
        across "$dir/hostfile$n" --config "$(config $stage "$swap/run$stage-$n")" --steps 3 \
            --log "$log" || fail "$what: the job failed (see $dir/out.txt)"
        echo "$what: $(($(date +%s) - t0)) s"
        same "$ref" "$log" "$what"
        # Each node holds its own ranks' shards, and only those.
        k=0
        while [ "$k" -lt "$n" ]; do
            want="rank-$((2 * k))-of-$ranks rank-$((2 * k + 1))-of-$ranks"
            got=$(ls "$dir/node$k/run$stage-$n" 2>/dev/null | tr '\n' ' ' | sed 's/ $//')
            [ "$got" = "$want" ] || fail "$what: node$k's swap folder holds '$got', not '$want'"
            k=$((k + 1))
        done
    done
done

# The bytes between nodes (the --log summaries' net_bytes_out and net_bytes_in): only a node's
# leader (its first rank) sends or receives any, what the ranks sent is what they received,
# the flat layout (ZINF_COMM_RANKS_PER_NODE=1: every rank its own node) moves more across the
# machines than the hierarchical one of the same run (stage 3's gathers go to each rank of
# the other machine, not once to its leader), and ranks on one machine move none.
# net LOG WORLD -> "OUT0 IN0 OUT1 IN1 ... NODES": each rank's bytes, rank 0's nodes.
net()
{
    r=0
    while [ "$r" -lt "$2" ]; do
        f=$1
        [ "$r" = 0 ] || f=$1.rank-$r
        sed -n 's/.*"net_bytes_out":\([0-9]*\),"net_bytes_in":\([0-9]*\).*/\1 \2/p' "$f" 2>/dev/null |
            tr '\n' ' '
        r=$((r + 1))
    done
    sed -n 's/.*"nodes":\([0-9]*\),.*/\1/p' "$1" 2>/dev/null
}

# leaders LOG: the 2 x 2 ranks' bytes: >0 on ranks 0 and 2, 0 on 1 and 3, 2 nodes, as many
# received in all as sent; echoes the total sent.
leaders()
{
    set -- $(net "$1" 4)
    if [ $# != 9 ] || [ "$9" != 2 ] || [ "$1" = 0 ] || [ "$2" = 0 ] || [ "$5" = 0 ] ||
        [ "$6" = 0 ] || [ "$3$4$7$8" != 0000 ] || [ $(($1 + $5)) != $(($2 + $6)) ]; then
        echo "bad: $*"
        return
    fi
    echo $(($1 + $5))
}

t0=$(date +%s)
hier=$(leaders "$dir/run3-2.jsonl")
case "$hier" in
bad*) fail "stage 3, 2 nodes: net bytes (out in, by rank; nodes) are not the leaders' alone: ${hier#bad: }" ;;
esac
for stage in 1 3; do
    got=$(net "$dir/run$stage-2.jsonl" 4)
    case "$got" in *" 2") ;; *) fail "stage $stage, 2 nodes: the summary says nodes ${got##* }, not 2" ;; esac
done
what="stage 3, 2 nodes x 2 ranks, flat"
log=$dir/flat3.jsonl
export ZINF_COMM_RANKS_PER_NODE=1
across "$dir/hostfile2" --config "$(config 3 "$swap/flat3")" --steps 3 --log "$log" ||
    fail "$what: the job failed (see $dir/out.txt)"
unset ZINF_COMM_RANKS_PER_NODE
same "$dir/ref3-2.jsonl" "$log" "$what"
set -- $(net "$log" 4)
if [ $# != 9 ] || [ "$9" != 4 ] || [ $(($1 + $3 + $5 + $7)) != $(($2 + $4 + $6 + $8)) ]; then
    fail "$what: net bytes (out in, by rank; nodes): $*"
else
    flat=$(($1 + $3 + $5 + $7))
    echo "$what: $flat bytes between the machines, hierarchical $hier"
    case "$hier" in
    bad*) ;;
    *) [ "$flat" -gt "$hier" ] || fail "$what: $flat bytes between the machines, not more than $hier" ;;
    esac
fi
what="one node, 2 ranks"
log=$dir/one.jsonl
nodes_in 0 "$ZINF" launch -n 2 -- "$ZINF" train --config "$(config 3 "$swap/one")" \
    --data "$dir/data.txt" $model --steps 1 --log "$log" >>"$dir/out.txt" 2>&1 ||
    fail "$what: the job failed (see $dir/out.txt)"
got=$(net "$log" 2)
[ "$got" = "0 0 0 0 1" ] || fail "$what: net bytes (out in, by rank; nodes) are '$got', not 0s of 1 node"
echo "the bytes between nodes, flat and on one node: $(($(date +%s) - t0)) s"

# A rank of node1 killed in its checkpoint of step 4 (ZINF_TEST_KILL_AT: before the
# checkpoint's first barrier), then --resume on the same nodes.
what="2 nodes, a rank of node1 killed"
cfg=$(config 3 "$swap/kill")
ref=$dir/kref.jsonl
"$ZINF" train --config "$(config 3 "$dir/kone")" --data "$dir/data.txt" $model --steps 6 \
    --checkpoint-every 2 --accumulate 4 --log "$ref" >>"$dir/out.txt" 2>&1 ||
    fail "$what: one rank of --accumulate 4 failed"
log=$dir/kill.jsonl
export ZINF_TEST_KILL_AT=before-barrier:2:3
if across "$dir/hostfile2" --config "$cfg" --steps 6 --checkpoint-every 2 --log "$log"; then
    fail "$what: the job exited 0"
fi
end=$(date +%s)
unset ZINF_TEST_KILL_AT
# The killed rank's last word is its log's last write: the job ended soon after it.
last=$(stat -c %Y "$log.rank-2" 2>/dev/null || echo 0)
took=$((end - last))
echo "$what: the job ended $took s after the kill"
[ "$took" -le 20 ] || fail "$what: the job took $took s to end after the kill"
if pgrep -f "train --data $dir/data.txt" >/dev/null; then
    fail "$what: ranks left running: $(pgrep -a -f "train --data $dir/data.txt")"
fi
grep -q '"checkpoint":2' "$log" || fail "$what: no checkpoint of step 2 was logged"
across "$dir/hostfile2" --config "$cfg" --steps 6 --checkpoint-every 2 --log "$log" --resume ||
    fail "$what: --resume failed (see $dir/out.txt)"
same "$ref" "$log" "$what, resumed"

if [ "$failed" = 0 ]; then
    nodes_down
    rm -rf "$dir"
    echo "ok"
else
    echo "the runs' output: $dir/out.txt" >&2
    tail -n 40 "$dir/out.txt" >&2
fi
exit "$failed"
