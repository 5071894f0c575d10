#!/usr/bin/env python3
"""hf_check.py - zinf train's --export-hf loaded by transformers' own GPT2LMHeadModel, whose
loss on zinf's batches must be zinf's loss to fp32 rounding; for scripts/check-deepspeed.sh.

A small model is trained with zinf train on the CPU in fp32 (2 layers, dim 64, 4 heads, seq
64, STEPS steps on generated text) and exported with --export-hf; the held-out loss zinf
measured at the end (--eval-every: the mean over 8 batches of windows spread evenly over the
data's last tenth, trainer_eval) is compared with GPT2LMHeadModel.from_pretrained(DIR) in
fp32 on the same windows, and must agree to a relative 1e-5. Then a second run starts from
the export (--init DIR/model.safetensors) and takes one step at learning rate 0: the loss of
that step, on the batch zinf draws for step 1 (train_load_batch), must be the model's on
that batch too, and its held-out loss must be the first run's to the bit.

transformers and safetensors are installed into the running interpreter's environment with
pip when they are missing, as bench/ds_env.sh installs deepspeed.

    hf_check.py ZINF_BINARY [STEPS]     (default 60)
"""
import json
import os
import random
import subprocess
import sys
import tempfile

LAYERS, DIM, HEADS, SEQ, BATCH, EVAL_BATCHES, SEED = 2, 64, 4, 64, 4, 8, 1337
TOL = 1e-5  # relative: fp32 rounding of two orders of summation

try:
    import transformers  # noqa: F401
    import safetensors  # noqa: F401
except ImportError:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "transformers", "safetensors"],
                   check=True)
import torch
import torch.nn.functional as F
from transformers import GPT2LMHeadModel
from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()

MASK64 = (1 << 64) - 1


def mix64(z):
    """trainer.c's mix64 (splitmix64's finaliser) on uint64."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def train_bytes(n):
    """The bytes batches come from: the last tenth is held out when it holds a sequence."""
    return n - n // 10 if n // 10 >= SEQ + 1 else n


def step_batch(data, step, micro=0):
    """train_load_batch(t, step, micro): B windows of T+1 bytes drawn from (seed, step, micro)."""
    span = train_bytes(len(data)) - SEQ
    offs = [mix64((SEED * 0x9E3779B97F4A7C15 + step * 1000003 + micro * BATCH + b) & MASK64) % span
            for b in range(BATCH)]
    return [data[o:o + SEQ + 1] for o in offs]


def eval_batches(data):
    """trainer_eval's windows: n x B starts spread evenly over the tail, the last at its end."""
    first = train_bytes(len(data))
    span = len(data) - first - SEQ - 1
    windows = EVAL_BATCHES * BATCH
    out = []
    for j in range(EVAL_BATCHES):
        rows = []
        for b in range(BATCH):
            k = j * BATCH + b
            off = first + (span * k // (windows - 1) if windows > 1 else 0)
            rows.append(data[off:off + SEQ + 1])
        out.append(rows)
    return out


def hf_loss(model, rows):
    """The mean cross-entropy over B x T targets, as zinf's head computes it."""
    x = torch.tensor([list(r[:SEQ]) for r in rows], dtype=torch.long)
    y = torch.tensor([list(r[1:]) for r in rows], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)).item()


def log_lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    zinf = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    tmp = tempfile.mkdtemp(prefix="zinf-hf-check-")
    # Text with words to learn: a fixed pseudo-random sequence of them, 96 KiB.
    words = ("the engine fetches each tensor to the device tier and releases it when the step "
             "is done ; eviction writes the dirty copies back to nvme , and the schedule "
             "learned on the first step prefetches ahead of use .").split()
    rng = random.Random(SEED)
    text = []
    while sum(len(w) + 1 for w in text) < 96 * 1024:
        text.append(rng.choice(words))
        if rng.random() < 0.08:
            text.append("\n")
    data = " ".join(text).encode()
    data_path = os.path.join(tmp, "data.txt")
    with open(data_path, "wb") as f:
        f.write(data)
    swap = os.path.join(tmp, "swap")
    cfg = os.path.join(tmp, "config.json")
    with open(cfg, "w") as f:
        json.dump({"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": swap},
                                         "offload_optimizer": {"device": "nvme",
                                                               "nvme_path": swap}},
                   "zinf": {"device": "emulated", "device_bytes": "64M", "host_bytes": "64M"}}, f)
    model_args = ["--layers", str(LAYERS), "--dim", str(DIM), "--heads", str(HEADS), "--seq",
                  str(SEQ), "--batch", str(BATCH), "--precision", "fp32", "--seed", str(SEED),
                  "--eval-batches", str(EVAL_BATCHES)]
    hf_dir = os.path.join(tmp, "hf")
    log_a, log_b = os.path.join(tmp, "a.jsonl"), os.path.join(tmp, "b.jsonl")

    def zinf_train(*args):
        r = subprocess.run([zinf, "train", "--config", cfg, "--data", data_path, *model_args,
                            *args], capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"hf-check: zinf train {' '.join(args)} failed ({r.returncode}):\n"
                     f"{r.stdout}{r.stderr}")

    zinf_train("--steps", str(steps), "--eval-every", str(steps), "--log", log_a,
               "--export-hf", hf_dir)
    zinf_val = [e["val_loss"] for e in log_lines(log_a) if e.get("eval") == steps][0]

    model, info = GPT2LMHeadModel.from_pretrained(hf_dir, dtype=torch.float32,
                                                  attn_implementation="eager",
                                                  output_loading_info=True)
    model.eval()
    bad = {k: v for k, v in info.items() if v}
    if bad:
        sys.exit(f"hf-check: from_pretrained({hf_dir}) did not load the export as it is: {bad}")
    if model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr():
        sys.exit("hf-check: lm_head is not tied to transformer.wte")

    # The held-out loss: each batch's fp32 mean, summed as a double, divided, cast to a float.
    total = sum(hf_loss(model, rows) for rows in eval_batches(data))
    hf_val = float(torch.tensor(total / EVAL_BATCHES, dtype=torch.float32))
    rel = abs(hf_val - zinf_val) / abs(zinf_val)

    # A run from the export, one step at learning rate 0: step 1's batch, and the same weights.
    zinf_train("--steps", "1", "--lr", "0", "--eval-every", "1", "--log", log_b, "--overwrite",
               "--init", os.path.join(hf_dir, "model.safetensors"))
    lines = log_lines(log_b)
    zinf_step = [e["loss"] for e in lines if e.get("step") == 1][0]
    zinf_val_b = [e["val_loss"] for e in lines if e.get("eval") == 1][0]
    hf_step = hf_loss(model, step_batch(data, 1))
    rel_step = abs(hf_step - zinf_step) / abs(zinf_step)

    ok = rel <= TOL and rel_step <= TOL and zinf_val_b == zinf_val
    print(f"hf-check: {LAYERS} layers, dim {DIM}, {HEADS} heads, seq {SEQ}, {steps} steps; "
          f"step 1's batch from --init of the export: GPT2LMHeadModel {hf_step:.9g} vs zinf "
          f"{zinf_step:.9g} (rel diff {rel_step:.2e}); held-out loss after --init "
          f"{zinf_val_b:.9g} ({'the same' if zinf_val_b == zinf_val else 'DIFFERENT'})")
    print(f"hf-check: GPT2LMHeadModel loss {hf_val:.9g} vs zinf {zinf_val:.9g} "
          f"(rel diff {rel:.2e}): {'ok' if ok else 'MISMATCH'}")
    subprocess.run(["rm", "-rf", tmp], check=False)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
