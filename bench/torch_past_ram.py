#!/usr/bin/env python3
"""A Llama-shaped model whose fp32 state passes this machine's RAM, built straight into zinf
(zinf.torch.init) and trained a few steps with zinf.torch.AdamW, its whole state on NVMe.

    PYTHONPATH=build/python VENV/bin/python bench/torch_past_ram.py --nvme DIR [--ratio 1.5]

The layers are chosen so that 16 bytes per parameter (parameter, gradient and both moments
in fp32) come to --ratio times MemTotal. Prints, as one JSON line at the end: parameters,
the state's bytes against RAM, the time to build, each step's loss and seconds, the bytes
read and written from NVMe per step (engine.stats()), and the peak RSS (getrusage) against
RAM. The model is transformers' LlamaForCausalLM from a config (no download); the batch is
windows of a text file's bytes, the same each step unless --new-batches. --check holds the
issue's bar: state >= --ratio x RAM, the loss falls, peak RSS <= 0.35 x RAM.
"""
import argparse
import json
import resource
import time

import torch

import zinf
import zinf.torch


def mem_total():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise SystemExit("no MemTotal in /proc/meminfo")


def main():
    from transformers import LlamaConfig, LlamaForCausalLM

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nvme", required=True)
    ap.add_argument("--ratio", type=float, default=1.5, help="fp32 state / MemTotal")
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--intermediate", type=int, default=6912)
    ap.add_argument("--heads", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=5e-6)
    ap.add_argument("--new-batches", action="store_true",
                    help="a new batch each step (by default every step trains on the same "
                         "one, whose loss then falls step by step: on new batches a random "
                         "model's loss under Adam's first steps rises and falls, in plain "
                         "PyTorch as here)")
    ap.add_argument("--device-gib", type=float, default=1.0)
    ap.add_argument("--host-gib", type=float, default=2.5)
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 unless the state passes --ratio x RAM, the last loss is below "
                         "the first, and the peak RSS is at most 0.35 x RAM")
    a = ap.parse_args()

    ram = mem_total()
    h, f = a.hidden, a.intermediate
    per_layer = 4 * h * h + 3 * h * f + 2 * h
    fixed = 2 * a.vocab * h + h
    layers = 1
    while 16 * (fixed + layers * per_layer) < a.ratio * ram:
        layers += 1
    cfg = LlamaConfig(hidden_size=h, intermediate_size=f, num_hidden_layers=layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.heads,
                      vocab_size=a.vocab, max_position_embeddings=max(a.seq, 128),
                      tie_word_embeddings=False)
    out = {"layers": layers, "hidden": h, "intermediate": f, "ram_bytes": ram}
    with zinf.Engine(nvme_path=a.nvme, device="emulated",
                     device_bytes=int(a.device_gib * 2**30), host_bytes=int(a.host_gib * 2**30),
                     overwrite=True) as engine:
        t0 = time.perf_counter()
        torch.manual_seed(0)
        with zinf.torch.init(engine, home="nvme"):
            model = LlamaForCausalLM(cfg)
        out["build_s"] = round(time.perf_counter() - t0, 1)
        params = sum(zinf.torch._offload._numel(zinf.torch.shape_of(p))
                     for p in model.parameters())
        out["parameters"] = params
        out["state_bytes"] = 16 * params
        out["state_over_ram"] = round(16 * params / ram, 3)
        out["rss_after_build_over_ram"] = round(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / ram, 3)
        opt = zinf.torch.AdamW(model.parameters(), lr=a.lr)
        with open(a.text, "rb") as fh:
            data = torch.frombuffer(bytearray(fh.read()), dtype=torch.uint8).long()
        steps = []
        for step in range(a.steps):
            k = step * a.batch if a.new_batches else 0
            x = torch.stack([data[(k + i) * a.seq:(k + i + 1) * a.seq] for i in range(a.batch)])
            s0 = engine.stats()
            t0 = time.perf_counter()
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            s1 = engine.stats()
            steps.append({"loss": round(loss.item(), 4),
                          "s": round(time.perf_counter() - t0, 1),
                          "nvme_read_gb": round((s1["nvme_bytes_read"] - s0["nvme_bytes_read"]) / 1e9, 2),
                          "nvme_written_gb": round((s1["nvme_bytes_written"] -
                                                    s0["nvme_bytes_written"]) / 1e9, 2)})
            print(json.dumps(steps[-1]), flush=True)
        out["steps"] = steps
        out["peak_rss_over_ram"] = round(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / ram, 3)
        st = engine.stats()
        out["peaks"] = {"device": st["tier"][0]["peak_bytes"], "host": st["tier"][1]["peak_bytes"]}
    print(json.dumps(out))
    if a.check:
        bad = []
        if out["state_over_ram"] < a.ratio:
            bad.append(f"the state is {out['state_over_ram']} x RAM, not {a.ratio}")
        if not steps[-1]["loss"] < steps[0]["loss"]:
            bad.append(f"the loss did not fall: {[s['loss'] for s in steps]}")
        if out["peak_rss_over_ram"] > 0.35:
            bad.append(f"the peak RSS is {out['peak_rss_over_ram']} x RAM, over 0.35")
        if bad:
            raise SystemExit("torch_past_ram: " + "; ".join(bad))


if __name__ == "__main__":
    main()
