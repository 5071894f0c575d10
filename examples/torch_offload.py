#!/usr/bin/env python3
"""Train a GPT-2 shaped model on a text file with its whole state on NVMe, through zinf.

    PYTHONPATH=build/python python3 examples/torch_offload.py --text README.md --nvme /tmp/zinf-swap

Parameters, gradients and AdamW's moments live in zinf tensors homed on NVMe; the device
and host tiers each get a tenth of that state (--budget). The model is an ordinary
nn.Module (bytes as tokens); zinf.torch.offload and zinf.torch.AdamW are the only changes
a PyTorch loop needs.
"""
import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import zinf
import zinf.torch


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.attn_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2's shape: learned positions, pre-norm blocks, a head tied to the embedding."""

    def __init__(self, layers=4, d=256, heads=4, context=128, vocab=256):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def batches(path, batch, context, seed=0):
    """Random windows of the file's bytes, the next byte as each position's target."""
    with open(path, "rb") as f:
        data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
    if len(data) <= context + 1:
        raise SystemExit(f"{path}: {len(data)} bytes; the model's context needs "
                         f"{context + 2} or more")
    g = torch.Generator().manual_seed(seed)
    while True:
        i = torch.randint(len(data) - context - 1, (batch,), generator=g)
        x = torch.stack([data[j:j + context] for j in i])
        yield x, torch.stack([data[j + 1:j + 1 + context] for j in i])


def state_bytes(model):
    """Parameters, gradients and the two moments, in fp32."""
    return 16 * sum(p.numel() for p in model.parameters())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", required=True, help="the text file to train on")
    ap.add_argument("--nvme", required=True, help="a directory on NVMe for the state")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--budget", type=float, default=0.1,
                    help="device and host tier budgets as a fraction of the state")
    ap.add_argument("--device", default="auto", help="auto, cuda or emulated")
    a = ap.parse_args()

    torch.manual_seed(0)
    model = GPT(a.layers, a.dim, a.heads, a.context)
    params, state = sum(p.numel() for p in model.parameters()), state_bytes(model)
    budget = int(state * a.budget)
    with zinf.Engine(nvme_path=a.nvme, device_bytes=budget, host_bytes=budget,
                     device=a.device, overwrite=True) as engine:
        zinf.torch.offload(model, engine, home="nvme")
        opt = zinf.torch.AdamW(model.parameters(), lr=a.lr)
        print(f"{params / 1e6:.1f}M parameters, "
              f"state {state / 2**20:.0f} MiB on NVMe, tier budgets {budget / 2**20:.1f} MiB")
        data = batches(a.text, a.batch, a.context)
        for step in range(1, a.steps + 1):
            t0 = time.perf_counter()
            x, y = next(data)
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            print(f"step {step:3d}  loss {loss.item():.4f}  {time.perf_counter() - t0:.2f} s")
        s = engine.stats()
        print(f"peaks: device {s['tier'][0]['peak_bytes'] / 2**20:.1f} MiB, "
              f"host {s['tier'][1]['peak_bytes'] / 2**20:.1f} MiB; NVMe read "
              f"{s['nvme_bytes_read'] / 2**20:.0f} MiB, written {s['nvme_bytes_written'] / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
