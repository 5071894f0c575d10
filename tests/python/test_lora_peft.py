"""test_lora_peft.py - zinf train's LoRA exports in PEFT and transformers.

A small GPT is trained by zinf train and exported with --export-hf (the base); a LoRA run
from it (--init, every target, alpha 8 over rank 4) trains adapters and exports them with
--export-lora, and the merged weights with --export-hf. peft.PeftModel.from_pretrained loads
the adapters onto transformers' GPT2LMHeadModel of the base: its loss on the held-out
windows zinf evaluated at the end must be zinf's to a relative 1e-4; the merged export's
must be the adapter model's, and PEFT's own merge_and_unload() must give the merged
weights.

Skips, saying so, where torch, transformers or peft is not importable, or ZINF_BIN is unset.
"""
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench"))

try:
    import torch
    import peft
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    import hf_check  # the held-out windows and the loss as zinf computes them
except ImportError as e:
    torch = None
    why = str(e)

BASE_STEPS, LORA_STEPS, RANK, ALPHA = 20, 10, 4, 8
TOL = 1e-4


@unittest.skipIf(torch is None, "torch, transformers or peft is not importable")
@unittest.skipIf(not os.environ.get("ZINF_BIN"), "ZINF_BIN is not set")
class LoraPeft(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="zinf-lora-",
                                    dir=os.environ.get("ZINF_TEST_TMPDIR"))
        rng = random.Random(7)
        words = ("a frozen model learns through its adapters while every weight of its own "
                 "stays where it was ; the scale is alpha over the rank .").split()
        text = []
        while sum(len(w) + 1 for w in text) < 24 * 1024:
            text.append(rng.choice(words))
        self.data = " ".join(text).encode()
        self.data_path = os.path.join(self.tmp, "data.txt")
        with open(self.data_path, "wb") as f:
            f.write(self.data)
        self.cfg = os.path.join(self.tmp, "config.json")
        swap = os.path.join(self.tmp, "swap")
        with open(self.cfg, "w") as f:
            json.dump({"zero_optimization": {"offload_param": {"device": "nvme",
                                                               "nvme_path": swap},
                                             "offload_optimizer": {"device": "nvme",
                                                                   "nvme_path": swap}},
                       "zinf": {"device": "emulated", "device_bytes": "64M",
                                "host_bytes": "64M"}}, f)

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def train(self, *args):
        h = hf_check
        r = subprocess.run([os.environ["ZINF_BIN"], "train", "--config", self.cfg, "--data",
                            self.data_path, "--layers", str(h.LAYERS), "--dim", str(h.DIM),
                            "--heads", str(h.HEADS), "--seq", str(h.SEQ), "--batch",
                            str(h.BATCH), "--precision", "fp32", "--seed", str(h.SEED),
                            "--eval-batches", str(h.EVAL_BATCHES), "--overwrite", *args],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        return r.stdout

    def held_out(self, model):
        total = sum(hf_check.hf_loss(model, rows) for rows in hf_check.eval_batches(self.data))
        return float(torch.tensor(total / hf_check.EVAL_BATCHES, dtype=torch.float32))

    def load(self, path):
        m = GPT2LMHeadModel.from_pretrained(path, dtype=torch.float32,
                                            attn_implementation="eager")
        return m.eval()

    def test_adapters_in_peft_give_zinf_loss(self):
        base, ad, merged = (os.path.join(self.tmp, n) for n in ("base", "ad", "merged"))
        log = os.path.join(self.tmp, "lora.jsonl")
        self.train("--steps", str(BASE_STEPS), "--lr", "3e-3", "--export-hf", base)
        out = self.train("--steps", str(LORA_STEPS), "--lr", "1e-2", "--init", base,
                         "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA),
                         "--lora-targets", "c_attn,c_proj,c_fc", "--eval-every",
                         str(LORA_STEPS), "--log", log, "--export-lora", ad,
                         "--export-hf", merged)
        self.assertIn("# export-lora:", out)
        with open(log) as f:
            lines = [json.loads(s) for s in f if s.strip()]
        zinf_val = [e["val_loss"] for e in lines if e.get("eval") == LORA_STEPS][0]
        first = [e["loss"] for e in lines if e.get("step") == 1][0]

        plain = self.load(base)
        base_val = self.held_out(plain)
        model = peft.PeftModel.from_pretrained(plain, ad).eval()
        peft_val = self.held_out(model)
        rel = abs(peft_val - zinf_val) / abs(zinf_val)
        print(f"\nlora-peft: held-out loss zinf {zinf_val:.9g}, PEFT on the base {peft_val:.9g} "
              f"(rel {rel:.2e}); the base alone {base_val:.9g}; step 1 {first:.9g}",
              file=sys.stderr)
        self.assertLessEqual(rel, TOL)
        self.assertNotAlmostEqual(peft_val, base_val, places=4)  # the adapters do something

        merged_model = self.load(merged)
        merged_val = self.held_out(merged_model)
        self.assertLessEqual(abs(merged_val - peft_val) / abs(peft_val), 1e-5,
                             f"merged {merged_val} vs the adapter model's {peft_val}")
        # PEFT's own merge gives the merged export's weights.
        theirs = model.merge_and_unload().state_dict()
        ours = merged_model.state_dict()
        for k, v in ours.items():
            self.assertTrue(torch.allclose(v, theirs[k], rtol=1e-5, atol=1e-6), k)


if __name__ == "__main__":
    unittest.main()
