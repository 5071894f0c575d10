"""zinf.torch: ZeRO-Infinity for any torch.nn.Module, in one process, over a zinf engine.

    engine = zinf.Engine(config="offload.json")           # or zinf.connect(socket, job)
    model = MyModel()                                       # fp32, bf16 or fp16
    zinf.torch.offload(model, engine, home="nvme")          # its parameters move into zinf
    opt = zinf.torch.AdamW(model.parameters(), lr=3e-4)     # torch.optim.AdamW's semantics
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward()                                     # gradients go into zinf
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # works as it is
        opt.step()                                          # AdamW on the host, streamed
        opt.zero_grad()                                     # or model.zero_grad()

What happens:
- offload() registers every parameter as a zinf tensor "<prefix><name>" of its dtype homed
  in `home` (with "<name>.grad" beside it, float32), writes its values there and leaves the
  Parameter empty (p.data of 0 elements; p.numel() counts its own) between uses: its class
  becomes a ZinfParameter, which raises OffloadedError when read there rather than
  computing with nothing. Its shape is `zinf.torch.shape_of(p)`. Buffers stay where they
  are.
- Before a submodule's forward, a hook fetches the parameters it owns to `tier` (the device
  tier by default: the GPU's memory on a CUDA engine, host memory when the device is
  emulated) and points each Parameter's .data at the fetched copy, zero-copy over DLPack;
  after the forward (or its exception) they are released and emptied again.
- Tensors that autograd saves for the backward and that are views of a fetched parameter
  are saved as (parameter, offset, shape, strides) instead (saved_tensors_hooks, pushed by
  the root's forward, or by a submodule's called on its own), so the graph holds no
  parameter memory between forward and backward. The backward fetches a parameter only as
  a node unpacks such a view, and its pin goes with the view after the node: a parameter
  that no node saved (a bias, an embedding) is not fetched at all, and a frozen stack
  larger than the tier is read a layer at a time. On a CUDA engine the copy is held until
  the parameter's gradient is in (or the backward ends), as kernels may still read it.
  Holds a backward took and did not give back (it raised) are given back at the next
  forward, step or remove.
- As autograd accumulates a parameter's gradient, the parameter takes its shape again from
  a stand-in without memory (AccumulateGrad checks the shape only), and a hook adds the
  gradient into "<name>.grad" in one engine call (in float32, fetched to the host tier; the
  first gradient after zero_grad() overwrites), taking its 2-norm and whether it is finite
  in the same pass, then frees torch's copy; nothing of the parameter is fetched for it.
  p.grad is then a GradProxy that stands for it: clip_grad_norm_, clip_grad_value_,
  GradScaler's unscale_, and zero_grad() of the module or of the optimizer (set_to_none or
  not) act on the gradient in zinf, without reading it back for the 2-norm; anything else
  that reads it raises OffloadedError. `gathered(params, grads=True)` gives real values.
- state_dict() of the model (or of any submodule) holds every parameter's values, tied
  aliases as one tensor, and its buffers; load_state_dict() writes into zinf; deepcopy and
  pickling give a plain in-memory copy of the module.
- AdamW.zero_grad() zeroes each gradient homed on NVMe where it lies (Engine.zero): no
  byte of it is written, and the backward's first accumulation into it reads nothing from
  the drive.
- A parameter's update fetches parameter, gradient and moments ("<name>.exp_avg",
  ".exp_avg_sq", and the float32 master "<name>.master" of a 16-bit parameter) to the host
  tier, runs libzinf's SIMD AdamW (zinf.adamw_step) on them in place with the gradient's
  pending scale, rounds the master into the 16-bit parameter and releases them. AdamW.step()
  takes every update's arguments, marks the end of the step (Engine.step, from which the
  engine learns the order of the next step's fetches for its prefetch and eviction) and, by
  default (overlap=True), leaves each update to the parameter's next use: the next forward
  carries them out in the order it fetches the parameters, the next ones' state prefetched,
  so that their reads and writes overlap its compute. Whatever reads the parameters or the
  moments first carries out what is pending (state dicts, gathered, the next step, and
  Engine.flush() and close() through a barrier). overlap=False updates them all inside
  step(), one after another with the next one prefetched.
- Across ranks, offload(model, engine, group=dist.group.WORLD, stage=1) (ZeRO stage 1):
  every rank offloads the whole model into its own engine, the backward marks the gradients
  unreduced, and the first thing that reads them (a GradProxy's norm, clamp or finiteness
  check, gathered(grads=True), AdamW.step) all-reduces each one in parameter order to the
  mean over the group, once per step however many backwards accumulated. AdamW keeps each
  parameter's moments on the one rank that owns it, which updates it and broadcasts the
  new values; with a group, step() carries out every update and broadcast itself
  (collectives come in the same order on every rank). stage=2 reduces each gradient to its
  owner alone: the other ranks zero theirs and keep its 2-norm and finiteness, exchanged in
  one all-reduce, for clip_grad_norm_ and GradScaler. stage=3 (the default with a group)
  homes each rank's 1/N slice of every parameter, gradient and moment: each module's
  parameters are gathered for its forward and for what its backward unpacks, the backward's
  gradients averaged in buckets (bucket_bytes=) and sliced, AdamW steps the slices, and
  p.grad, state dicts and gathered() gather what they read (collectives: every rank reads
  alike). AdamW.state_dict() there wants gather=True (the full state) or gather=False (this
  rank's slices). At stages 1 and 2 the reduction runs in buckets of bucket_bytes too, one
  all_reduce each.
- Checkpoints: save_checkpoint(directory, model, opt, step=, extra=) has every rank write
  its own shard (its slices at stage 3; at stages 1 and 2 rank 0 the parameters and each
  rank the optimizer state it owns) and rank 0 a manifest last; load_checkpoint(directory,
  model, opt) reads on any number of ranks, at any stage, exactly the ranges each rank
  holds now. save() and load() across ranks: every rank calls them, rank 0 alone writes.

The engine's tier budgets bound the memory: parameters are resident only while a module
runs or its backward needs them, gradients and moments only while stepped. Activations
are torch's. On a CUDA engine, releases wait for the current stream first (a kernel may
still read the copy), so the device copies of one module do not overlap the next module's
compute beyond what the engine prefetches.
"""

import torch

from ._param import GradProxy, OffloadedError, ZinfParameter
from ._offload import Offload, gathered, offload
from ._views import DTYPES, shape_of, torch_view, zero
from ._optim import AdamW
from ._init import init
from ._io import load, save
from ._ckpt import load_checkpoint, save_checkpoint

__all__ = ["AdamW", "DTYPES", "GradProxy", "Offload", "OffloadedError", "ZinfParameter",
           "clip_grad_norm_", "gathered", "init", "load", "load_checkpoint", "offload", "save",
           "save_checkpoint", "shape_of"]

# The names the package had as one module.
_zero, _torch_view = zero, torch_view


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                    foreach=None):
    """torch.nn.utils.clip_grad_norm_, which works on offloaded parameters as it is: the
    norm of each gradient in zinf is the one taken as it was accumulated (2-norm) or read
    from zinf (any other), and the clipping factor is applied by the next step."""
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type,
                                          error_if_nonfinite, foreach)
