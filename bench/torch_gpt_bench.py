#!/usr/bin/env python3
"""torch_gpt_bench.py - the step time of the model `zinf train` trains, in PyTorch eager on
the CPU, for bench/cpu_vs_torch.sh.

The same GPT-2-shaped model as src/train/gpt.c: byte vocabulary (256), learned positions
for SEQ tokens, LAYERS pre-LayerNorm blocks (LayerNorm, one fused qkv linear, causal
attention with scaled_dot_product_attention, projection, residual; LayerNorm, 4x MLP with
tanh GELU, projection, residual), a final LayerNorm and the head tied to the token
embedding, cross-entropy over every position. Same parameter count as zinf's (printed). The
step is zinf's: forward, backward with each block recomputed (torch.utils.checkpoint,
use_reentrant=False; --no-checkpoint keeps the activations), the global gradient norm
clipped to 1, AdamW(foreach=True) lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.

Batches are windows of the data file's bytes, as zinf's are; with --init, the weights come
from a `zinf train --export` file and the batches are the ones zinf draws for --seed (the same
windows, from the same formula), so the losses can be compared with zinf's step by step.
Threads: torch.set_num_threads.

    torch_gpt_bench.py --data FILE [--layers 12 --dim 768 --heads 12 --seq 64 --batch 4]
                       [--steps 5] [--threads 2] [--no-checkpoint]
                       [--init FILE.safetensors [--seed 1337]]

Prints one JSON object: {"params", "steps_ms": [...], "mean_ms" (steps 2..), "losses"}.
"""
import argparse
import json
import struct
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, C, NH):
        super().__init__()
        self.NH = NH
        self.ln1 = nn.LayerNorm(C, eps=1e-5)
        self.qkv = nn.Linear(C, 3 * C)
        self.proj = nn.Linear(C, C)
        self.ln2 = nn.LayerNorm(C, eps=1e-5)
        self.fc = nn.Linear(C, 4 * C)
        self.fc_proj = nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        hs = C // self.NH
        q = q.view(B, T, self.NH, hs).transpose(1, 2)
        k = k.view(B, T, self.NH, hs).transpose(1, 2)
        v = v.view(B, T, self.NH, hs).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.proj(y)
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, V, T, L, C, NH, ckpt):
        super().__init__()
        self.wte = nn.Embedding(V, C)
        self.wpe = nn.Embedding(T, C)
        self.blocks = nn.ModuleList(Block(C, NH) for _ in range(L))
        self.lnf = nn.LayerNorm(C, eps=1e-5)
        self.ckpt = ckpt
        for name, p in self.named_parameters():  # GPT-2's initialisation, as zinf's
            if name.endswith(".bias"):
                nn.init.zeros_(p)
            elif p.dim() == 1:
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T))
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.ckpt else b(x)
        logits = self.lnf(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def load_safetensors(path):
    """The tensors of a safetensors file (fp32 only), by name, and its metadata."""
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, v in header.items():
        if name == "__metadata__":
            continue
        if v["dtype"] != "F32":
            raise SystemExit("%s: %s is %s, not F32" % (path, name, v["dtype"]))
        a, b = v["data_offsets"]
        out[name] = torch.frombuffer(bytearray(raw[8 + n + a:8 + n + b]),
                                     dtype=torch.float32).reshape(v["shape"])
    return out, header.get("__metadata__", {})


def load_zinf_weights(model, path):
    """zinf's layout names onto this model's parameters; every one must be there."""
    w, meta = load_safetensors(path)
    names = {"wte": "wte.weight", "wpe": "wpe.weight", "lnf.w": "lnf.weight", "lnf.b": "lnf.bias"}
    parts = {"ln1.w": "ln1.weight", "ln1.b": "ln1.bias", "attn.qkv.w": "qkv.weight",
             "attn.qkv.b": "qkv.bias", "attn.proj.w": "proj.weight", "attn.proj.b": "proj.bias",
             "ln2.w": "ln2.weight", "ln2.b": "ln2.bias", "mlp.fc.w": "fc.weight",
             "mlp.fc.b": "fc.bias", "mlp.proj.w": "fc_proj.weight", "mlp.proj.b": "fc_proj.bias"}
    for i in range(len(model.blocks)):
        for k, v in parts.items():
            names["h%d.%s" % (i, k)] = "blocks.%d.%s" % (i, v)
    state = model.state_dict()
    if set(names) != set(w):
        raise SystemExit("%s: tensors %s do not match the model's %s" % (path, sorted(set(w) ^ set(names)), ""))
    with torch.no_grad():
        for zname, tname in names.items():
            if tuple(state[tname].shape) != tuple(w[zname].shape):
                raise SystemExit("%s: %s is %s, the model's %s" % (path, zname, tuple(w[zname].shape),
                                                                   tuple(state[tname].shape)))
            state[tname].copy_(w[zname])
    return meta


M64 = (1 << 64) - 1


def mix64(z):
    z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & M64
    z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & M64
    return z ^ (z >> 31)


def zinf_batch(data, seed, step, B, T):
    """The windows zinf train reads for step `step` (1-based) of one micro-batch: the last
    tenth of the data is held out when it holds a whole window (src/train/trainer.c)."""
    n = data.numel()
    train = n - n // 10 if n // 10 >= T + 1 else n
    span = train - T
    rows = []
    for b in range(B):
        off = mix64((seed * 0x9e3779b97f4a7c15 + step * 1000003 + b) & M64) % span
        rows.append(data[off:off + T + 1])
    w = torch.stack(rows)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-checkpoint", action="store_true")
    ap.add_argument("--init", help="weights from zinf train --export; batches drawn as zinf's")
    ap.add_argument("--seed", type=int, default=1337, help="zinf's --seed, for its batches")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(1337)
    data = torch.tensor(list(open(a.data, "rb").read()), dtype=torch.long)
    need = a.batch * a.seq + 1
    if data.numel() < need:
        raise SystemExit("torch_gpt_bench: %s holds %d bytes; a batch needs %d" % (a.data, data.numel(), need))
    model = GPT(256, a.seq, a.layers, a.dim, a.heads, not a.no_checkpoint)
    params = sum(p.numel() for p in model.parameters())
    if a.init:
        load_zinf_weights(model, a.init)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0, foreach=True)
    steps_ms, losses, pos = [], [], 0
    for _ in range(a.steps):
        if a.init:
            x, y = zinf_batch(data, a.seed, len(losses) + 1, a.batch, a.seq)
        else:
            if pos + need > data.numel():
                pos = 0
            chunk = data[pos:pos + need]
            pos += need - 1
            x = chunk[:-1].view(a.batch, a.seq)
            y = chunk[1:].view(a.batch, a.seq)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        steps_ms.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.item())
    timed = steps_ms[1:] or steps_ms
    print(json.dumps({"params": params, "threads": torch.get_num_threads(),
                      "checkpoint": not a.no_checkpoint, "steps_ms": steps_ms,
                      "mean_ms": sum(timed) / len(timed), "losses": losses}))


if __name__ == "__main__":
    main()
