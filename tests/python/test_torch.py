"""test_torch.py - zinf.torch: ZeRO-Infinity for an nn.Module against plain PyTorch.

The example's GPT (examples/torch_offload.py) trained with its state offloaded to NVMe under
tier budgets of a tenth of that state, step by step against the same model in plain PyTorch
with torch.optim.AdamW (fp32): each step's loss within 1e-6 relative, no pin held between
steps, the peaks within the budgets. Also through a `zinf serve` daemon, gradient
accumulation, parameter groups and a learning-rate schedule, frozen parameters, a forward
that raises, the parameters back out (state_dict, remove, resume), and the refusals.

Every test skips, saying so, when torch is not importable (Debian has no torch package):
scripts/test-torch.sh makes a venv with torch from PyPI and runs them.
"""

import copy
import gc
import os
import shutil
import sys
import tempfile
import unittest

import zinf

import daemon

try:
    import torch
    import zinf.torch as zt
    import zinf.torch._grads as grads_module
    import zinf.torch._optim as zt_optim
except ImportError:
    torch = None

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(HERE, "..", "..", "examples")
TEXT = os.path.join(HERE, "..", "data", "torch_text.md")   # fixed: tests/data/README.md
PAGE = 4096

if torch is not None:
    sys.path.insert(0, EXAMPLES)
    import torch_offload as ex


def budget_of(model, fraction=0.1):
    """A tier budget of fraction of the model's state, in whole pages."""
    return int(ex.state_bytes(model) * fraction) // PAGE * PAGE


@unittest.skipIf(torch is None, "torch is not importable: scripts/test-torch.sh runs these "
                                "in a venv with torch from PyPI")
