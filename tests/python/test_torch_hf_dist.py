"""test_torch_hf_dist.py - transformers' Trainer on 2 ranks over gloo, the model offloaded
with group=WORLD.

Trainer (through accelerate) wraps the model in DistributedDataParallel when
torch.distributed is initialised. DDP cannot wrap an offloaded module: its gradient hooks
are set on the placeholders zinf swaps tensors into, and the first backward failed with a
shape error that named nothing; zinf.torch averages the gradients itself anyway. So DDP
refuses an offloaded module at the wrap, naming the fix, and with the model marked prepared
(model._is_accelerate_prepared = True) Trainer trains it unwrapped: GPT-2 tiny (from its
config, dropout off) on 2 ranks at stages 1, 2 and 3 gives each step's loss and grad norm, and
the final parameters, of one process that trains the same global batch (per-device batch
twice as large) within 1e-6 relative. After remove() DDP wraps the plain module again.
Trainer's checkpoints, which save the optimizer's state_dict() from rank 0 alone, are
refused by name there: no rank holds that state whole.

Each rank is a process spawned here, with torchrun's environment (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so that Trainer sees the run as torchrun's.

Skips, saying so, where torch, gloo or transformers is missing.
"""

import os
import shutil
import socket
import tempfile
import traceback
import unittest

import zinf

try:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    import zinf.torch as zt
except ImportError:
    torch = None

try:
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    transformers.logging.set_verbosity_error()
except ImportError:
    transformers = None

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "..", "data", "torch_text.md")
STEPS, BATCH, ACCUMULATE, CONTEXT = 4, 8, 2, 32     # BATCH: the global batch per micro-step
WORLD = 2
FIX = "_is_accelerate_prepared"


def _model():
    torch.manual_seed(0)
    # No dropout: one process and 2 ranks draw their random numbers differently.
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=256,
                                      n_positions=CONTEXT, bos_token_id=0, eos_token_id=0,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


class _Windows(torch.utils.data.Dataset if torch is not None else object):
    """The text's bytes in windows of CONTEXT, each its own label."""

    def __init__(self):
        with open(TEXT, "rb") as f:
            self.data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()

    def __len__(self):
        return (len(self.data) - 1) // CONTEXT

    def __getitem__(self, i):
        x = self.data[i * CONTEXT:(i + 1) * CONTEXT]
        return {"input_ids": x, "labels": x}


def _train(folder, world, rank, stage=None, prepared=True, save="no"):
    """Trainer on the offloaded model: each logged step's (loss, grad norm) and the final
    parameters. world 1: one process, without a group. save: Trainer's save_strategy (its
    checkpoints every 2 steps where "steps")."""
    args = TrainingArguments(output_dir=os.path.join(folder, f"out{rank}"), max_steps=STEPS,
                             per_device_train_batch_size=BATCH // world,
                             gradient_accumulation_steps=ACCUMULATE, learning_rate=1e-3,
                             max_grad_norm=1.0, logging_steps=1, save_strategy=save,
                             save_steps=2,
                             use_cpu=True, report_to=[], seed=0, data_seed=0,
                             disable_tqdm=True)
    model = _model()
    with zinf.Engine(nvme_path=os.path.join(folder, f"swap{world}-{rank}"),
                     device_bytes=1 << 20, host_bytes=1 << 20) as engine:
        if world > 1:
            zt.offload(model, engine, group=dist.group.WORLD, stage=stage)
        else:
            zt.offload(model, engine)
        if prepared:
            # zinf.torch reduces the gradients: accelerate leaves the model unwrapped.
            model._is_accelerate_prepared = True
        opt = zt.AdamW(model.parameters(), lr=1e-3)
        trainer = Trainer(model=model, args=args, train_dataset=_Windows(),
                          optimizers=(opt, None))
        trainer.train()
        log = [(r["loss"], r["grad_norm"]) for r in trainer.state.log_history if "loss" in r]
        return {"log": log, "params": {k: v.clone() for k, v in model.state_dict().items()},
                "wrapped": type(trainer.model_wrapped).__name__}


