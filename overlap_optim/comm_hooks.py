"""DDP communication hooks that run in-backward optimizers after the all-reduce.

A bucket's gradients are all-reduced and averaged first; only then do the
annotated optimizers of that bucket's parameters step, so every rank applies
the same update as one process on the global batch would.

A DDP-managed tensor may stand for several annotated parameters: TorchRec keeps
the data-parallel tables of one kernel in one flat tensor, and each table is a
view of it. :class:`OptimizerHookState` maps each managed tensor to the
annotated views it holds and to how its gradient splits among them.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
from collections.abc import Callable

import torch
import torch.distributed as dist

from overlap_optim.annotation import step_param

__all__ = ["OptimizerHookState", "optimizer_hook"]

# (annotated parameter, function from the managed tensor's gradient to its own)
Target = tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]


class OptimizerHookState:
    """What :func:`optimizer_hook` needs: the group, and the annotated targets.

    Args:
        process_group: the group DDP reduces over (None: the default group).
        targets: ``id(managed tensor) -> [(annotated param, grad view fn), ...]``.
    """

    __slots__ = ("process_group", "world_size", "targets")

    def __init__(self, process_group: dist.ProcessGroup | None, targets: dict[int, list[Target]]) -> None:
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.targets = targets


def optimizer_hook(state: OptimizerHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce and average the bucket, then step the annotated parameters in it."""
    buffer = bucket.buffer()
    buffer.div_(state.world_size)
    future = dist.all_reduce(buffer, group=state.process_group, async_op=True).get_future()

    def step(done: torch.futures.Future) -> torch.Tensor:
        reduced = done.value()[0]
        for param, grad in zip(bucket.parameters(), bucket.gradients()):
            for target, view in state.targets.get(id(param), ()):
                target.grad = own = view(grad)
                step_param(target)
                # DDP points the managed gradient back at the bucket after backward,
                # and the next backward adds to it: leave zeros there, not this step's.
                own.zero_()
        return reduced

    return future.then(step)
