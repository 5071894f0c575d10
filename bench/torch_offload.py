#!/usr/bin/env python3
"""torch_offload.py - one training run of the example's GPT (examples/torch_offload.py), for
bench/torch_offload.sh: in plain PyTorch in memory, offloaded through zinf.torch, or under
DeepSpeed ZeRO-3 with parameters and optimizer states offloaded to NVMe.

    torch_offload.py --mode plain|zinf|deepspeed --text FILE --nvme DIR
                     [--layers 8 --dim 512 --heads 8 --context 256 --batch 4 --steps 6]
                     [--budget 0.1] [--threads 2]

Every mode: fp32, torch.manual_seed(0) weights, the same batches, AdamW lr 1e-3, betas
(0.9, 0.999), eps 1e-8, weight decay 0.01. A step is forward, backward, optimizer step and
zero_grad, timed with perf_counter. zinf: the whole state (parameters, gradients, moments)
homed on NVMe, device (emulated) and host tiers of --budget times the state each. DeepSpeed:
offload_param and offload_optimizer on NVMe, its CPU accelerator, one process (gloo).

Prints one JSON object: mode, params, state_bytes, steps_ms, median_ms (steps 2..),
losses, max_rss_bytes (ru_maxrss), and for zinf the tiers' budgets and peaks and the NVMe
bytes moved.
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True, choices=["plain", "zinf", "deepspeed"])
    ap.add_argument("--text", required=True)
    ap.add_argument("--nvme", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()

    import torch
    import torch_offload as ex

    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = ex.GPT(a.layers, a.dim, a.heads, a.context)
    params = sum(p.numel() for p in model.parameters())
    state = ex.state_bytes(model)
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    out = dict(mode=a.mode, params=params, state_bytes=state)
    engine = None

    def torch_step(opt):
        def step(x, y):
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.item()

        return step

    if a.mode == "plain":
        step = torch_step(torch.optim.AdamW(model.parameters(), **hp))

    elif a.mode == "zinf":
        import zinf
        import zinf.torch

        budget = int(state * a.budget) // 4096 * 4096
        engine = zinf.Engine(nvme_path=a.nvme, device_bytes=budget, host_bytes=budget,
                             device="emulated", overwrite=True)
        zinf.torch.offload(model, engine, home="nvme")
        step = torch_step(zinf.torch.AdamW(model.parameters(), **hp))
        out["budget_bytes"] = budget

    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                     ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533")):
            os.environ.setdefault(k, v)
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        nvme = {"device": "nvme", "nvme_path": a.nvme, "pin_memory": False}
        cfg = {
            "train_micro_batch_size_per_gpu": a.batch,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {
                "lr": hp["lr"], "betas": list(hp["betas"]), "eps": hp["eps"],
                "weight_decay": hp["weight_decay"]}},
            "zero_optimization": {
                "stage": 3,
                "offload_param": dict(nvme, buffer_count=5,
                                      buffer_size=max(int(state * a.budget / 4 / 5), 1 << 20)),
                "offload_optimizer": dict(nvme, buffer_count=4),
                "stage3_max_live_parameters": int(state * a.budget / 4),
                "stage3_prefetch_bucket_size": int(state * a.budget / 16),
                "stage3_param_persistence_threshold": 0,
            },
            "aio": {"block_size": 1048576, "queue_depth": 16, "single_submit": False,
                    "overlap_events": True, "thread_count": 1},
        }
        out["deepspeed"] = deepspeed.__version__
        engine_ds, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                  config=cfg)

        def step(x, y):
            loss = engine_ds(x, y)
            engine_ds.backward(loss)
            engine_ds.step()
            return loss.item()

    data = ex.batches(a.text, a.batch, a.context)
    times, losses = [], []
    for _ in range(a.steps):
        x, y = next(data)
        t0 = time.perf_counter()
        losses.append(step(x, y))
        times.append((time.perf_counter() - t0) * 1e3)
    out.update(steps_ms=[round(t, 1) for t in times],
               median_ms=round(statistics.median(times[1:] or times), 1), losses=losses,
               max_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if engine is not None:
        st = engine.stats()
        out.update(device_peak_bytes=st["tier"][0]["peak_bytes"],
                   host_peak_bytes=st["tier"][1]["peak_bytes"],
                   nvme_read_bytes=st["nvme_bytes_read"],
                   nvme_written_bytes=st["nvme_bytes_written"],
                   blocked_ms=round(st["blocked_ns"] / 1e6, 1))
        engine.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
