"""test_torch_conventions.py - torch's own calls on an offloaded model, against plain PyTorch.

What a Hugging Face Trainer-style loop calls besides forward, backward and step: the plain
torch.nn.utils.clip_grad_norm_ and clip_grad_value_, model.zero_grad() (set_to_none or
not), GradScaler, state_dict() and load_state_dict() of the model and of the optimizer (in
torch's layout, both ways), add_param_group, requires_grad_ after offload, amsgrad, maximize
and a tensor lr, a parameter read outside its module's forward (an error, or real values
under zinf.torch.gathered), deepcopy and pickling, an exception in the backward, and bf16
parameters with a float32 master. Each against torch.optim.AdamW on a plain copy.

Skips, saying so, when torch is not importable (scripts/test-torch.sh runs it in a venv).
"""

import copy
import io
import os
import sys
import unittest

import zinf

from test_torch import TEXT, Base, torch

if torch is not None:
    import zinf.torch as zt
    import torch_offload as ex


def batches(n=64, batch=4):
    return ex.batches(TEXT, batch, n)


class Conventions(Base):
    def pair(self, layers=2, **kw):
        ref = self.model(layers=layers)
        off = copy.deepcopy(ref)
        e = self.engine(ref, overwrite=True, **kw)
        zt.offload(off, e)
        return ref, off, e

    def run_loop(self, ref, off, e, steps, step_fn, tol=1e-6, o_ref=None, o_off=None):
        o_ref = o_ref or torch.optim.AdamW(ref.parameters(), lr=1e-3)
        o_off = o_off or zt.AdamW(off.parameters(), lr=1e-3)
        data = batches()
        for step in range(steps):
            x, y = next(data)
            l_ref, l_off = ref(x, y), off(x, y)
            gap = abs(l_ref.item() - l_off.item()) / abs(l_ref.item())
            self.assertLessEqual(gap, tol, f"step {step}: {l_ref.item()} in torch, "
                                           f"{l_off.item()} offloaded")
            l_ref.backward()
            l_off.backward()
            step_fn(step, ref, off, o_ref, o_off)
        return o_ref, o_off

    # ---- gradients -------------------------------------------------------------------------

    def test_clip_grad_norm_and_module_zero_grad_as_hf_trainer_calls_them(self):
        ref, off, e = self.pair()
        norms = []

        def step(i, ref, off, o_ref, o_off):
            n_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            n_off = torch.nn.utils.clip_grad_norm_(off.parameters(), 1.0)
            norms.append((n_ref.item(), n_off.item()))
            o_ref.step()
            o_off.step()
            ref.zero_grad()
            off.zero_grad()

        with e:
            self.run_loop(ref, off, e, 10, step)
            self.assertIdle(e, off)
        for a, b in norms:
            self.assertGreater(a, 1.0)   # the clipping acts
            self.assertLessEqual(abs(a - b) / a, 1e-5, norms)

    def test_other_norms_value_clipping_and_zero_grad_without_none(self):
        ref, off, e = self.pair()

        def step(i, ref, off, o_ref, o_off):
            for t in (float("inf"), 1.0):
                a = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9, norm_type=t)
                b = torch.nn.utils.clip_grad_norm_(off.parameters(), 1e9, norm_type=t)
                self.assertLessEqual(abs(a.item() - b.item()) / a.item(), 1e-5)
            torch.nn.utils.clip_grad_value_(ref.parameters(), 0.01)
            torch.nn.utils.clip_grad_value_(off.parameters(), 0.01)
            o_ref.step()
            o_off.step()
            ref.zero_grad(set_to_none=False)
            off.zero_grad(set_to_none=False)
            # Zeros, not gone: the next step moves every parameter (weight decay alone).

        with e:
            o_ref, o_off = self.run_loop(ref, off, e, 4, step)
            o_ref.step()
            o_off.step()
            for a, b in zip(ref.parameters(), off.parameters()):
                with zt.gathered(b):
                    torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-4, atol=1e-5)

    def test_gradient_accumulation_with_clipping_and_the_optimizers_zero_grad(self):
        ref, off, e = self.pair()
        o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        o_off = zt.AdamW(off.parameters(), lr=1e-3)
        data = batches()
        with e:
            for step in range(4):
                for _ in range(3):
                    x, y = next(data)
                    (ref(x, y) / 3).backward()
                    (off(x, y) / 3).backward()
                a = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
                b = zt.clip_grad_norm_(off.parameters(), 0.5)
                self.assertLessEqual(abs(a.item() - b.item()) / a.item(), 1e-5)
                o_ref.step()
                o_off.step()
                o_ref.zero_grad()
                o_off.zero_grad()
            x, y = next(data)
            self.assertLessEqual(abs(ref(x, y).item() - off(x, y).item()), 1e-5)

    def test_grad_scaler(self):
        ref, off, e = self.pair()
        s_ref = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        s_off = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)

        with e:
            o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
            o_off = zt.AdamW(off.parameters(), lr=1e-3)
            data = batches()
            for step in range(4):
                x, y = next(data)
                s_ref.scale(ref(x, y)).backward()
                l_off = off(x, y)
                if step == 2:   # an overflow: the step is skipped and the scale falls
                    l_off = l_off * float("inf")
                    s_ref.scale(ref(x, y) * float("inf")).backward()
                s_off.scale(l_off).backward()
                s_ref.unscale_(o_ref)
                s_off.unscale_(o_off)
                a = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
                b = torch.nn.utils.clip_grad_norm_(off.parameters(), 1.0)
                if step != 2:
                    self.assertLessEqual(abs(a.item() - b.item()) / a.item(), 1e-5)
                s_ref.step(o_ref)
                s_off.step(o_off)
                s_ref.update()
                s_off.update()
                self.assertEqual(s_ref.get_scale(), s_off.get_scale())
                o_ref.zero_grad()
                o_off.zero_grad()
            self.assertLess(s_off.get_scale(), 2.0 ** 10)
            x, y = next(data)
            self.assertLessEqual(abs(ref(x, y).item() - off(x, y).item()), 1e-5)

    def test_reading_a_gradient_or_a_parameter_between_uses_is_an_error(self):
        ref, off, e = self.pair()
        with e:
            x, y = next(batches())
            ref(x, y).backward()
            off(x, y).backward()
            w = off.blocks[0].c_fc.weight
            with self.assertRaisesRegex(zt.OffloadedError, "blocks.0.c_fc.weight"):
                w.norm()
            with self.assertRaisesRegex(zt.OffloadedError, "gathered"):
                (w * 2).sum()
            with self.assertRaisesRegex(zt.OffloadedError, "gradient of blocks.0.c_fc.weight"):
                w.grad.sum()
            with self.assertRaises(zt.OffloadedError):
                torch.cat([w.grad, w.grad])
            # What tells about the tensor works.
            self.assertEqual(w.dtype, torch.float32)
            self.assertTrue(w.requires_grad)
            self.assertIn("offloaded", repr(w))
            with zt.gathered([w], grads=True):
                torch.testing.assert_close(w.norm(), ref.blocks[0].c_fc.weight.norm())
                torch.testing.assert_close(w.grad, ref.blocks[0].c_fc.weight.grad)
            self.assertEqual(w.data.numel(), 0)
            self.assertEqual(w.numel(), ref.blocks[0].c_fc.weight.numel())
            self.assertIdle(e, off)
            # A parent reading a child's weight in its own forward: the error names it.
            with self.assertRaisesRegex(zt.OffloadedError, "wte.weight"):
                off.wte.weight @ torch.ones(128)
            # What is written under modify=True is kept.
            with zt.gathered(off.ln_f.bias, modify=True):
                off.ln_f.bias.data.fill_(0.25)
            self.assertTrue(torch.equal(off.state_dict()["ln_f.bias"],
                                        torch.full((128,), 0.25)))

    def test_refused_conversions_and_loads_change_nothing(self):
        """A dtype change after offload and load_state_dict(assign=True) are errors; the values
        in zinf stay."""
        ref, off, e = self.pair()
        with e:
            before = {k: v.clone() for k, v in off.state_dict().items()}
            with self.assertRaisesRegex(zt.OffloadedError, "offloaded as torch.float32"):
                off.double()
            with self.assertRaisesRegex(zt.OffloadedError, "assign"):
                off.load_state_dict(before, assign=True)
            off.to("cpu")                       # a move between devices passes
            x, y = next(batches())
            off(x, y).backward()
            # Any tensor put in place of the proxy (torch lets in only an empty one) forgets
            # the gradient, as None does: the next step skips the parameter.
            w = off.ln_f.weight
            w.grad = torch.empty(0)
            o = zt.AdamW([w], lr=1e-2)
            o.step()
            self.assertFalse(w._zinf.has_grad)
            after = off.state_dict()
            for k in before:
                self.assertTrue(torch.equal(before[k], after[k]), k)
            for p in off.parameters():
                self.assertEqual(p.dtype, torch.float32)

    # ---- optimizer -------------------------------------------------------------------------

    def test_requires_grad_after_offload_and_add_param_group(self):
        ref, off, e = self.pair()
        for m in (ref, off):
            m.blocks[1].requires_grad_(False)
        blocks1 = lambda m: list(m.blocks[1].parameters())  # noqa: E731
        rest = lambda m: [p for n, p in m.named_parameters()  # noqa: E731
                          if not n.startswith("blocks.1.")]
        with e:
            o_ref = torch.optim.AdamW(rest(ref), lr=1e-3)
            o_off = zt.AdamW(rest(off), lr=1e-3)

            def step(i, ref, off, o_ref, o_off):
                o_ref.step()
                o_off.step()
                o_ref.zero_grad()
                o_off.zero_grad()
                if i == 1:   # unfrozen, with a group of their own
                    for m, o in ((ref, o_ref), (off, o_off)):
                        m.blocks[1].requires_grad_(True)
                        o.add_param_group({"params": blocks1(m), "lr": 3e-3})

            self.run_loop(ref, off, e, 5, step, o_ref=o_ref, o_off=o_off)
            self.assertEqual(len(o_off.param_groups), 2)
            # Trained since they were unfrozen (3 steps of 3e-3 move each by ~9e-3); an
            # element whose gradient is as small as eps moves by a few 1e-5 otherwise.
            with zt.gathered(blocks1(off)):
                for a, b in zip(blocks1(ref), blocks1(off)):
                    torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-4, atol=5e-5)
            with self.assertRaisesRegex(ValueError, "offloaded parameters only"):
                o_off.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))]})

    def test_adamw_arguments_and_state_both_ways(self):
        for kw in (dict(amsgrad=True), dict(maximize=True), dict(lr=torch.tensor(1e-2)),
                   dict(weight_decay=0.0, betas=(0.8, 0.99), foreach=False)):
            with self.subTest(**{k: str(v) for k, v in kw.items()}):
                ref, off, e = self.pair()
                args = dict(dict(lr=1e-3), **kw)
                with e:
                    o_ref = torch.optim.AdamW(ref.parameters(), **args)
                    o_off = zt.AdamW(off.parameters(), **args)

                    def step(i, ref, off, o_ref, o_off):
                        o_ref.step()
                        o_off.step()
                        o_ref.zero_grad()
                        o_off.zero_grad()

                    self.run_loop(ref, off, e, 4, step, tol=1e-5, o_ref=o_ref, o_off=o_off)
                    a, b = o_ref.state_dict(), o_off.state_dict()
                    self.assertEqual(a["state"].keys(), b["state"].keys())
                    for i in a["state"]:
                        for k, v in a["state"][i].items():
                            torch.testing.assert_close(b["state"][i][k], v, rtol=1e-3,
                                                       atol=1e-7)
                    self.assertEqual(a["param_groups"][0]["params"],
                                     b["param_groups"][0]["params"])
                    # torch's state into zinf's optimizer and zinf's into torch's: the
                    # next steps stay together.
                    o_off2 = zt.AdamW(off.parameters(), **args)
                    o_off2.load_state_dict(a)
                    o_ref2 = torch.optim.AdamW(ref.parameters(), **args)
                    o_ref2.load_state_dict(b)
                    self.run_loop(ref, off, e, 3, step, tol=1e-5, o_ref=o_ref2, o_off=o_off2)
        with self.assertRaisesRegex(ValueError, "capturable"):
            zt.AdamW(off.parameters(), capturable=True)
        with self.assertRaisesRegex(ValueError, "differentiable"):
            zt.AdamW(off.parameters(), differentiable=True)

    # ---- faults and copies -----------------------------------------------------------------

    def test_an_exception_in_the_backward_releases_every_pin(self):
        ref, off, e = self.pair()
        off.blocks[0].requires_grad_(False)    # frozen: held by the backward until its end
        with e:
            x, y = next(batches())

            def boom(grad):
                raise RuntimeError("boom")

            loss = off(x, y)
            h = off.ln_f.weight.register_hook(boom)
            with self.assertRaisesRegex(RuntimeError, "boom"):
                loss.backward()
            h.remove()
            o = zt.AdamW([p for p in off.parameters() if p.requires_grad], lr=1e-3)
            o.step()                        # gives back what the backward held
            o.zero_grad()
            self.assertIdle(e, off)
            off(x, y).backward()
            o.step()
            o.zero_grad()
            self.assertIdle(e, off)
            off.zinf_offload.remove()
            self.assertEqual(e.stats()["tensors"], 0)

    def lockstep(self, e, off, o_ref, o_off, losses, steps=3):
        """steps of losses() -> (plain loss, offloaded loss), each pair within 1e-6, then
        both backwards and updates, and nothing left held."""
        for _ in range(steps):
            l_ref, l_off = losses()
            self.assertLessEqual(abs(l_ref.item() - l_off.item()), 1e-6 * l_ref.item())
            l_ref.backward()
            l_off.backward()
            o_ref.step()
            o_off.step()
            o_ref.zero_grad()
            o_off.zero_grad()
            self.assertIdle(e, off)

    def test_a_gather_between_a_gradients_two_hooks(self):
        """Another holder (a gather from another thread, here from a hook) fetching a
        parameter while the backward is between its gradient's pre-hook and its accumulation:
        the gradient torch is about to store is neither dropped nor forgotten in zinf, a
        gather that ends first leaves the stand-in for AccumulateGrad, and one still open
        keeps its copy until it ends. Both ways the training equals torch's."""
        for still_open in (False, True):
            with self.subTest(still_open=still_open):
                ref, off, e = self.pair()
                with e:
                    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
                    o_off = zt.AdamW(off.parameters(), lr=1e-3)
                    w = off.blocks[0].c_fc.weight
                    held = []

                    def between(grad):     # runs after zinf's pre-hook, before AccumulateGrad
                        cm = zt.gathered([w])
                        cm.__enter__()
                        torch.testing.assert_close(w.detach().sum(), w.detach().sum())
                        if still_open:
                            held.append(cm)
                        else:
                            cm.__exit__(None, None, None)

                    h = w.register_hook(between)
                    data = batches()
                    for _ in range(3):
                        x, y = next(data)
                        l_ref, l_off = ref(x, y), off(x, y)
                        self.assertLessEqual(abs(l_ref.item() - l_off.item()),
                                             1e-6 * l_ref.item())
                        l_ref.backward()
                        l_off.backward()
                        while held:
                            held.pop().__exit__(None, None, None)
                        self.assertIsInstance(w.grad, zt.GradProxy)
                        torch.testing.assert_close(
                            torch.linalg.vector_norm(w.grad),
                            torch.linalg.vector_norm(ref.blocks[0].c_fc.weight.grad))
                        o_ref.step()
                        o_off.step()
                        o_ref.zero_grad()
                        o_off.zero_grad()
                        self.assertIdle(e, off)
                    h.remove()

    def test_a_submodule_called_on_its_own(self):
        """A block called outside the model's forward saves its parameters' views through
        zinf's hooks as well: its backward fetches them, and the update equals torch's."""
        ref, off, e = self.pair()
        with e:
            o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
            o_off = zt.AdamW(off.parameters(), lr=1e-3)
            torch.manual_seed(1)
            h = torch.randn(2, 16, ref.wte.weight.shape[1])
            self.lockstep(e, off, o_ref, o_off,
                          lambda: (ref.blocks[1](h).square().mean(),
                                   off.blocks[1](h).square().mean()))
            self.assertGreater(off.zinf_offload.fetches["unpack"], 0)
            x, y = next(batches())
            self.assertLessEqual(abs(ref(x, y).item() - off(x, y).item()), 1e-6 * ref(x, y).item())

    def test_a_frozen_base_larger_than_the_tier(self):
        """The backward through frozen layers fetches each one's saved weight for its node
        only (nothing is held to the backward's end), so a frozen stack many times the tier
        trains the layer under it; against plain PyTorch."""
        torch.manual_seed(0)
        layers = 16
        ref = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(layers)))
        off = copy.deepcopy(ref)
        for m in (ref, off):
            m[1:].requires_grad_(False)         # only the first layer trains
        tier = 4 * (257 * 256 * 4 // 4096 + 1) * 4096      # 4 layers' parameters
        e = zinf.Engine(nvme_path=self.swap, device="emulated", device_bytes=tier,
                        host_bytes=max(tier, 8 << 20))
        with e:
            zt.offload(off, e, wait=2.0)
            o_ref = torch.optim.AdamW(ref[0].parameters(), lr=1e-3)
            o_off = zt.AdamW(off[0].parameters(), lr=1e-3)
            x = torch.randn(8, 256)
            self.lockstep(e, off, o_ref, o_off,
                          lambda: (ref(x).square().mean(), off(x).square().mean()))
            st = e.stats()["tier"][zinf.DEVICE]
            self.assertLessEqual(st["peak_bytes"], tier)
            self.assertEqual(off.zinf_offload.fetches["unpack"], 3 * (layers - 1))

    def test_an_interrupted_step_saves_nothing_of_itself(self):
        """KeyboardInterrupt between two parameters' updates: the engine closes without a
        flush, and a resumed run finds the last whole step's values. Inside step(), or
        (overlap) in the next forward, which carries out the deferred updates."""
        import zinf.torch._optim as optim
        for overlap in (False, True):
            with self.subTest(overlap=overlap):
                ref, off, e = self.pair()
                o = zt.AdamW(off.parameters(), lr=1e-2, overlap=overlap)
                data = batches()
                x, y = next(data)
                off(x, y).backward()
                o.step()
                o.zero_grad()
                e.flush()
                saved = {k: v.clone() for k, v in off.state_dict().items()}
                off(x, y).backward()
                real, calls = optim.adamw_step, []

                def interrupted(*args, **kw):
                    calls.append(1)
                    if len(calls) == 3:
                        raise KeyboardInterrupt
                    return real(*args, **kw)

                optim.adamw_step = interrupted
                try:
                    with self.assertRaises(KeyboardInterrupt):
                        o.step()
                        o.zero_grad()
                        off(x, y)
                finally:
                    optim.adamw_step = real
                self.assertTrue(e.closed)
                with self.assertRaises(Exception):
                    e.flush()
                del o
                m2 = self.model(layers=2)
                with self.engine(m2, resume=True) as e2:
                    zt.offload(m2, e2, resume=True)
                    for k, v in m2.state_dict().items():
                        self.assertTrue(torch.equal(v, saved[k]), k)

    def test_a_flush_or_a_read_after_a_deferred_step_sees_it(self):
        """overlap=True: Engine.flush() right after step() saves the updated state, and
        state_dict(), the optimizer's state_dict() and gathered see it, as with
        overlap=False."""
        states = []
        for overlap in (False, True):
            torch.manual_seed(0)
            ref, off, e = self.pair()
            o = zt.AdamW(off.parameters(), lr=1e-2, overlap=overlap)
            x, y = next(batches())
            for _ in range(2):
                off(x, y).backward()
                o.step()
                o.zero_grad()
            e.flush()
            e.close_unflushed()
            m2 = self.model(layers=2)
            with self.engine(m2, resume=True) as e2:
                zt.offload(m2, e2, resume=True)
                states.append((m2.state_dict(), None))
            torch.manual_seed(0)
            ref, off, e = self.pair()
            o = zt.AdamW(off.parameters(), lr=1e-2, overlap=overlap)
            for _ in range(2):
                off(x, y).backward()
                o.step()
                o.zero_grad()
            with zt.gathered(list(off.blocks[0].parameters())):
                g = {n: p.detach().clone() for n, p in off.blocks[0].named_parameters()}
            states.append((off.state_dict(), o.state_dict(), g))
            e.close()
        (flushed0, _), (sd0, osd0, g0), (flushed1, _), (sd1, osd1, g1) = states
        for k in sd0:
            self.assertTrue(torch.equal(flushed0[k], flushed1[k]), k)
            self.assertTrue(torch.equal(sd0[k], sd1[k]), k)
            self.assertTrue(torch.equal(sd0[k], flushed0[k]), k)
        for k in g0:
            self.assertTrue(torch.equal(g0[k], g1[k]), k)
        for i, st in osd0["state"].items():
            for key, v in st.items():
                self.assertTrue(torch.equal(v, osd1["state"][i][key]), (i, key))

    def test_deepcopy_and_pickle_give_plain_copies(self):
        ref, off, e = self.pair()
        x, y = next(batches())
        with e:
            ema = copy.deepcopy(off)
            self.assertFalse(hasattr(ema, "zinf_offload"))
            for p in ema.parameters():
                self.assertIs(type(p), torch.nn.Parameter)
            self.assertIs(ema.head.weight, ema.wte.weight)
            buf = io.BytesIO()
            torch.save(off, buf)
            buf.seek(0)
            loaded = torch.load(buf, weights_only=False)
            with torch.no_grad():
                want = ref(x, y)
                self.assertTrue(torch.equal(ema(x, y), want))
                self.assertTrue(torch.equal(loaded(x, y), want))
                self.assertTrue(torch.equal(off(x, y), want))
            self.assertIdle(e, off)
            # The original is still offloaded, hooks and all.
            self.assertIs(off.zinf_offload.module, off)

    def test_activation_checkpointing_and_compile(self):
        """torch.utils.checkpoint around offloaded blocks (re-entrant and not), and
        torch.compile of an offloaded model: the same losses as plain PyTorch."""
        import types
        import torch.utils.checkpoint as cp

        def forward(reentrant):
            def f(self, idx, targets):
                x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
                for b in self.blocks:
                    x = cp.checkpoint(b, x, use_reentrant=reentrant)
                logits = self.head(self.ln_f(x))
                return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]),
                                                         targets.view(-1))
            return f

        def step(i, ref, off, o_ref, o_off):
            o_ref.step()
            o_off.step()
            o_ref.zero_grad()
            o_off.zero_grad()

        for reentrant in (True, False):
            with self.subTest(reentrant=reentrant):
                ref, off, e = self.pair()
                with e:
                    # The offload wraps the instance's forward: put the checkpointed one
                    # under it.
                    off.zinf_offload.remove()
                    for m in (ref, off):
                        m.forward = types.MethodType(forward(reentrant), m)
                    zt.offload(off, e)
                    self.run_loop(ref, off, e, 3, step)
                    self.assertIdle(e, off)
                    # The checkpointed blocks ran their forward again in the backward: more
                    # forward fetches than 3 steps' forwards alone make (the head and the tied
                    # embedding fetch one tensor twice).
                    once = len(list(off.parameters()))
                    self.assertGreater(off.zinf_offload.fetches["forward"], 3 * (once + 1))
        ref, off, e = self.pair()
        with e:
            compiled = torch.compile(off)
            self.run_loop(ref, compiled, e, 3, step, o_off=zt.AdamW(off.parameters(), lr=1e-3))
            self.assertIdle(e, off)

    # ---- 16-bit ------------------------------------------------------------------------------

    def test_bf16_parameters_with_a_float32_master(self):
        """bf16 parameters offloaded as they are, against plain PyTorch with the same mixed
        precision (bf16 model, AdamW on float32 copies, rounded into the model each step):
        the forward reads half the bytes of float32's."""
        ref = self.model(layers=2).to(torch.bfloat16)
        off = copy.deepcopy(ref)
        master = [p.detach().float().requires_grad_() for p in ref.parameters()]
        o_ref = torch.optim.AdamW(master, lr=1e-3)
        with self.engine(ref) as e:
            zt.offload(off, e)
            o_off = zt.AdamW(off.parameters(), lr=1e-3)
            data = batches()
            for step in range(8):
                x, y = next(data)
                l_ref, l_off = ref(x, y), off(x, y)
                self.assertEqual(l_ref.dtype, torch.bfloat16)
                gap = abs(l_ref.item() - l_off.item()) / abs(l_ref.item())
                # bf16 keeps 8 bits: the two runs' losses round alike but for the last one.
                self.assertLessEqual(gap, 2 ** -7, f"step {step}")
                l_ref.backward()
                l_off.backward()
                for m, p in zip(master, ref.parameters()):
                    m.grad = p.grad.float()
                torch.nn.utils.clip_grad_norm_(master, 1.0)
                torch.nn.utils.clip_grad_norm_(off.parameters(), 1.0)
                o_ref.step()
                with torch.no_grad():
                    for m, p in zip(master, ref.parameters()):
                        p.copy_(m)
                o_off.step()
                ref.zero_grad()
                off.zero_grad()
                o_ref.zero_grad()
            sd = o_off.state_dict()
            self.assertEqual(sd["state"][0]["master"].dtype, torch.float32)
            for k, v in off.state_dict().items():
                self.assertEqual(v.dtype, torch.bfloat16, k)
            # The parameters stored in zinf are 2 bytes each.
            n = sum(zt.shape_of(p).numel() if hasattr(zt.shape_of(p), "numel") else
                    _numel(zt.shape_of(p)) for p in off.parameters())
            self.assertEqual(off.wte.weight._zinf.handle.nbytes, 2 * 256 * 128)
            self.assertGreater(n, 0)

    def test_fp16_parameters_with_grad_scaler(self):
        """fp16 parameters, float32 master in zinf, torch.amp.GradScaler's dynamic loss
        scale (its unscale_ sees the gradients in zinf, an overflow skips the step and
        halves the scale), against plain PyTorch's master-weight recipe by hand."""
        ref = self.model(layers=2).half()
        off = copy.deepcopy(ref)
        master = [p.detach().float().requires_grad_() for p in ref.parameters()]
        o_ref = torch.optim.AdamW(master, lr=1e-3)
        scale = 2.0 ** 16
        with self.engine(ref) as e:
            zt.offload(off, e)
            o_off = zt.AdamW(off.parameters(), lr=1e-3)
            scaler = torch.amp.GradScaler("cpu", init_scale=scale)
            data = batches()
            skipped = 0
            for step in range(5):
                x, y = next(data)
                l_ref = ref(x, y)
                (l_ref * scale).backward()
                for m, p in zip(master, ref.parameters()):
                    m.grad = p.grad.float() / scale
                if all(torch.isfinite(m.grad).all() for m in master):
                    o_ref.step()
                else:
                    scale /= 2
                    skipped += 1
                with torch.no_grad():
                    for m, p in zip(master, ref.parameters()):
                        p.copy_(m)
                o_ref.zero_grad()
                ref.zero_grad()
                l_off = off(x, y)
                self.assertEqual(l_ref.item(), l_off.item(), f"step {step}")
                scaler.scale(l_off).backward()
                scaler.step(o_off)
                scaler.update()
                o_off.zero_grad()
                self.assertEqual(scaler.get_scale(), scale)
            self.assertGreater(skipped, 0)   # 2^16 overflows fp16 at the first step


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    unittest.main()


