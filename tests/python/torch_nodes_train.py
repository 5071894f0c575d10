"""torch_nodes_train.py - the program tests/multinode/torch.sh runs on every rank of every
node under torchrun: zinf.torch's data parallelism over gloo across nodes, and the one
process it must match.

  rank: under torchrun (RANK, WORLD_SIZE, MASTER_ADDR... in the environment), for each
    of --stages in turn: the dist tests' GPT (its head tied to its embedding, the same seed
    on every rank), an engine swapping to SWAP/rank<R>/stage<S> (SWAP: on each node its
    own folder behind one path), offload(group=WORLD, stage=S), zinf.torch.AdamW, --steps
    steps of MICRO micro-batches of the rank's share of a fixed global batch. Writes
    OUT/rank<R>-stage<S>.pt: the losses, the final parameters (gathered at stage 3, as
    state_dict does) with their float64 checksum, the bytes its engine homes, the host it
    ran on and what its node's swap folder holds.
  ref: the same global batches as WORLD * MICRO micro-batches with gradient accumulation in
    one process, on one engine: OUT/ref.pt.
  check: every rank's files against ref.pt (losses and parameters within 1e-6 relative; at
    stage 3 each engine's bytes about 1/N of the reference's), and each node's swap folder
    holding its own ranks' only; prints what it found, exits 1 naming what differs.

ZINF_TEST_DIE=HOST:LOCAL_RANK:STEP has that rank die in that step, after its first
micro-batch's backward: by SIGKILL, by os._exit(3) where ZINF_TEST_DIE_HOW=exit, or by
sleeping (a rank that hangs alive) where it is hang. --timeout is init_process_group's:
how long a collective waits for a rank that stopped.

Not here: the nodes and torchrun (tests/multinode/torch.sh), one node's ranks
(test_torch_dist.py)."""

import argparse
import datetime
import math
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import test_torch_dist as td    # noqa: E402  the model, engine and measures the dist tests use

import zinf.torch as zt         # noqa: E402

MICRO = 2       # micro-batches a rank accumulates a step
BATCH = 24      # the global batch: divides into 2, 3, 4 and 6 ranks of MICRO micro-batches
PAGE = 4096


def _batches(steps, world):
    if BATCH % (world * MICRO):
        raise SystemExit(f"torch_nodes_train: a global batch of {BATCH} rows does not split "
                         f"into {world} ranks of {MICRO} equal micro-batches")
    data = td.ex.batches(td.TEXT, BATCH, td.CONTEXT)
    return [next(data) for _ in range(steps)]


def _checksum(params):
    return sum(v.double().sum().item() + v.double().square().sum().item()
               for v in params.values())


def _die_here(step):
    """ZINF_TEST_DIE names this node, local rank and step: end as it says."""
    want = os.environ.get("ZINF_TEST_DIE")
    if not want:
        return
    host, local, s = want.split(":")
    if (host, int(local), int(s)) != (socket.gethostname(), int(os.environ["LOCAL_RANK"]),
                                      step):
        return
    how = os.environ.get("ZINF_TEST_DIE_HOW", "kill")
    print(f"torch_nodes_train: rank {os.environ['RANK']} on {host} {how}s in step {step} "
          f"at {time.time():.3f}", file=sys.stderr, flush=True)
    if how == "exit":
        os._exit(3)
    if how == "hang":
        time.sleep(3600)
    os.kill(os.getpid(), signal.SIGKILL)


def reference(args):
    world = args.world
    model = td._model()
    with td._engine(model, os.path.join(args.swap, "ref")) as engine:
        zt.offload(model, engine, home="nvme")
        opt = zt.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for x, y in _batches(args.steps, world):
            total = 0.0
            for xs, ys in zip(x.chunk(world * MICRO), y.chunk(world * MICRO)):
                loss = model(xs, ys) / (world * MICRO)
                loss.backward()
                total += loss.item()
            losses.append(total)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
        params = td._params(model)
        res = {"losses": losses, "params": params, "checksum": _checksum(params),
               "home_bytes": td._home_bytes(engine), "world": world}
    torch.save(res, os.path.join(args.out, "ref.pt"))


def _train(args, stage, r, world):
    """One stage's run on this rank: its results."""
    model = td._model()
    with td._engine(model, os.path.join(args.swap, f"rank{r}", f"stage{stage}")) as engine:
        zt.offload(model, engine, home="nvme", group=dist.group.WORLD, stage=stage)
        opt = zt.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for step, (x, y) in enumerate(_batches(args.steps, world)):
            x, y = x.chunk(world)[r], y.chunk(world)[r]
            t = torch.zeros(())
            for i, (xs, ys) in enumerate(zip(x.chunk(MICRO), y.chunk(MICRO))):
                loss = model(xs, ys) / MICRO
                loss.backward()
                t += loss.detach()
                if i == 0:
                    _die_here(step)
            dist.all_reduce(t)
            losses.append(t.item() / world)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
        params = td._params(model)      # a collective at stage 3: every rank gathers
        return {"losses": losses, "params": params, "checksum": _checksum(params),
                "home_bytes": td._home_bytes(engine), "tensors": engine.stats()["tensors"],
                "host": socket.gethostname(), "world": world, "stage": stage}


def rank(args):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    try:
        r, world = dist.get_rank(), dist.get_world_size()
        for stage in args.stages:
            res = _train(args, stage, r, world)
            # The swap folder as this node sees it, after every rank closed its engine.
            dist.barrier()
            res["swap"] = sorted(os.listdir(args.swap))
            torch.save(res, os.path.join(args.out, f"rank{r}-stage{stage}.pt"))
    finally:
        dist.destroy_process_group()