class Base(unittest.TestCase):
    def setUp(self):
        # Every update of these small models deferred to the next forward (the default
        # leaves parameters under 64 Ki elements to step()): the tests hold that path to
        # torch's numbers too. test_small_parameters_are_updated_in_step holds the default.
        self._overlap_min = zt_optim.OVERLAP_MIN
        zt_optim.OVERLAP_MIN = 0
        self.addCleanup(setattr, zt_optim, "OVERLAP_MIN", self._overlap_min)
        base = os.environ.get("ZINF_TEST_TMPDIR") or tempfile.gettempdir()
        os.makedirs(base, exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix="torch-", dir=base)
        self.swap = os.path.join(self.dir, "swap")
        torch.manual_seed(0)

    def tearDown(self):
        gc.collect()
        shutil.rmtree(self.dir, ignore_errors=True)

    def model(self, layers=4, d=128, context=64):
        return ex.GPT(layers, d, 4, context)

    def engine(self, model, fraction=None, **kw):
        """Tier budgets of a tenth of the state, or a fifth for the 2-layer models (whose
        largest parameter's four tensors take a seventh)."""
        if fraction is None:
            fraction = 0.1 if len(model.blocks) >= 4 else 0.2
        b = budget_of(model, fraction)
        return zinf.Engine(nvme_path=self.swap, device="emulated", device_bytes=b,
                           host_bytes=b, **kw)

    def assertIdle(self, engine, model):
        """Between steps: no pin held, every parameter empty in torch."""
        st = engine.stats()
        self.assertEqual(st["tier"][zinf.DEVICE]["pinned_bytes"], 0)
        self.assertEqual(st["tier"][zinf.HOST]["pinned_bytes"], 0)
        for p in model.parameters():
            self.assertEqual(p.data.numel(), 0)
            self.assertEqual(p.numel(), p._zinf.nbytes // p.element_size())
            self.assertTrue(p.grad is None or isinstance(p.grad, zt.GradProxy), p.grad)
            self.assertEqual(p._zinf.check(), [])

    def assertWithinBudgets(self, engine, budget):
        st = engine.stats()
        for tier in (zinf.DEVICE, zinf.HOST):
            self.assertEqual(st["tier"][tier]["capacity_bytes"], budget)
            self.assertLessEqual(st["tier"][tier]["peak_bytes"], budget)
            self.assertGreater(st["tier"][tier]["peak_bytes"], 0)

    def train_side_by_side(self, ref, off, engine, steps, tol=1e-6, opt_args=None,
                           accumulate=1, sched=None, idle_check=True):
        """steps of both models on the same batches; returns the worst relative gap."""
        opt_args = opt_args or dict(lr=1e-3)
        params_ref = opt_args.pop("groups_ref", None) or ref.parameters()
        params_off = opt_args.pop("groups_off", None) or off.parameters()
        o_ref = torch.optim.AdamW(params_ref, **opt_args)
        o_off = zt.AdamW(params_off, **opt_args)
        s_ref = sched(o_ref) if sched else None
        s_off = sched(o_off) if sched else None
        data = ex.batches(TEXT, 4, ref.wpe.num_embeddings)
        worst = 0.0
        for step in range(steps):
            for _ in range(accumulate):
                x, y = next(data)
                l_ref, l_off = ref(x, y), off(x, y)
                l_ref.backward()
                l_off.backward()
                gap = abs(l_ref.item() - l_off.item()) / abs(l_ref.item())
                worst = max(worst, gap)
                self.assertLessEqual(gap, tol, f"step {step}: {l_ref.item()} in torch, "
                                               f"{l_off.item()} offloaded")
            o_ref.step()
            o_off.step()
            o_ref.zero_grad()
            o_off.zero_grad()
            if sched:
                s_ref.step()
                s_off.step()
            if idle_check:
                self.assertIdle(engine, off)
        return worst


class TestTraining(Base):
    def test_twenty_steps_match_torch_adamw(self):
        ref = self.model()
        off = copy.deepcopy(ref)
        budget = budget_of(ref)
        # The state is at least 8 times the device budget (here 10 times).
        self.assertGreaterEqual(ex.state_bytes(ref), 8 * budget)
        with self.engine(ref) as e:
            zt.offload(off, e, home="nvme")
            self.assertIdle(e, off)
            worst = self.train_side_by_side(ref, off, e, 20)
            self.assertWithinBudgets(e, budget)
            st = e.stats()
            self.assertGreater(st["nvme_bytes_read"], ex.state_bytes(ref))
            self.assertEqual(st["steps"], 20)
            self.assertGreater(st["schedule_length"], 0)
            self.assertGreater(st["prefetches"], 0)
            print(f"\n20 steps: worst loss gap {worst:.2e} relative; state "
                  f"{ex.state_bytes(ref)} bytes, budgets {budget}; peaks device "
                  f"{st['tier'][0]['peak_bytes']}, host {st['tier'][1]['peak_bytes']}",
                  file=sys.stderr)
            # The values stepped are torch's, to the same tolerance.
            sd = off.zinf_offload.state_dict()
            for name, p in ref.named_parameters():
                torch.testing.assert_close(sd[name], p.detach(), rtol=1e-4, atol=1e-5)

    def test_zero_grad_zeroes_the_gradients_where_they_lie(self):
        """zero_grad() makes each gradient homed on NVMe zeros with Engine.zero (no byte
        moved: the engine's tests hold that, and that a fetch of it then reads nothing), for
        both set_to_none; the other tests hold the losses to torch's with it."""
        ref = self.model(layers=2)
        off = copy.deepcopy(ref)
        calls = []
        real = grads_module.zero

        def spy(engine, t):
            calls.append(real(engine, t))
            return calls[-1]

        with self.engine(ref) as e:
            zt.offload(off, e, home="nvme")
            grads_module.zero = spy
            try:
                for set_to_none, overlap in ((True, False), (False, False), (True, True),
                                             (False, True)):
                    o = zt.AdamW(off.parameters(), lr=1e-3, overlap=overlap)
                    data = ex.batches(TEXT, 4, ref.wpe.num_embeddings)
                    for step in range(3):
                        x, y = next(data)
                        off(x, y).backward()
                        o.step()
                        del calls[:]
                        o.zero_grad(set_to_none=set_to_none)
                        n = len(list(off.parameters()))
                        if overlap:
                            # Each zero waits for its parameter's deferred update.
                            self.assertEqual(calls, [])
                            off.zinf_offload.settle()
                        self.assertEqual(calls, [True] * n, "Engine.zero refused or not called")
                        self.assertIdle(e, off)
                    for p in off.parameters():
                        with e.fetch(p._zinf.grad, "host") as pin:
                            self.assertEqual(torch.count_nonzero(zt._torch_view(pin)), 0)
                    self.assertEqual(all(p._zinf.has_grad for p in off.parameters()),
                                     not set_to_none)
            finally:
                grads_module.zero = real

    def test_through_the_daemon(self):
        ref = self.model(layers=2)
        off = copy.deepcopy(ref)
        budget = budget_of(ref, 0.2)
        with daemon.serve(self, self.dir, self.swap, device_bytes=budget,
                          host_bytes=budget) as sock:
            with daemon.connect(sock, "torch") as e:
                zt.offload(off, e)
                self.train_side_by_side(ref, off, e, 5)
                self.assertWithinBudgets(e, budget)

    def test_gradient_accumulation_groups_and_schedule(self):
        ref = self.model(layers=2)
        off = copy.deepcopy(ref)
        with self.engine(ref) as e:
            zt.offload(off, e)

            def groups(m):
                decay = [p for n, p in m.named_parameters() if n.endswith("weight")]
                rest = [p for n, p in m.named_parameters() if not n.endswith("weight")]
                return [dict(params=decay, weight_decay=0.1),
                        dict(params=rest, weight_decay=0.0, lr=2e-3)]

            args = dict(lr=1e-3, betas=(0.8, 0.99), eps=1e-6,
                        groups_ref=groups(ref), groups_off=groups(off))
            self.train_side_by_side(
                ref, off, e, 4, opt_args=args, accumulate=3,
                sched=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5))

    def test_two_models_in_two_threads(self):
        """Two offloaded models on one engine, trained at once from two threads (each
        thread's forward, backward and step fetch and release while the other's run):
        each matches its own plain-PyTorch twin."""
        import threading

        pairs = []
        for seed in (1, 2):
            torch.manual_seed(seed)
            ref = self.model(layers=2)
            pairs.append((ref, copy.deepcopy(ref)))
        budget = 2 * budget_of(pairs[0][0], 0.2)
        with zinf.Engine(nvme_path=self.swap, device="emulated", device_bytes=budget,
                         host_bytes=budget) as e:
            for i, (_, off) in enumerate(pairs):
                zt.offload(off, e, prefix=f"m{i}.")
            errors = []

            def train(ref, off):
                try:
                    self.train_side_by_side(ref, off, e, 4, idle_check=False)
                except BaseException as ex:  # reported by the main thread
                    errors.append(ex)

            threads = [threading.Thread(target=train, args=p) for p in pairs]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise errors[0]
            self.assertIdle(e, pairs[0][1])
            self.assertIdle(e, pairs[1][1])

    def test_flushes_and_state_reads_from_another_thread(self):
        """While one thread trains (its deferred updates carried out by its forwards),
        another flushes and reads the model's state over and over: each flush first carries
        out what is pending, under the same lock as the hooks, and the training still
        matches plain PyTorch step by step. The last flush's saved state resumes to the
        model's values."""
        import threading

        torch.manual_seed(3)
        ref = self.model(layers=2)
        off = copy.deepcopy(ref)
        budget = budget_of(ref, 0.2)
        with zinf.Engine(nvme_path=self.swap, device="emulated", device_bytes=budget,
                         host_bytes=budget) as e:
            zt.offload(off, e)
            stop, errors, flushes = threading.Event(), [], [0]

            def side():
                try:
                    while not stop.is_set():
                        e.flush()
                        off.blocks[0].state_dict()
                        flushes[0] += 1
                except BaseException as ex:  # reported by the main thread
                    errors.append(ex)

            t = threading.Thread(target=side)
            t.start()
            try:
                self.train_side_by_side(ref, off, e, 4, idle_check=False)
            finally:
                stop.set()
                t.join()
            if errors:
                raise errors[0]
            self.assertGreater(flushes[0], 0)
            e.flush()
            want = {k: v.clone() for k, v in off.state_dict().items()}
        m2 = copy.deepcopy(self.model(layers=2))
        with zinf.Engine(nvme_path=self.swap, device="emulated", device_bytes=budget,
                         host_bytes=budget, resume=True) as e2:
            zt.offload(m2, e2, resume=True)
            for k, v in m2.state_dict().items():
                self.assertTrue(torch.equal(v, want[k]), k)

    def test_host_tier_compute(self):
        ref = self.model(layers=2)
        off = copy.deepcopy(ref)
        with self.engine(ref) as e:
            zt.offload(off, e, tier="host", home="nvme")
            self.train_side_by_side(ref, off, e, 3)
            self.assertEqual(e.stats()["tier"][zinf.DEVICE]["fetches"], 0)

    def test_frozen_parameters_and_no_grad(self):
        ref = self.model(layers=2)
        off = copy.deepcopy(ref)
        for m in (ref, off):
            for p in m.blocks[0].parameters():
                p.requires_grad_(False)
        with self.engine(ref) as e:
            zt.offload(off, e)
            frozen = {n: v.clone() for n, v in off.zinf_offload.state_dict().items()
                      if n.startswith("blocks.0.")}
            self.train_side_by_side(ref, off, e, 3)
            after = off.zinf_offload.state_dict()
            for n, v in frozen.items():
                self.assertTrue(torch.equal(after[n], v), n)
            x, y = next(ex.batches(TEXT, 2, 64))
            with torch.no_grad():
                torch.testing.assert_close(off(x, y), ref(x, y), rtol=1e-5, atol=0)
            self.assertIdle(e, off)


