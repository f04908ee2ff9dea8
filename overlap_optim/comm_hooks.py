"""DDP communication hooks that run in-backward optimizers after the all-reduce.

A bucket's gradients are reduced (plainly, or as an fp16/bf16 copy) and
averaged first; only then do the annotated optimizers of that bucket's
parameters step, in one foreach update per compatible set
(:mod:`overlap_optim.update`), so every rank applies the update one process
would on the global batch. When backward ends, the gradients of the stepped
parameters are set to None; unannotated parameters keep their averaged gradient.

A DDP-managed tensor may stand for several annotated parameters: TorchRec keeps
the data-parallel tables of one kernel in one flat tensor, and each table is a
view of it. :class:`OptimizerHookState` maps each managed tensor to the
annotated views it holds and to how its gradient splits among them.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.autograd import Variable

from overlap_optim.update import step_params

__all__ = ["OptimizerHookState", "optimizer_hook", "COMM_DTYPES"]

# (annotated parameter, function from the managed tensor's gradient to its own)
Target = tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]
COMM_DTYPES = {"allreduce": None, "fp16": torch.float16, "bf16": torch.bfloat16}


class OptimizerHookState:
    """What :func:`optimizer_hook` needs.

    Args:
        process_group: the group DDP reduces over (None: the default group).
        targets: ``id(managed tensor) -> [(annotated param, grad view fn), ...]``.
        managed: the managed tensors whose gradient is released after backward.
        comm: "allreduce", "fp16" or "bf16".
    """

    __slots__ = ("process_group", "world_size", "targets", "managed", "comm_dtype", "release_queued", "pending",
                 "local_sgd", "local")

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        targets: dict[int, list[Target]],
        managed: list[torch.Tensor],
        comm: str = "allreduce",
        local_sgd=None,
    ) -> None:
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.targets = targets
        self.managed = managed
        self.comm_dtype = COMM_DTYPES[comm]
        self.release_queued = False
        self.pending: list[torch.futures.Future] = []
        self.local_sgd = local_sgd  # an overlap_optim.local_sgd.QSR, or None
        self.local = False  # this backward is a local step

    def release(self) -> None:
        """At the end of backward: wait for every bucket's update, then drop the stepped gradients.

        It is queued at the first bucket, so it runs before DDP's own
        finalisation (queued at the last), while an update may still be
        running on the communication thread: it must wait for all of them.
        """
        pending, self.pending = self.pending, []
        for future in pending:
            future.wait()  # also raises what an update raised
        for param in self.managed:
            param.grad = None
        self.release_queued = False
        if self.local_sgd is not None and self.local_sgd.finish_step(self.local):
            self.local_sgd.average_now()  # the round's last step: average, after the updates


def _keep_averaged(param: torch.Tensor, grad: torch.Tensor) -> None:
    """An unannotated parameter gets its averaged gradient, as under plain DDP.

    The reducer leaves gradients alone once told an optimizer runs in backward,
    so the copy DDP would make from the bucket is made here.
    """
    if param.grad is grad:  # gradient_as_bucket_view: already the averaged view
        return
    if param.grad is None:
        param.grad = grad.detach().clone()
    else:
        param.grad.copy_(grad)


def optimizer_hook(state: OptimizerHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce and average the bucket, then step the annotated parameters in it. On a local
    step (local SGD) nothing is reduced: each rank steps on its own gradient."""
    buffer = bucket.buffer()
    if not state.release_queued:  # the first bucket of this backward
        state.local = state.local_sgd is not None and state.local_sgd.is_local()
        Variable._execution_engine.queue_callback(state.release)
        state.release_queued = True
    if state.local:
        future = torch.futures.Future()
        future.set_result([buffer])
    else:
        sent = buffer if state.comm_dtype is None else buffer.to(state.comm_dtype)
        sent.div_(state.world_size)
        future = dist.all_reduce(sent, group=state.process_group, async_op=True).get_future()

    def step(done: torch.futures.Future) -> torch.Tensor:
        if state.comm_dtype is not None and not state.local:
            buffer.copy_(done.value()[0])
        stepped = []
        for param, grad in zip(bucket.parameters(), bucket.gradients()):
            targets = state.targets.get(id(param))
            if targets is None:
                _keep_averaged(param, grad)
            for target, view in targets or ():
                target.grad = view(grad)
                stepped.append(target)
        step_params(stepped)
        return buffer

    stepped_future = future.then(step)
    state.pending.append(stepped_future)
    return stepped_future