def _refusals(folder, rank):
    """DDP on an offloaded module, and Trainer without the mark: the refusal; DDP on the
    module after remove(): wrapped."""
    got = {}
    model = _model()
    with zinf.Engine(nvme_path=os.path.join(folder, f"swap-refuse{rank}"),
                     device_bytes=1 << 20, host_bytes=1 << 20) as engine:
        off = zt.offload(model, engine, group=dist.group.WORLD, stage=1)
        try:
            torch.nn.parallel.DistributedDataParallel(model)
            got["ddp"] = "wrapped"
        except RuntimeError as err:
            got["ddp"] = str(err)
        try:
            got["trainer"] = _train(folder, WORLD, rank, 1, prepared=False)["wrapped"]
        except RuntimeError as err:
            got["trainer"] = str(err)
        off.remove()
    got["after remove"] = type(torch.nn.parallel.DistributedDataParallel(model)).__name__
    return got


def _rank(rank, folder, port, mode):
    out = os.path.join(folder, f"rank{rank}.pt")
    try:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                          LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        dist.init_process_group("gloo")
        try:
            if mode == "refuse":
                res = _refusals(folder, rank)
            elif mode == "checkpoint":
                # Trainer's checkpoint saves the optimizer's state_dict() on rank 0 alone,
                # which no rank holds whole: rank 0 refuses it by name (and the other
                # rank's next collective fails with it).
                try:
                    _train(folder, WORLD, rank, 1, save="steps")
                    res = {"checkpoint": "saved"}
                except zt.OffloadedError as err:
                    res = {"checkpoint": str(err)}
                except RuntimeError as err:
                    res = {"checkpoint": f"peer: {err}"}
            else:
                res = _train(folder, WORLD, rank, int(mode[5:]))
        finally:
            dist.destroy_process_group()
        torch.save(res, out)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@unittest.skipIf(torch is None or transformers is None,
                 "torch or transformers is not importable: scripts/test-torch.sh runs these "
                 "in a venv with both from PyPI")
class TestTrainerAcrossRanks(unittest.TestCase):
    def setUp(self):
        if not dist.is_available() or not dist.is_gloo_available():
            self.skipTest("torch.distributed with gloo is not available")
        base = os.environ.get("ZINF_TEST_TMPDIR") or tempfile.gettempdir()
        os.makedirs(base, exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix="torch-hf-dist-", dir=base)
        self.addCleanup(shutil.rmtree, self.dir, True)

    def spawn(self, mode):
        folder = tempfile.mkdtemp(prefix=f"{mode}-", dir=self.dir)
        mp.spawn(_rank, args=(folder, _port(), mode), nprocs=WORLD, join=True)
        out = []
        for r in range(WORLD):
            res = torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False)
            if "error" in res:
                self.fail(f"rank {r}:\n{res['error']}")
            out.append(res)
        return out

    def test_trainer_two_ranks_match_one_process(self):
        ref = _train(self.dir, 1, 0)
        self.assertEqual(len(ref["log"]), STEPS)
        self.assertLess(ref["log"][-1][0], ref["log"][0][0])
        for stage in (1, 2, 3):
            for r, got in enumerate(self.spawn(f"train{stage}")):
                where = f"stage {stage}, rank {r}"
                self.assertEqual(got["wrapped"], "GPT2LMHeadModel", where)
                self.assertEqual(len(got["log"]), STEPS, where)
                for step, (a, b) in enumerate(zip(ref["log"], got["log"])):
                    for what, x, y in (("loss", a[0], b[0]), ("grad norm", a[1], b[1])):
                        self.assertLessEqual(abs(x - y) / abs(x), 1e-6,
                                             f"{where}, step {step}: {what} {y}, one "
                                             f"process {x}")
                diff = total = 0.0
                for name, want in ref["params"].items():
                    have = got["params"][name]
                    diff += (have - want).double().square().sum().item()
                    total += want.double().square().sum().item()
                self.assertLessEqual((diff / total) ** 0.5, 1e-6, f"{where}: parameters")

    def test_trainer_checkpoint_of_a_partitioned_optimizer_is_refused(self):
        got = self.spawn("checkpoint")
        self.assertIn("save_only_model=True", got[0]["checkpoint"])
        self.assertIn("no rank holds the whole optimizer state", got[0]["checkpoint"])
        self.assertNotEqual(got[1]["checkpoint"], "saved")

    def test_ddp_refused_naming_the_fix(self):
        for r, got in enumerate(self.spawn("refuse")):
            for what in ("ddp", "trainer"):
                self.assertIn("DistributedDataParallel cannot wrap", got[what], f"rank {r}")
                self.assertIn(FIX, got[what], f"rank {r}")
                self.assertIn("averages the gradients over its group", got[what])
            self.assertEqual(got["after remove"], "DistributedDataParallel")


if __name__ == "__main__":
    unittest.main()
