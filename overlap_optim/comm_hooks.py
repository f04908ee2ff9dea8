"""DDP communication hooks that run in-backward optimizers after the all-reduce.

A hook is two parts, composed by :func:`optimizer_hook`:

- a **reduction**, a plain DDP hook ``(state, bucket) -> Future[Tensor]`` whose
  future holds the bucket's buffer once it is ready to step on, as in torch's
  ``ddp_comm_hooks/default_hooks.py``: :func:`allreduce_hook` (averaged),
  :func:`fp16_compress_hook` and :func:`bf16_compress_hook` (the same on a
  compressed copy), and :func:`local_step_hook` (no reduction: a local step of
  local SGD). A new reduction is a new function and an entry in :data:`REDUCTIONS`.
- the **step**, :func:`step_bucket`: the annotated optimizers of the bucket's
  parameters step, one multi-tensor update per compatible set, grouped once per
  bucket buffer (:class:`~overlap_optim.update.StepPlan`), so every rank applies
  the update one process would on the global batch.

When backward ends, the state's :class:`~overlap_optim.round.EndOfBackwardRound`
first waits for every bucket (:meth:`OptimizerHookState.settle`); then clipping
(:mod:`overlap_optim.clipping`) runs the updates it held for the global norm;
last (:meth:`OptimizerHookState.release`) the gradients of the stepped
parameters are set to None; unannotated parameters keep their averaged gradient.

A DDP-managed tensor may stand for several annotated parameters: TorchRec keeps
the data-parallel tables of one kernel in one flat tensor, and each table is a
view of it. :class:`OptimizerHookState` maps each managed tensor to the
annotated views it holds and to how its gradient splits among them.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
import functools
from typing import Any
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from overlap_optim.clipping import GradientClipping, clipping_of
from overlap_optim.gradient_path import Keep, take
from overlap_optim.round import EndOfBackwardRound, Phase
from overlap_optim.accumulation import window_of_params
from overlap_optim.update import StepPlan

__all__ = [
    "OptimizerHookState",
    "optimizer_hook",
    "allreduce_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "local_step_hook",
    "step_bucket",
    "REDUCTIONS",
]

# (annotated parameter, function from the managed tensor's gradient to its own)
Target = tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]


class OptimizerHookState:
    """What :func:`optimizer_hook` needs.

    Args:
        process_group: the group DDP reduces over (None: the default group).
        targets: ``id(managed tensor) -> [(annotated param, grad view fn), ...]``.
        managed: the managed tensors whose gradient is released after backward.
        comm: a key of :data:`REDUCTIONS`: "allreduce", "fp16" or "bf16".
        local_sgd: an :class:`overlap_optim.local_sgd.QSR`, or None.
        clips: the clipping sets of the managed parameters, armed with every backward.
    """

    __slots__ = ("process_group", "world_size", "targets", "managed", "reduction", "local_sgd", "round",
                 "pending", "running", "clips", "plans")

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        targets: dict[int, list[Target]],
        managed: list[torch.Tensor],
        comm: str = "allreduce",
        local_sgd=None,
        clips: list[GradientClipping] = (),
    ) -> None:
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.targets = targets
        self.managed = managed
        self.reduction = REDUCTIONS[comm]
        self.local_sgd = local_sgd
        self.round = EndOfBackwardRound(process_group, Phase.SETTLE)
        self.pending: list[torch.futures.Future] = []  # this backward's stepped buckets
        self.running: Reduction | None = None  # this backward's reduction; None between two
        self.clips = list(clips)
        self.plans: dict[int, _BucketPlan] = {}  # bucket index -> its targets, gradient views and step plan

    def settle(self) -> None:
        """At the end of backward, first: wait for every bucket's reduction and update (or its
        hand-over to clipping).

        An update may still be running on the communication thread (the
        rounds run once backward's other callbacks, DDP's finalisation among
        them, have run): it must wait for all of them.
        """
        pending, self.pending = self.pending, []
        for future in pending:
            future.wait()  # also raises what an update raised

    def release(self) -> None:
        """At the end of backward, last: drop the stepped gradients; local SGD's averaging."""
        local = self.running is local_step_hook
        for param in self.managed:
            param.grad = None
        self.running = None
        if self.local_sgd is not None and self.local_sgd.finish_step(local):
            self.local_sgd.average_now()  # the round's last step: average, after the updates