def _check_rank(ref, got, where):
    """What differs between a rank's run and one process's: a list of sentences."""
    bad = []
    world = ref["world"]
    if got["world"] != world:
        bad.append(f"{where}: a group of {got['world']} ranks, the reference {world}")
    if len(got["losses"]) != len(ref["losses"]):
        bad.append(f"{where}: {len(got['losses'])} losses, the reference "
                   f"{len(ref['losses'])}")
    for step, (a, b) in enumerate(zip(ref["losses"], got["losses"])):
        if abs(a - b) > 1e-6 * abs(a):
            bad.append(f"{where}, step {step}: loss {b!r}, one process {a!r}")
    # The whole model within 1e-6 relative, each tensor within 1e-5: the ranks sum the
    # micro-batches' gradients in another order than the accumulation does, and a gradient
    # that is only rounding (the attention's key bias) then steps AdamW by lr another way
    # (test_torch_dist.py says more).
    diff = total = 0.0
    for name, want in ref["params"].items():
        have = got["params"].get(name)
        if have is None or have.shape != want.shape:
            bad.append(f"{where}: parameter {name} is missing or of another shape")
            continue
        gap = ((have - want).norm() / want.norm()).item()
        if gap > 1e-5:
            bad.append(f"{where}: parameter {name} is {gap:.3g} away")
        diff += (have - want).double().square().sum().item()
        total += want.double().square().sum().item()
    gap = math.sqrt(diff / total)
    if gap > 1e-6:
        bad.append(f"{where}: the parameters are {gap:.3g} away")
    if abs(got["checksum"] - ref["checksum"]) > 1e-6 * abs(ref["checksum"]):
        bad.append(f"{where}: checksum {got['checksum']!r}, one process {ref['checksum']!r}")
    share = got["home_bytes"] / ref["home_bytes"]
    if got["stage"] == 3:
        # 1/N of the bytes, give or take a page for each tensor (each takes whole pages, and
        # a slice's padding).
        most = ref["home_bytes"] / world + PAGE * got["tensors"]
        if got["home_bytes"] > most or share > 0.6:
            bad.append(f"{where}: its engine homes {got['home_bytes']} bytes, one process "
                       f"{ref['home_bytes']} (more than 1/{world} of it)")
    print(f"{where}: losses {got['losses'][0]:.6f} -> {got['losses'][-1]:.6f}, parameters "
          f"{gap:.2g} away, engine {share:.2f} of one process's bytes")
    return bad


def check(args):
    """Every rank's runs against the reference; where --nodes is given, each node's swap
    folder (NODES/<host>/SUB, outside the nodes) and the folder its ranks saw inside it hold
    its own ranks' and no others'."""
    ref = torch.load(os.path.join(args.out, "ref.pt"), weights_only=False)
    world = ref["world"]
    bad = []
    hosts = {}
    for stage in args.stages:
        for r in range(world):
            path = os.path.join(args.out, f"rank{r}-stage{stage}.pt")
            if not os.path.exists(path):
                bad.append(f"rank {r}, stage {stage}: no {path}")
                continue
            got = torch.load(path, weights_only=False)
            where = f"rank {r} ({got['host']}, stage {stage})"
            bad += _check_rank(ref, got, where)
            hosts.setdefault(got["host"], {})[r] = got["swap"]
    for host, ranks in sorted(hosts.items()):
        want = sorted(f"rank{r}" for r in ranks)
        for r, seen in ranks.items():
            if seen != want:
                bad.append(f"rank {r} saw {seen} in {host}'s swap folder, not {want}")
        if args.nodes:
            folder = os.path.join(args.nodes, host, args.sub)
            have = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
            if have != want:
                bad.append(f"{folder} holds {have}, not {want} ({host}'s ranks)")
    if args.nodes and len(hosts) != args.hosts:
        bad.append(f"the ranks ran on {sorted(hosts)}, not on {args.hosts} nodes")
    print(f"{len(hosts)} nodes: " + "; ".join(f"{h} ranks {sorted(rs)}"
                                               for h, rs in sorted(hosts.items())))
    if ref["losses"][-1] >= ref["losses"][0]:
        bad.append(f"the reference's loss did not fall: {ref['losses']}")
    for b in bad:
        print("FAIL:", b, file=sys.stderr)
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("rank", "ref", "check"))
    ap.add_argument("--out", required=True, help="the folder the results go to")
    ap.add_argument("--swap", help="the engines' folder (each rank its own rank<R> in it)")
    ap.add_argument("--stages", default="1",
                    type=lambda v: [int(x) for x in v.split(",")],
                    help="the ZeRO stages to run one after the other, as 1,2,3")
    ap.add_argument("--world", type=int, default=2, help="ref: the ranks it stands for")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=60.0,
                    help="seconds a collective waits for a rank that stopped")
    ap.add_argument("--nodes", help="check: the folder holding each node's swap folder "
                    "(NODES/<host>), seen from outside the nodes")
    ap.add_argument("--sub", default="", help="check: the swap folder's subfolder for the run")
    ap.add_argument("--hosts", type=int, default=1, help="check: the nodes the ranks ran on")
    args = ap.parse_args()
    if any(st not in (1, 2, 3) for st in args.stages):
        ap.error(f"--stages {args.stages}: ZeRO's stages are 1, 2 and 3")
    if args.mode != "check" and not args.swap:
        ap.error(f"{args.mode} needs --swap")
    os.makedirs(args.out, exist_ok=True)
    if args.mode == "check":
        return check(args)
    (rank if args.mode == "rank" else reference)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