class Branches(torch.nn.Module if torch is not None else object):
    """Two linear layers, the second used on some steps only."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x, use_b):
        y = self.a(x)
        return (self.b(y) if use_b else y).square().mean()


class TestOptimizer(Base):
    def test_parameters_without_a_gradient(self):
        """A parameter that got no gradient since zero_grad(): skipped after
        set_to_none=True, stepped with zeros after set_to_none=False, as torch does."""
        for set_to_none in (True, False):
            ref = Branches()
            off = copy.deepcopy(ref)
            with zinf.Engine(nvme_path=self.swap, device="emulated", device_bytes=1 << 20,
                             host_bytes=1 << 20, overwrite=True) as e:
                zt.offload(off, e)
                o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
                o_off = zt.AdamW(off.parameters(), lr=1e-2, weight_decay=0.1)
                g = torch.Generator().manual_seed(1)
                for step in range(6):
                    x = torch.randn(4, 8, generator=g)
                    for m, o in ((ref, o_ref), (off, o_off)):
                        m(x, step % 3 == 0).backward()
                        o.step()
                        o.zero_grad(set_to_none=set_to_none)
                    self.assertIdle(e, off)
                got = off.zinf_offload.state_dict()
                for n, p in ref.named_parameters():
                    torch.testing.assert_close(got[n], p.detach(), rtol=1e-5, atol=1e-6,
                                               msg=f"{n}, set_to_none={set_to_none}")
                # b moved on the steps it had no gradient only when zeros were stepped.
                self.assertEqual(o_off.state[off.b.weight]["step"], 6 if not set_to_none else 2)


class TestModule(Base):
    def test_saved_tensors_hold_no_parameter(self):
        m = self.model(layers=2)
        with self.engine(m) as e:
            zt.offload(m, e)
            x, y = next(ex.batches(TEXT, 2, 64))
            off = m.zinf_offload
            loss = m(x, y)
            # The graph is built, and no parameter memory is held until its backward.
            self.assertIdle(e, m)
            n = len(list(m.parameters()))
            self.assertEqual(off.fetches, {"forward": n + 1, "unpack": 0, "gather": 0})
            loss.backward()
            self.assertIdle(e, m)
            # The backward fetched only the parameters autograd saved, as it unpacked them
            # (each Linear's weight, the head's being the tied embedding, and each
            # LayerNorm's weight and bias; no Linear's bias, no embedding as such), and
            # nothing for the gradients.
            saved = sum(1 for mod in m.modules() if isinstance(mod, torch.nn.Linear)) + \
                sum(2 for mod in m.modules() if isinstance(mod, torch.nn.LayerNorm))
            self.assertEqual(off.fetches, {"forward": n + 1, "unpack": saved, "gather": 0})
            # Twice through the same graph's saved values (retain_graph) works too.
            loss = m(x, y)
            loss.backward(retain_graph=True)
            loss.backward()
            self.assertIdle(e, m)

    def test_small_parameters_are_updated_in_step(self):
        """With the default overlap_min only parameters of 64 Ki elements and more wait for
        the next forward; the rest are updated inside step(). Either way the values equal
        overlap=False's."""
        zt_optim.OVERLAP_MIN = self._overlap_min
        out = []
        for overlap in (True, False):
            torch.manual_seed(0)
            m = torch.nn.Sequential(torch.nn.Linear(512, 256), torch.nn.Linear(256, 8))
            x = torch.randn(4, 512)
            with zinf.Engine(nvme_path=os.path.join(self.dir, str(overlap)), device="emulated",
                             device_bytes=8 << 20, host_bytes=8 << 20) as e:
                zt.offload(m, e)
                o = zt.AdamW(m.parameters(), lr=1e-2, overlap=overlap)
                for _ in range(2):
                    m(x).square().sum().backward()
                    o.step()
                    o.zero_grad()
                pending = {n: p._zinf.pending is not None for n, p in m.named_parameters()}
                self.assertEqual(pending, {"0.weight": overlap, "0.bias": False,
                                           "1.weight": False, "1.bias": False})
                out.append(m.state_dict())
        for k in out[0]:
            self.assertTrue(torch.equal(out[0][k], out[1][k]), k)

    def test_remove_is_refused_while_an_unpacked_view_lives(self):
        """A parameter the backward unpacked stays pinned as long as the view: remove()
        refuses meanwhile, changing nothing, and works once the view is gone."""
        m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
        want = {k: v.clone() for k, v in m.state_dict().items()}
        with zinf.Engine(nvme_path=self.swap, device="emulated", device_bytes=1 << 20,
                         host_bytes=1 << 20) as e:
            zt.offload(m, e)
            loss = m(torch.randn(2, 64, requires_grad=True)).sum()
            node = loss.grad_fn.next_functions[0][0]        # the last Linear's addmm
            w = node._saved_mat2                            # unpacked: a view of its weight
            self.assertTrue(torch.equal(w.t(), want["1.weight"]))
            with self.assertRaisesRegex(RuntimeError, "still holds parameters"):
                m.zinf_offload.remove()
            self.assertIsInstance(m[1].weight, zt.ZinfParameter)
            del w, node, loss
            gc.collect()
            m.zinf_offload.remove()
            for k, v in m.state_dict().items():
                self.assertTrue(torch.equal(v, want[k]), k)

    def test_forward_that_raises_releases(self):
        m = self.model(layers=2)
        with self.engine(m) as e:
            zt.offload(m, e)
            x, y = next(ex.batches(TEXT, 2, 64))
            with self.assertRaises(IndexError):
                m(x, torch.full_like(y, 1000))  # a target past the vocabulary
            self.assertIdle(e, m)
            loss = m(x, y)
            loss.backward()
            self.assertIdle(e, m)

    def test_remove_is_refused_while_a_forward_holds_parameters(self):
        # remove() from inside a forward, while a Linear's parameters are fetched: refused,
        # the module stays offloaded and runs on as before; after the forward it goes.
        m = self.model(layers=2)
        x, y = next(ex.batches(TEXT, 2, 64))
        with self.engine(m) as e:
            off = zt.offload(m, e)
            with torch.no_grad():
                want = m(x, y)
            lin = next(mod for mod in m.modules() if isinstance(mod, torch.nn.Linear))
            said = []

            def during(mod, args):
                try:
                    off.remove()
                except RuntimeError as err:
                    said.append(str(err))

            h = lin.register_forward_pre_hook(during)
            with torch.no_grad():
                got = m(x, y)
            h.remove()
            self.assertEqual(said, ["a forward or backward still holds parameters"])
            self.assertIs(m.zinf_offload, off)
            self.assertTrue(torch.equal(got, want))
            with torch.no_grad():
                self.assertTrue(torch.equal(m(x, y), want))
            off.remove()
            self.assertFalse(hasattr(m, "zinf_offload"))
            with torch.no_grad():
                self.assertTrue(torch.equal(m(x, y), want))

    def test_state_dict_load_remove_and_resume(self):
        m = self.model(layers=2)
        want = {n: p.detach().clone() for n, p in m.named_parameters()}
        plain_sd = m.state_dict()
        x, y = next(ex.batches(TEXT, 2, 64))
        with torch.no_grad():
            loss = m(x, y)
        with self.engine(m) as e:
            off = zt.offload(m, e)
            self.assertIs(m.zinf_offload, off)
            self.assertEqual(zt.shape_of(m.wte.weight), (256, 128))
            sd = off.state_dict()
            # torch's own: the tied head as an alias of the embedding, same keys as before.
            self.assertEqual(list(sd.keys()), list(plain_sd.keys()))
            self.assertIs(sd["head.weight"], sd["wte.weight"])
            self.assertEqual(list(m.state_dict().keys()), list(plain_sd.keys()))
            for n in want:
                self.assertTrue(torch.equal(sd[n], want[n]), n)
            with self.assertRaisesRegex(RuntimeError, "Missing key"):
                off.load_state_dict({"wte.weight": sd["wte.weight"]})
            bad = dict(sd, **{"ln_f.bias": torch.zeros(3)})
            with self.assertRaisesRegex(RuntimeError, "size mismatch for ln_f.bias"):
                off.load_state_dict(bad)
            self.assertIdle(e, m)
            m.load_state_dict({n: v * 0.5 for n, v in sd.items()})
            e.flush()
        # Resumed: the halved values.
        m2 = self.model(layers=2)
        with self.engine(m2, resume=True) as e:
            saved = e.stats()["tensors"]
            # A model of another shape is refused, and the saved tensors stay as they are.
            other = ex.GPT(2, 64, 4, 64)
            before = {n: p.detach().clone() for n, p in other.named_parameters()}
            with self.assertRaisesRegex(ValueError, "holds .* bytes"):
                zt.offload(other, e, resume=True)
            self.assertEqual(e.stats()["tensors"], saved)
            for n, p in other.named_parameters():
                self.assertTrue(torch.equal(p.detach(), before[n]), n)
            off = zt.offload(m2, e, resume=True)
            for n, v in off.state_dict().items():
                self.assertTrue(torch.equal(v, plain_sd[n] * 0.5), n)
            off.remove()
            self.assertEqual(e.stats()["tensors"], 0)
        self.assertFalse(hasattr(m2, "zinf_offload"))
        for n, p in m2.named_parameters():
            self.assertTrue(torch.equal(p.detach(), want[n] * 0.5), n)
        # A plain module again: it runs without an engine.
        with torch.no_grad():
            self.assertTrue(torch.isfinite(m2(x, y)))
        self.assertTrue(torch.isfinite(loss))

    def test_refusals_change_nothing(self):
        m = self.model(layers=2)
        with self.engine(m) as e:
            with self.assertRaises(TypeError):
                zt.offload(m.double(), e)
            m.float()
            with self.assertRaises(ValueError):
                zt.offload(m, e, tier="nvme")
            self.assertEqual(e.stats()["tensors"], 0)
            with self.assertRaises(ValueError):
                zt.AdamW(m.parameters())  # not offloaded
            zt.offload(m, e)
            with self.assertRaises(ValueError):
                zt.offload(m, e)  # twice
            with self.assertRaises(ValueError):
                zt.AdamW(m.parameters(), lr=-1)
        # A module larger than the device tier, an optimizer step larger than the host's.
        big = self.model(layers=2)
        with self.engine(big, fraction=0.001, overwrite=True) as e:
            with self.assertRaisesRegex(ValueError, "owns .* bytes of parameters"):
                zt.offload(big, e)
            self.assertEqual(e.stats()["tensors"], 0)
            self.assertGreater(big.wte.weight.numel(), 0)  # left as it was
        with zinf.Engine(nvme_path=self.swap, device="emulated", device_bytes=4 << 20,
                         host_bytes=256 << 10, overwrite=True) as e:
            zt.offload(big, e)
            with self.assertRaisesRegex(ValueError, "the host tier holds"):
                zt.AdamW(big.parameters())

    def test_a_step_that_fits_only_in_bytes_is_refused_up_front(self):
        """The host tier places each tensor in whole 4 KiB pages: a 6000-byte parameter's
        four tensors take 32 KiB, not 24000 bytes, and a 24 KiB tier is refused by AdamW
        rather than failing with ENOMEM at the step."""
        m = torch.nn.Linear(1500, 1, bias=False)
        with zinf.Engine(nvme_path=self.swap, device_bytes=1 << 20, host_bytes=24576,
                         device="emulated") as e:
            zt.offload(m, e, home="nvme")
            with self.assertRaisesRegex(ValueError, "take 32768 bytes; the host tier holds"):
                zt.AdamW(m.parameters())
            m.zinf_offload.remove()
        with zinf.Engine(nvme_path=self.swap, device_bytes=1 << 20, host_bytes=32768,
                         device="emulated", overwrite=True) as e:
            zt.offload(m, e, home="nvme")
            o = zt.AdamW(m.parameters())
            m(torch.randn(2, 1500)).sum().backward()
            o.step()

    def test_errors_from_the_engine_reach_the_caller(self):
        m = self.model(layers=2)
        with self.engine(m) as e:
            zt.offload(m, e, prefix="a.")
            # A name in use: the registration is undone, the module left as it was.
            m2 = self.model(layers=2)
            with self.assertRaises(zinf.Error):
                zt.offload(m2, e, prefix="a.")
            self.assertGreater(m2.wte.weight.numel(), 0)
            x, y = next(ex.batches(TEXT, 2, 64))
            m(x, y).backward()
            self.assertIdle(e, m)


if __name__ == "__main__":
    unittest.main()