class GradAdd(Base):
    """zinf._zinf._grad_add, zinf.torch's accumulation of a gradient into its float32 copy
    in zinf: the bits torch's copy_, mul_ and add_ give, every dtype's values converted
    exactly, and its sum of squares the same whatever the threads."""

    def pinned(self, e, n):
        self.k = getattr(self, "k", 0) + 1
        h = e.register(f"g{self.k}", ((n,), "float32"), home="host")
        return e.fetch(h, "host", dirty=True)

    def test_the_bits_of_torchs_copy_mul_and_add(self):
        from zinf._zinf import _grad_add
        e = zinf.Engine(nvme_path=self.swap, device_bytes=8 << 20, host_bytes=8 << 20)
        n = 40_000
        for dtype, code in ((torch.float32, 0), (torch.bfloat16, 1), (torch.float16, 2)):
            g = (torch.randn(n) * 3).to(dtype)
            with self.pinned(e, n) as pin:
                dst = zt._torch_view(pin).view(torch.float32)
                s = _grad_add(pin, g.data_ptr(), n, code, 1.0, True)
                want = g.float()
                self.assertTrue(torch.equal(dst, want), dtype)
                self.assertAlmostEqual(s, want.double().square().sum().item(),
                                       delta=1e-9 * s)
                for scale in (1.0, 0.37):
                    g2 = (torch.randn(n) * 5).to(dtype)
                    want = want.clone().mul_(scale).add_(g2)
                    _grad_add(pin, g2.data_ptr(), n, code, scale, False)
                    self.assertTrue(torch.equal(dst, want), (dtype, scale))
                del dst
        e.close()

    def test_every_half_and_a_nonfinite_sum(self):
        from zinf._zinf import _grad_add
        e = zinf.Engine(nvme_path=self.swap, device_bytes=8 << 20, host_bytes=8 << 20)
        bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
        for dtype, code in ((torch.float16, 2), (torch.bfloat16, 1)):
            g = bits.view(dtype)
            with self.pinned(e, 1 << 16) as pin:
                s = _grad_add(pin, g.data_ptr(), 1 << 16, code, 1.0, True)
                got = zt._torch_view(pin).view(torch.float32)
                want = g.float()
                same = (got == want) | (got.isnan() & want.isnan())
                self.assertTrue(bool(same.all()), dtype)
                self.assertTrue(bool((got.isnan() == want.isnan()).all()))
                del got
            self.assertFalse(s == s and s != float("inf"), "infs and nans in the sum")
        e.close()

    def test_refusals(self):
        from zinf._zinf import _grad_add
        e = zinf.Engine(nvme_path=self.swap, device_bytes=8 << 20, host_bytes=8 << 20)
        g = torch.ones(16)
        with self.pinned(e, 16) as pin:
            with self.assertRaisesRegex(ValueError, "holds 16 float32, the source 8"):
                _grad_add(pin, g.data_ptr(), 8, 0, 1.0, True)
            with self.assertRaisesRegex(ValueError, "dtype code 3"):
                _grad_add(pin, g.data_ptr(), 16, 3, 1.0, True)
            with self.assertRaisesRegex(ValueError, "at address 0"):
                _grad_add(pin, 0, 16, 0, 1.0, True)
            # The gradient onto itself: only its sum of squares (zinf.torch's norm of a
            # gradient changed in place), as a copy of the same values sums it.
            s = _grad_add(pin, g.data_ptr(), 16, 0, 1.0, True)
            self.assertEqual(_grad_add(pin, pin.ptr, 16, 0, 1.0, True), s)
            for args in ((pin.ptr + 4, 16, 0, 1.0, True), (pin.ptr, 16, 0, 2.0, False),
                         (pin.ptr, 16, 1, 1.0, True)):
                with self.assertRaisesRegex(ValueError, "the source overlaps the gradient"):
                    _grad_add(pin, *args)
            self.assertTrue(torch.equal(zt._torch_view(pin).view(torch.float32), g))
        with self.assertRaisesRegex(ValueError, "_grad_add: grad: its copy was released"):
            _grad_add(pin, g.data_ptr(), 16, 0, 1.0, True)
        h = e.register("half", ((16,), "float16"), home="host")
        with e.fetch(h, "host", dirty=True) as p16:
            with self.assertRaisesRegex(TypeError, "_grad_add: grad is a pinned float16"):
                _grad_add(p16, g.data_ptr(), 16, 0, 1.0, True)
        e.close()

    def test_the_engines_call_fetches_adds_and_releases(self):
        e = zinf.Engine(nvme_path=self.swap, device_bytes=8 << 20, host_bytes=8 << 20)
        h = e.register("g", ((1000,), "float32"))           # homed on NVMe
        g = torch.arange(1000, dtype=torch.float32)
        s = e._grad_add(h, g.data_ptr(), 1000, 0, 1.0, True)
        self.assertEqual(s, float(g.double().square().sum()))
        gb = g.bfloat16()
        s = e._grad_add(h, gb.data_ptr(), 1000, 1, 0.5, False, 1.0)
        want = g * 0.5 + gb.float()
        self.assertEqual(s, float(want.double().square().sum()))
        with e.fetch(h, "host") as pin:
            self.assertTrue(torch.equal(zt._torch_view(pin), want))
        # A refusal writes nothing and keeps no pin.
        with self.assertRaisesRegex(ValueError, "holds 1000 float32, the source 999"):
            e._grad_add(h, g.data_ptr(), 999, 0, 1.0, True)
        with self.assertRaisesRegex(TypeError, "wait is None, True or seconds"):
            e._grad_add(h, g.data_ptr(), 1000, 0, 1.0, True, "x")
        for tier in e.stats()["tier"]:
            self.assertEqual(tier["pinned_bytes"], 0)
        with e.fetch(h, "host") as pin:
            self.assertTrue(torch.equal(zt._torch_view(pin), want))
        e.flush()
        e.close()
        ro = zinf.Engine(nvme_path=self.swap, device_bytes=8 << 20, host_bytes=8 << 20,
                         resume=True, readonly=True)
        h = ro.lookup("g")
        with self.assertRaises(zinf.Error):
            ro._grad_add(h, g.data_ptr(), 1000, 0, 1.0, True)
        for tier in ro.stats()["tier"]:
            self.assertEqual(tier["pinned_bytes"], 0)
        with ro.fetch(h, "host") as pin:
            self.assertTrue(torch.equal(zt._torch_view(pin).view(torch.float32), want))
        ro.close()

    def test_a_refused_release_keeps_what_the_call_wrote(self):
        """Engine._grad_add's dirty release refused (the device copy is pinned meanwhile):
        zinf.Error(EBUSY), and the pin is kept as an orphan, released dirty as the other pin
        goes: the gradient written is not lost."""
        import errno
        e = zinf.Engine(nvme_path=self.swap, device="emulated", device_bytes=8 << 20,
                        host_bytes=8 << 20)
        h = e.register("g", ((1000,), "float32"))
        g = torch.arange(1000, dtype=torch.float32)
        pd = e.fetch(h, "device")
        with self.assertRaises(zinf.Error) as cm:
            e._grad_add(h, g.data_ptr(), 1000, 0, 1.0, True)
        self.assertEqual(cm.exception.errno, errno.EBUSY)
        self.assertGreater(e.stats()["tier"][zinf.HOST]["pinned_bytes"], 0)
        pd.release()
        for tier in e.stats()["tier"]:
            self.assertEqual(tier["pinned_bytes"], 0)
        with e.fetch(h, "host") as pin:
            self.assertTrue(torch.equal(zt._torch_view(pin).view(torch.float32), g))
        e.close()
