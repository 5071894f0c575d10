"""What torch.nn.parallel.DistributedDataParallel finds on an offloaded module: a refusal,
at the wrap, naming the fix. DDP registers its gradient hooks on the parameters as they are
when it wraps, empty placeholders whose tensors zinf swaps in around each use, and fails in
the first backward with a shape error that names neither; and zinf.torch averages the
gradients over its own group (offload(group=)), so DDP has nothing to add.

What this is not: a way to run DDP over an offloaded module, or anything for FSDP."""

__all__ = ["NoDDP", "KEY"]

# The attribute DDP reads, as it wraps a module, for the names of parameters to leave alone.
KEY = "_ddp_params_and_buffers_to_ignore"


class NoDDP:
    """Stands in an offloaded module's _ddp_params_and_buffers_to_ignore: DDP's reading of
    it (set(...)) raises."""

    def __init__(self, grouped):
        self.grouped = grouped

    def __iter__(self):
        how = ("zinf.torch averages the gradients over its group itself: train the module "
               "unwrapped" if self.grouped else
               "give offload(..., group=dist.group.WORLD, stage=1, 2 or 3), which averages "
               "the gradients over the group itself, and train the module unwrapped")
        raise RuntimeError(
            f"zinf.torch: DistributedDataParallel cannot wrap a module offloaded to zinf (its "
            f"parameters' tensors are swapped in around each use, which DDP's gradient hooks "
            f"do not follow); {how}. Under transformers' Trainer (accelerate), which wraps "
            f"the model in DDP when torch.distributed is initialised, mark it prepared "
            f"before train(): model._is_accelerate_prepared = True")

    def __repr__(self):
        return "<zinf.torch: DistributedDataParallel refused>"
