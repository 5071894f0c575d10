#!/usr/bin/env python3
"""torch_offload.py - one training run of a GPT, for bench/torch_offload.sh: in plain PyTorch
in memory, offloaded through zinf.torch, or under DeepSpeed ZeRO-3 with parameters and
optimizer states offloaded to NVMe.

    torch_offload.py --mode plain|zinf|deepspeed --text FILE --nvme DIR
                     [--model gpt|hf-gpt2|hf-llama] [--dtype fp32|bf16]
                     [--layers 8 --dim 512 --heads 8 --context 256 --vocab V]
                     [--batch 4 --steps 6] [--budget 0.1] [--threads 2]

Models: gpt, the example's (examples/torch_offload.py: byte vocabulary, head tied to the
embedding); hf-gpt2, transformers' GPT2LMHeadModel (head tied); hf-llama, LlamaForCausalLM
(intermediate size 8/3 x dim rounded up to 64, head untied). The transformers models are
built from a config with random weights (no download), dropout 0, a vocabulary of --vocab
(4096: at 8 x 512 their embedding's step then fits a tenth of the state; GPT-2's 50257
does not, and the budget is raised, see below), and take the file's bytes as token ids; the
loss is the cross entropy of their logits (in float32) against the next byte.

Every mode: torch.manual_seed(0) weights (made in fp32, then cast to --dtype), the same
batches, AdamW lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01. bf16: the model's
parameters in bf16; plain trains them with torch.optim.AdamW (its moments bf16 too),
zinf.torch.AdamW keeps a float32 master of each (its default), DeepSpeed runs with
"bf16": {"enabled": true}. A step is forward, backward, optimizer step and zero_grad, timed
with perf_counter. zinf: the whole state (parameters, gradients, moments, masters) homed on
NVMe, device (emulated) and host tiers of --budget times the state each, or of the least
zinf.torch takes where that is more (its largest module's parameters, its largest
parameter's step: budget_fraction says which fraction ran). DeepSpeed: offload_param and
offload_optimizer on NVMe, its CPU accelerator, one process (gloo), its live parameters
and buffers sized by the same budget.

The state (state_bytes) is zinf's layout: per parameter its own bytes, a float32 gradient,
two float32 moments and, for bf16, a float32 master (16 bytes fp32, 18 bf16).

Prints one JSON object: mode, model, dtype, params, state_bytes, steps_ms, median_ms
(steps 2..), phases_ms (the median forward, backward and step with zero_grad, steps 2..)
and blocked_phases_ms (zinf's: the time its engine blocked in each, medians), losses, max_rss_bytes (ru_maxrss), cpu_s_per_step (the process's user+system
CPU time a step, steps 2..) and cpu_s_per_step_by_thread (by thread name: "main", torch's
and zinf's workers), budget_bytes and budget_fraction, and for zinf the tiers'
peaks, the NVMe bytes moved in all and a step (steps 2..) and the time the engine blocked.
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))


class CausalLM(torch.nn.Module):
    """A transformers causal LM as the example's GPT is called: model(idx, targets) -> the
    mean cross entropy of its logits (float32) against targets."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, idx, targets):
        logits = self.lm(input_ids=idx, use_cache=False).logits.float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def make_model(a, ex):
    if a.model == "gpt":
        return ex.GPT(a.layers, a.dim, a.heads, a.context)
    import transformers

    transformers.logging.set_verbosity_error()
    if a.model == "hf-gpt2":
        cfg = transformers.GPT2Config(
            n_layer=a.layers, n_embd=a.dim, n_head=a.heads, n_positions=a.context,
            vocab_size=a.vocab or 4096, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            bos_token_id=0, eos_token_id=0)
        lm = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(
            num_hidden_layers=a.layers, hidden_size=a.dim,
            intermediate_size=(8 * a.dim // 3 + 63) // 64 * 64, num_attention_heads=a.heads,
            num_key_value_heads=a.heads, max_position_embeddings=a.context,
            vocab_size=a.vocab or 4096, tie_word_embeddings=False)
        lm = transformers.LlamaForCausalLM(cfg)
    return CausalLM(lm)


def thread_cpu():
    """CPU seconds (user + system) of this process's live threads, by name; the main thread
    as "main"."""
    out, tick, me = {}, os.sysconf("SC_CLK_TCK"), str(os.getpid())
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                st = f.read()
        except OSError:
            continue
        name = "main" if tid == me else st[st.index("(") + 1:st.rindex(")")]
        fields = st[st.rindex(")") + 2:].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def least_room(model):
    """The least tier budget zinf.torch takes for the model: its largest module's own
    parameters (fetched together to the device tier) and its largest parameter's step
    (parameter, float32 gradient, moments and master, fetched together to the host tier),
    each tensor's copy taking whole 4 KiB pages in its tier."""
    def room(nbytes):
        return -(-nbytes // 4096) * 4096

    mods = max(sum(room(p.numel() * p.element_size()) for p in m.parameters(recurse=False))
               for m in model.modules())
    step = max(room(p.numel() * p.element_size())
               + room(p.numel() * 4) * (3 if p.element_size() == 4 else 4)
               for p in model.parameters())
    return max(mods, step)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True, choices=["plain", "zinf", "deepspeed"])
    ap.add_argument("--text", required=True)
    ap.add_argument("--nvme", required=True)
    ap.add_argument("--model", default="gpt", choices=["gpt", "hf-gpt2", "hf-llama"])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--vocab", type=int, default=0,
                    help="transformers models: vocabulary (4096)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--overlap", type=int, default=1,
                    help="zinf: AdamW(overlap=) (1: updates deferred to the next forward)")
    a = ap.parse_args()

    import torch_offload as ex

    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = make_model(a, ex)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    model.to(dtype)
    params = sum(p.numel() for p in model.parameters())
    state = params * (16 if dtype == torch.float32 else 18)
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    out = dict(mode=a.mode, model=a.model, dtype=a.dtype, params=params, state_bytes=state)
    budget = max(int(state * a.budget) // 4096 * 4096, -(-least_room(model) // 4096) * 4096)
    out.update(budget_bytes=budget, budget_fraction=round(budget / state, 4))
    engine = None

    phases = []     # each step's (forward, backward, step) in ms
    blocks = []     # and zinf's: the time the engine blocked in each, in ms

    def blocked():
        return engine.stats()["blocked_ns"] / 1e6 if engine is not None else 0.0

    def timed(fwd, bwd, upd):
        def step(x, y):
            b0, t0 = blocked(), time.perf_counter()
            loss = fwd(x, y)
            b1, t1 = blocked(), time.perf_counter()
            bwd(loss)
            b2, t2 = blocked(), time.perf_counter()
            upd()
            b3, t3 = blocked(), time.perf_counter()
            phases.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3))
            blocks.append((b1 - b0, b2 - b1, b3 - b2))
            return loss.item()

        return step

    def torch_step(opt):
        def upd():
            opt.step()
            opt.zero_grad()

        return timed(model, lambda loss: loss.backward(), upd)

    if a.mode == "plain":
        step = torch_step(torch.optim.AdamW(model.parameters(), **hp))

    elif a.mode == "zinf":
        import zinf
        import zinf.torch

        engine = zinf.Engine(nvme_path=a.nvme, device_bytes=budget, host_bytes=budget,
                             device="emulated", overwrite=True)
        zinf.torch.offload(model, engine, home="nvme")
        step = torch_step(zinf.torch.AdamW(model.parameters(), overlap=bool(a.overlap), **hp))
        out["overlap"] = bool(a.overlap)

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
            "bf16": {"enabled": dtype == torch.bfloat16},
            "optimizer": {"type": "AdamW", "params": {
                "lr": hp["lr"], "betas": list(hp["betas"]), "eps": hp["eps"],
                "weight_decay": hp["weight_decay"]}},
            "zero_optimization": {
                "stage": 3,
                "offload_param": dict(nvme, buffer_count=5,
                                      buffer_size=max(budget // 4 // 5, 1 << 20,
                                                      max(p.numel() for p in model.parameters()))),
                "offload_optimizer": dict(nvme, buffer_count=4),
                "stage3_max_live_parameters": budget // 4,
                "stage3_prefetch_bucket_size": budget // 16,
                "stage3_param_persistence_threshold": 0,
            },
            "aio": {"block_size": 1048576, "queue_depth": 16, "single_submit": False,
                    "overlap_events": True, "thread_count": 1},
        }
        out["deepspeed"] = deepspeed.__version__
        engine_ds, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                  config=cfg)

        step = timed(engine_ds, engine_ds.backward, engine_ds.step)

    data = ex.batches(a.text, a.batch, a.context)
    times, losses = [], []
    marks = []      # after the first step and after the last: CPU time, NVMe bytes
    for i in range(a.steps):
        x, y = next(data)
        t0 = time.perf_counter()
        losses.append(step(x, y))
        times.append((time.perf_counter() - t0) * 1e3)
        if i in (0, a.steps - 1):
            c = os.times()
            st = engine.stats() if engine is not None else {}
            marks.append((c.user + c.system, st.get("nvme_bytes_read", 0),
                          st.get("nvme_bytes_written", 0), thread_cpu()))
    later = max(a.steps - 1, 1)
    out.update(steps_ms=[round(t, 1) for t in times],
               median_ms=round(statistics.median(times[1:] or times), 1), losses=losses,
               phases_ms={k: round(statistics.median(ph[i] for ph in phases[1:] or phases), 1)
                          for i, k in enumerate(("forward", "backward", "step"))},
               blocked_phases_ms={k: round(statistics.median(b[i] for b in blocks[1:] or blocks),
                                           1)
                                  for i, k in enumerate(("forward", "backward", "step"))},
               cpu_s_per_step=round((marks[-1][0] - marks[0][0]) / later, 3),
               cpu_s_per_step_by_thread={
                   k: round((v - marks[0][3].get(k, 0.0)) / later, 3)
                   for k, v in sorted(marks[-1][3].items())
                   if v - marks[0][3].get(k, 0.0) > 0},
               max_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if engine is not None:
        out.update(nvme_read_per_step=(marks[-1][1] - marks[0][1]) // later,
                   nvme_written_per_step=(marks[-1][2] - marks[0][2]) // later)
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
