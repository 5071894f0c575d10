#!/bin/sh
# nodes.sh - K "nodes" on this one machine, for the multi-node tests: each node is a set of
# Linux namespaces (mount, UTS, IPC) held open by a sleeping process, with its own host
# name (node0, node1...), its own /dev/shm and its own swap folder mounted at one common
# path, so that a config naming that path gives each node an NVMe of its own. Open MPI
# reaches a node through an rsh agent that enters its namespaces (nsenter) instead of
# ssh; all traffic is over 127.0.0.1.
#
# Sourced by a test (. nodes.sh), it gives:
#   nodes_need                 exit 77 ("skip: ...") without root, unshare, nsenter, mpirun, pgrep
#   nodes_up K DIR SWAP        K nodes; node k's swap folder is DIR/node<k>, mounted at SWAP
#                              in that node; DIR/hostfile names them ("nodek slots=S",
#                              S = NODES_SLOTS, default 2); a trap tears them down at exit
#   nodes_run CMD...           CMD inside node0 (as a user on node0 runs mpirun), with Open
#                              MPI set to reach the other nodes; its exit status
#   nodes_in K CMD...          CMD inside node k
#   nodes_down                 ends the nodes (the trap does it too)
# Run as a program (nodes.sh selftest), it checks itself with mpirun and a shell program.
#
# Not here: what the tests run across the nodes (train.sh), the communicator.

NODES_PIDS=""
NODES_DIR=""

nodes_skip()
{
    echo "skip: $*"
    exit 77
}

nodes_need()
{
    [ "$(id -u)" = 0 ] || nodes_skip "the nodes are Linux namespaces, which need root"
    for t in unshare nsenter setsid mpirun pgrep; do
        command -v "$t" >/dev/null 2>&1 || nodes_skip "no $t on PATH (util-linux, openmpi-bin, procps)"
    done
    unshare --mount --uts --ipc true 2>/dev/null ||
        nodes_skip "unshare --mount --uts --ipc is refused here (a container without CAP_SYS_ADMIN?)"
}

nodes_down()
{
    for p in $NODES_PIDS; do
        kill -KILL "$p" 2>/dev/null
    done
    NODES_PIDS=""
}

# nodes_up K DIR SWAP
nodes_up()
{
    k=0
    NODES_DIR=$2
    mkdir -p "$NODES_DIR" "$3" || return 1
    trap 'nodes_down' EXIT
    trap 'nodes_down; exit 130' INT
    trap 'nodes_down; exit 143' TERM
    : >"$NODES_DIR/hostfile"
    while [ "$k" -lt "$1" ]; do
        mkdir -p "$NODES_DIR/node$k"
        rm -f "$NODES_DIR/node$k.pid"
        # The pid written is the sleep's (exec keeps it): the holder of the namespaces.
        setsid unshare --mount --uts --ipc --fork --propagation private sh -c '
            hostname "node$0" && mount -t tmpfs tmpfs /dev/shm &&
            mount --bind "$1" "$2" && echo $$ >"$3.tmp" && mv "$3.tmp" "$3" &&
            exec sleep infinity' "$k" "$NODES_DIR/node$k" "$3" "$NODES_DIR/node$k.pid" \
            </dev/null >/dev/null 2>"$NODES_DIR/node$k.err" &
        echo "node$k slots=${NODES_SLOTS:-2}" >>"$NODES_DIR/hostfile"
        k=$((k + 1))
    done
    k=0
    while [ "$k" -lt "$1" ]; do
        tries=0
        while [ ! -s "$NODES_DIR/node$k.pid" ]; do
            tries=$((tries + 1))
            if [ "$tries" -gt 100 ]; then
                echo "nodes.sh: node$k did not come up: $(cat "$NODES_DIR/node$k.err")" >&2
                return 1
            fi
            sleep 0.05
        done
        NODES_PIDS="$NODES_PIDS $(cat "$NODES_DIR/node$k.pid")"
        k=$((k + 1))
    done
    # Open MPI's way into a node: "agent [options] HOST orted ARGS...".
    cat >"$NODES_DIR/agent" <<AGENT
#!/bin/sh
while [ \$# -gt 0 ]; do
    case "\$1" in
    -*) shift ;;
    *) break ;;
    esac
done
host=\$1
shift
pid=\$(cat "$NODES_DIR/\$host.pid" 2>/dev/null) || { echo "agent: no node \$host" >&2; exit 1; }
exec nsenter -t "\$pid" -m -u -i -- /bin/sh -c "\$*"
AGENT
    chmod +x "$NODES_DIR/agent"
}

# The pid holding node k.
nodes_pid()
{
    cat "$NODES_DIR/node$1.pid"
}

nodes_in()
{
    n=$1
    shift
    nsenter -t "$(nodes_pid "$n")" -m -u -i --wd="$PWD" -- "$@"
}

nodes_run()
{
    OMPI_MCA_plm_rsh_agent="$NODES_DIR/agent" \
        OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_oob_tcp_if_include=lo \
        OMPI_MCA_btl_vader_single_copy_mechanism=none \
        OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
        nodes_in 0 "$@"
}

# The self-test: two nodes of two slots, each rank saying its node, and what it sees.
nodes_selftest()
{
    nodes_need
    dir=$(mktemp -d "${TMPDIR:-/tmp}/zinf-nodes.XXXXXX")
    nodes_up 2 "$dir" "$dir/swap" || exit 1
    echo hello >"$dir/node1/mine"
    out=$(nodes_run mpirun --hostfile "$dir/hostfile" --map-by slot -np 4 \
        /bin/sh -c 'echo "$OMPI_COMM_WORLD_RANK $(hostname) $(ls '"$dir"'/swap)"' | sort)
    want="0 node0 
1 node0 
2 node1 mine
3 node1 mine"
    rc=0
    if [ "$out" != "$want" ]; then
        printf 'nodes.sh: expected\n%s\ngot\n%s\n' "$want" "$out" >&2
        rc=1
    fi
    nodes_in 0 touch /dev/shm/zinf-nodes-test
    if nodes_in 1 test -e /dev/shm/zinf-nodes-test; then
        echo "nodes.sh: node1 sees node0's /dev/shm" >&2
        rc=1
    fi
    pids=$NODES_PIDS
    nodes_down
    sleep 0.2
    for p in $pids; do
        if kill -0 "$p" 2>/dev/null; then
            echo "nodes.sh: node holder $p still alive after nodes_down" >&2
            rc=1
        fi
    done
    rm -rf "$dir"
    [ "$rc" = 0 ] && echo "nodes.sh: 2 nodes, 4 ranks: ok"
    exit "$rc"
}

case "$0" in
*nodes.sh) [ "$1" = selftest ] && nodes_selftest ;;
esac
