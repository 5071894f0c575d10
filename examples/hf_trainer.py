#!/usr/bin/env python3
"""Fine-tune a Hugging Face model with transformers.Trainer, its state on NVMe through zinf.

    PYTHONPATH=build/python python3 examples/hf_trainer.py --text README.md --nvme /tmp/zinf-swap

The model (a small GPT-2 built from a config: no download; --model NAME_OR_DIR for one on
disk) is built straight into zinf (zinf.torch.init), so its parameters never sit in memory
whole; zinf.torch.AdamW keeps the moments there too. Trainer runs as it always does: its
gradient clipping, schedule, logging and checkpoints (model.safetensors with real weights,
the optimizer's state in torch's layout) all act on the offloaded model. --plain trains the
same model without zinf, for comparison. Prints the log and returns it (main()).
"""
import argparse
import tempfile

import torch

import zinf
import zinf.torch


class ByteWindows(torch.utils.data.Dataset):
    """A text file's bytes as tokens, in windows of --context."""

    def __init__(self, path, context):
        with open(path, "rb") as f:
            self.data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
        self.context = context

    def __len__(self):
        return (len(self.data) - 1) // self.context

    def __getitem__(self, i):
        x = self.data[i * self.context:(i + 1) * self.context]
        return {"input_ids": x, "labels": x}


def build(a):
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    if a.model:
        return AutoModelForCausalLM.from_pretrained(a.model)
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=a.layers, n_embd=a.dim, n_head=4,
                                      vocab_size=256, n_positions=a.context, bos_token_id=0,
                                      eos_token_id=0))


def main(argv=None):
    from transformers import Trainer, TrainingArguments

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", required=True, help="the text file to train on")
    ap.add_argument("--nvme", help="a directory on NVMe for the state (default: a temporary one)")
    ap.add_argument("--out", help="Trainer's output_dir (default: a temporary one)")
    ap.add_argument("--model", help="a Hugging Face model folder to fine-tune")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--budget-mib", type=int, default=4, help="device and host tier budgets")
    ap.add_argument("--plain", action="store_true", help="plain PyTorch, no zinf")
    ap.add_argument("--build-in-memory", action="store_true",
                    help="build the model in memory and offload it (the values --plain "
                         "starts from), rather than straight into zinf")
    a = ap.parse_args(argv)
    out = a.out or tempfile.mkdtemp(prefix="hf-trainer-")
    args = TrainingArguments(output_dir=out, max_steps=a.steps, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, learning_rate=a.lr,
                             max_grad_norm=1.0, logging_steps=2, save_steps=a.steps,
                             use_cpu=True, report_to=[], seed=0, data_seed=0,
                             disable_tqdm=True)
    data = ByteWindows(a.text, a.context)
    if a.plain:
        model = build(a)
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
        trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None))
        trainer.train()
        return _log(trainer)
    nvme = a.nvme or tempfile.mkdtemp(prefix="hf-trainer-swap-")
    with zinf.Engine(nvme_path=nvme, device_bytes=a.budget_mib << 20,
                     host_bytes=a.budget_mib << 20, overwrite=True) as engine:
        if a.model or a.build_in_memory:
            model = build(a)
            zinf.torch.offload(model, engine)
        else:
            torch.manual_seed(0)
            with zinf.torch.init(engine):
                model = build(a)
        opt = zinf.torch.AdamW(model.parameters(), lr=a.lr)
        trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None))
        trainer.train()
        engine.flush()
        return _log(trainer)


def _log(trainer):
    log = [r for r in trainer.state.log_history if "loss" in r]
    for r in log:
        print(f"step {r['step']:3d}  loss {r['loss']:.4f}  grad_norm {r['grad_norm']:.4f}")
    return log


if __name__ == "__main__":
    main()
