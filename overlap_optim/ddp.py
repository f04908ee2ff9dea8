"""Run the in-backward optimizers of DDP-managed parameters from DDP's comm hook."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from overlap_optim import _private
from overlap_optim.annotation import carry_over, remove_guard
from overlap_optim.clipping import GradientClipping, clipping_of, mark_taken
from overlap_optim.comm_hooks import REDUCTIONS, OptimizerHookState, optimizer_hook
from overlap_optim.local_sgd import QSR, AveragedModel
from overlap_optim.record import group_of

__all__ = ["register_optimizer_hook"]

def register_optimizer_hook(
    ddp_model: DistributedDataParallel, comm: str = "allreduce", *, local_sgd: QSR | None = None
) -> OptimizerHookState:
    """Make ``ddp_model`` step its parameters' annotated optimizers after their all-reduce.

    Call it once, after wrapping and before the first forward. For every
    DDP-managed parameter annotated with
    :func:`~overlap_optim.apply_optimizer_in_backward`, the per-parameter hook
    (which would step on the local, unreduced gradient) is removed; the bucket's
    comm hook all-reduces, averages, then steps. Unannotated parameters keep
    their averaged gradient for your own optimizer.

    DDP's own in-backward path (installed lazily at the first forward when a
    managed parameter carries ``_in_backward_optimizers``) is switched off: on
    CPU it crashes, and it cannot be combined with another comm hook.

    Args:
        ddp_model: the wrapped model.
        comm: ``"allreduce"``, or ``"fp16"`` / ``"bf16"`` to all-reduce a compressed copy.
        local_sgd: a :class:`~overlap_optim.local_sgd.QSR`: local SGD for these parameters
            (see :mod:`overlap_optim.local_sgd`).

    Returns:
        The hook's state.

    Raises:
        TypeError: ``ddp_model`` is not a ``DistributedDataParallel``, or ``local_sgd`` is not a QSR.
        ValueError: ``comm`` is unknown; with ``local_sgd``: compression, ``find_unused_parameters=True``,
            ``alpha > 0`` with no annotated parameter, an ``average_state`` name no annotated
            optimizer keeps, or a QSR already registered with another model.
        NotImplementedError: ``find_unused_parameters=True`` with annotated
            parameters: DDP hands an unused parameter a zero gradient, and its
            optimizer would step on it where ``torch.optim`` skips it.
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"register_optimizer_hook takes a DistributedDataParallel, got {type(ddp_model).__name__}")
    if comm not in REDUCTIONS:
        raise ValueError(f"comm must be one of {tuple(REDUCTIONS)}, got {comm!r}")
    carry_over(ddp_model.module)
    targets, managed = {}, []
    for param in _private.ddp_managed_parameters(ddp_model):
        if group_of(param) is None:
            continue
        for handle in _private.pop_in_backward_hook_handles(param):
            handle.remove()
        remove_guard(param)
        targets[id(param)] = [(param, _same)]
        managed.append(param)
    if targets and ddp_model.find_unused_parameters:
        raise NotImplementedError(
            "find_unused_parameters=True with in-backward optimizers: DDP gives an unused parameter a "
            "zero gradient and its optimizer would step on it (torch.optim skips it); wrap with "
            "find_unused_parameters=False, or leave the parameters that may go unused unannotated"
        )
    if local_sgd is not None:
        _attach_local_sgd(local_sgd, ddp_model, comm, managed)
    clips = _clips_of(list(_private.ddp_managed_parameters(ddp_model)), local_sgd is not None)
    state = OptimizerHookState(ddp_model.process_group, targets, managed, comm, local_sgd, clips)
    install_optimizer_hook(ddp_model, state)
    mark_taken(_private.ddp_managed_parameters(ddp_model), "overlap_optim's DDP hook")
    return state


def _clips_of(params: list[torch.Tensor], local: bool) -> list[GradientClipping]:
    """The clipping sets of DDP's parameters: an unannotated member is averaged here, alike on
    every rank; under local SGD each set must hold only this DDP's parameters."""
    clips: dict[int, GradientClipping] = {}
    for param in params:
        clip = clipping_of(param)
        if clip is None:
            continue
        clips.setdefault(id(clip), clip)
        if group_of(param) is None:
            clip.mark_replicated(param)
    if local:
        for clip in clips.values():
            clip.make_local(params)
    return list(clips.values())  # in DDP's parameter order: the same on every rank


def _attach_local_sgd(sync: QSR, ddp_model: DistributedDataParallel, comm: str, annotated: list) -> None:
    if not isinstance(sync, QSR):
        raise TypeError(f"local_sgd takes an overlap_optim.QSR, got {type(sync).__name__}")
    if sync._model is not None:
        raise ValueError("this QSR is registered with another model already: make one QSR per model")
    if comm != "allreduce":
        raise ValueError(f"local_sgd with comm={comm!r}: compressed all-reduce is not supported with local SGD")
    if ddp_model.find_unused_parameters:
        raise ValueError("local_sgd with find_unused_parameters=True is not supported")
    if sync.alpha > 0 and not annotated:
        raise ValueError(
            f"local_sgd with alpha={sync.alpha}: QSR reads the lr of the annotated DDP parameters, and this "
            "model has none; use alpha=0 for a constant period"
        )
    kept = {name for p in annotated for name in (group_of(p).spec.state or {})}
    unknown = sorted(set(sync.average_state) - kept)
    if unknown:
        raise ValueError(
            f"average_state names {unknown}, which no annotated optimizer of this model keeps "
            f"(they keep {sorted(kept)})"
        )
    params = [p for p in _private.ddp_managed_parameters(ddp_model) if p.requires_grad]
    sync.attach(AveragedModel(params, annotated, ddp_model.process_group))


def install_optimizer_hook(ddp_model: DistributedDataParallel, state: OptimizerHookState) -> None:
    """Register :func:`optimizer_hook` with ``state`` in place of DDP's own in-backward path.

    Two private DDP switches, both pinned by the parity tests: DDP's lazy init
    only installs its own (CPU-crashing) in-backward hook, so it is marked done;
    and the reducer is told an optimizer consumes the gradients in backward, so
    that gradients released to None are rebuilt from the bucket each step.
    """
    _private.skip_ddp_lazy_init(ddp_model)
    ddp_model.register_comm_hook(state, optimizer_hook)
    _private.tell_reducer_optimizer_in_backward(ddp_model)


def _same(grad: torch.Tensor) -> torch.Tensor:
    return grad