Reduction = Callable[[OptimizerHookState, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def optimizer_hook(state: OptimizerHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce the bucket with this backward's reduction, then step the annotated parameters in it
    (:func:`step_bucket`, by the gradient path). The bucket's local gradients take the gradient
    path first: inside ``no_step`` (where DDP reduces anyway) the window keeps them, and nothing is
    reduced or stepped; the micro-batch that closes it reduces their sum."""
    started: list[torch.futures.Future[torch.Tensor]] = []
    params = bucket.parameters()
    local = _keyed_views(bucket)  # read only where a window keeps them or hands sums back
    kept = not take(functools.partial(_reduce_and_step, state, bucket, started, local), local, clip=None,
                    window=window_of_params(*params), keep=_LOCAL_SUMS)
    if kept:  # DDP's next backward may rebuild its buckets: the window holds the gradients now
        for param in params:
            param.grad = None
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future
    return started[0]


def _keyed_views(bucket: dist.GradBucket) -> Iterator[tuple[int, torch.Tensor]]:
    """``(id(param), its gradient's view of the bucket)``, made as they are read."""
    yield from zip(map(id, bucket.parameters()), _bucket_views(bucket))


def _reduce_and_step(state: OptimizerHookState, bucket: dist.GradBucket,
                     started: list[torch.futures.Future[torch.Tensor]], local: Any, grads: Any) -> None:
    """The bucket's reduction, then its step; ``grads``: each parameter's local gradient, as the
    bucket holds it (``local``, unread), or the window's sums where a window closes, copied in."""
    if grads is not local:
        for view, (_, grad) in zip(_bucket_views(bucket), grads):
            if grad is not view:
                view.copy_(grad)
    reduction = state.running or _start_backward(state)
    stepped = reduction(state, bucket).then(lambda _: step_bucket(state, bucket))
    state.pending.append(stepped)
    started.append(stepped)


# Inside no_step, where DDP reduces anyway (the first backward of a static-graph DDP, whose delayed
# all-reduce ignores no_sync, or a micro-batch whose forward ran outside the block): each rank's local
# gradient of each parameter, kept by the window (a copy: the bucket's buffer is DDP's), as under no_sync.
_LOCAL_SUMS = Keep("ddp_local_gradients", add=lambda kept, new: kept.add_(new), own=lambda grad: grad.detach().clone())


def _start_backward(state: OptimizerHookState) -> Reduction:
    """At the first bucket of a backward: choose its reduction (a local step of local SGD, or the
    state's own), and have :meth:`OptimizerHookState.release` run when it ends."""
    local = state.local_sgd is not None and state.local_sgd.is_local()
    state.round.before(state.settle)
    state.round.defer(state.release)
    state.round.arm()
    for clip in state.clips:
        clip.arm()
    state.running = local_step_hook if local else state.reduction
    return state.running


def _bucket_views(bucket: dist.GradBucket) -> list[torch.Tensor]:
    """Each parameter's gradient as a view of the bucket's buffer, in ``bucket.parameters()`` order."""
    buffer, views, offset = bucket.buffer(), [], 0
    for param in bucket.parameters():
        views.append(buffer[offset : offset + param.numel()].view_as(param))
        offset += param.numel()
    return views


# -- reductions: (state, bucket) -> a future of the bucket's buffer, ready to step on --


def allreduce_hook(state: OptimizerHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the bucket and average it (torch's ``allreduce_hook``)."""
    return _allreduce_hook(state, bucket, None)


def fp16_compress_hook(state: OptimizerHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce an fp16 copy of the bucket and average it, then copy it back."""
    return _allreduce_hook(state, bucket, torch.float16)


def bf16_compress_hook(state: OptimizerHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce a bf16 copy of the bucket and average it, then copy it back."""
    return _allreduce_hook(state, bucket, torch.bfloat16)


def local_step_hook(state: OptimizerHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """No reduction: each rank steps on its own gradient (a local step of local SGD)."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _allreduce_hook(
    state: OptimizerHookState, bucket: dist.GradBucket, dtype: torch.dtype | None
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket across ranks, all-reduced in ``dtype`` (None: the bucket's own)."""
    buffer = bucket.buffer()
    sent = buffer if dtype is None else buffer.to(dtype)
    sent.div_(state.world_size)
    reduced = dist.all_reduce(sent, group=state.process_group, async_op=True).get_future()

    def unpack(done: torch.futures.Future) -> torch.Tensor:
        if dtype is not None:
            buffer.copy_(done.value()[0])
        return buffer

    return reduced.then(unpack)


REDUCTIONS: dict[str, Reduction] = {
    "allreduce": allreduce_hook,
    "fp16": fp16_compress_hook,
    "bf16": bf16_compress_hook,
}


# -- the step, after any reduction --


def step_bucket(state: OptimizerHookState, bucket: dist.GradBucket) -> torch.Tensor:
    """Step the annotated targets on their views of the bucket's gradient (after their clipping
    set has clipped them, if they are clipped); an unannotated parameter keeps its gradient, as
    under plain DDP. Returns the bucket's buffer."""
    plan = _plan(state, bucket)
    for param, grad in plan.kept:
        _keep_averaged(param, grad)
    for clip, grads, steps in plan.sets:  # every rank holds these averaged gradients alike
        take(steps.step, grads, clip=clip, replicated=True)
    return bucket.buffer()


class _BucketPlan:
    """One bucket buffer's targets, their gradient views, and how they step: by clipping set (fixed
    once the hook runs them: declaring clipping on them later is refused), each set's targets by a
    :class:`~overlap_optim.update.StepPlan`. Made once per buffer, not at every step. The kept views
    keep their buffer alive, so a buffer that DDP makes anew (when it rebuilds its buckets) lies at
    another address and gets a plan of its own."""

    __slots__ = ("address", "kept", "sets")

    def __init__(self, state: OptimizerHookState, bucket: dist.GradBucket) -> None:
        self.address = bucket.buffer().data_ptr()
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []  # unannotated: (param, averaged gradient)
        by_clip: dict[int, tuple[GradientClipping | None, list[torch.Tensor], list[torch.Tensor]]] = {}
        for param, grad in zip(bucket.parameters(), bucket.gradients()):
            targets = state.targets.get(id(param))
            if targets is None:
                self.kept.append((param, grad))
            for target, view in targets or ():
                clip = clipping_of(target)
                _, members, grads = by_clip.setdefault(id(clip), (clip, [], []))
                members.append(target)
                grads.append(view(grad))
        self.sets = [(clip, grads, StepPlan(members)) for clip, members, grads in by_clip.values()]


def _plan(state: OptimizerHookState, bucket: dist.GradBucket) -> _BucketPlan:
    plan = state.plans.get(bucket.index())
    if plan is None or plan.address != bucket.buffer().data_ptr():
        plan = state.plans[bucket.index()] = _BucketPlan(state, bucket)
    return plan


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
