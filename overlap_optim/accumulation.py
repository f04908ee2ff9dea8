"""Gradient accumulation for updates that run in backward: micro-batches that step once.

Every backward normally updates each annotated parameter and releases its
gradient. Inside :func:`no_step` nothing is updated: gradients accumulate on
``.grad`` as plain torch accumulates them, and the first backward outside the
block steps each parameter once, on the summed gradient. That equals k
``backward()`` calls, then one ``torch.optim`` step. Clipping
(:mod:`overlap_optim.clipping`) applies to the summed gradient.

Under FSDP2, ``no_step`` turns off each FSDP module's gradient sync (the hooks
then fire at the synced backward). Under DDP, ``no_step`` enters DDP's ``no_sync`` for every DDP module of the
model: nothing is all-reduced until the last micro-batch. Where DDP reduces
anyway (the first backward of a static-graph DDP, as TorchRec builds it, or a
micro-batch whose forward ran before the block), our hook keeps each rank's
gradient local and steps nothing, so the result is the same.

**Undeclared accumulation is refused** (:class:`StepTracker`): once the model's
keyed optimizer (:func:`overlap_optim.get_optimizers`) has had ``step()``
called, a backward of the model that finds no ``step()`` since the model's
previous backward raises, on every rank, before any collective. ``step()``
itself stays a no-op that keeps schedulers in order, and stays optional: a loop
that never calls it is never checked.

**TorchRec's** ``GradientAccumulationWrapper`` is mapped onto the window: the
micro-batches after which it does not step the model's keyed optimizer run in the
window as inside :func:`no_step`, and the one after which it steps closes it, so
its loop is exact without a ``no_step`` of the user's.

Tables of sharded modules accumulate too, on every kind of kernel (fused, fallback,
cross-shard, data-parallel, replicated). Whatever holds gradients outside ``.grad`` (a table
kernel, our DDP hook where DDP reduces inside the window) hands them to the gradient path
(:func:`overlap_optim.gradient_path.take`), which keeps them on the model's :class:`Window`
while it is open and hands back their sum to the micro-batch that closes it. A batch with a
variable batch size per feature (VBE) inside the window is refused by table.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Hashable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from overlap_optim import _private, plans
from overlap_optim.record import group_of, module_record, module_record_of, record, record_of
from overlap_optim.round import when_raised

__all__ = ["no_step", "accumulating", "module_accumulating", "Window", "window_of", "window_of_params",
           "window_of_module", "StepTracker", "track_steps"]


class Window:
    """One model's accumulation window, the one mark of ``no_step``: open while micro-batches run
    whose gradients accumulate and nothing steps. It sits on the model's record. Everything that
    holds gradients back points to it from its own record (set when ``no_step`` opens it): each
    parameter of the model, each sharded module (whose kernels hold their tables' gradients), and
    each tensor a sharded module's data-parallel lookups reduce.

    Attributes:
        open: inside ``no_step``.
        pending: micro-batches ran inside ``no_step`` and the window's last has not: their
            gradients are held outside the optimizer state.
        kept: what the participants that hold gradients outside ``.grad`` kept of them so far,
            by participant and key; only :func:`overlap_optim.gradient_path.take` writes it.
    """

    __slots__ = ("open", "pending", "kept")

    def __init__(self) -> None:
        self.open = False
        self.pending = False
        # what the participants keep while the window is open: participant -> key -> the sum so far
        # (:func:`overlap_optim.gradient_path.take` keeps it, and hands it back when the window closes)
        self.kept: dict[Any, dict[Hashable, Any]] = {}


def window_of(model: nn.Module) -> Window:
    """``model``'s window, made if missing."""
    found = module_record(model)
    if found.window is None:
        found.window = Window()
    return found.window


def window_of_params(*params: torch.Tensor) -> Window | None:
    """The window of the model of ``params`` (the first that has one; None where ``no_step`` never
    ran): what a participant that holds parameters' gradients hands to the gradient path."""
    for param in params:
        found = record_of(param)
        if found is not None and found.window is not None:
            return found.window
    return None


def window_of_module(module: nn.Module) -> Window | None:
    """The window of the model of sharded ``module`` (None where ``no_step`` never ran on it)."""
    found = module_record_of(module)
    return None if found is None else found.window


def accumulating(*params: torch.Tensor) -> bool:
    """Whether the window of a model of any of ``params`` is open: its gradient accumulates,
    nothing steps it. The one accessor of that mark for tensors (a DDP bucket asks it for hundreds
    of parameters, on backward's thread, so it stays cheap)."""
    for param in params:
        found = record_of(param)
        if found is not None and found.window is not None and found.window.open:
            return True
    return False


def module_accumulating(module: nn.Module) -> bool:
    """Whether the window of the model of sharded ``module`` is open: its kernels keep their
    tables' gradients, nothing steps them. The one accessor of that mark for modules."""
    found = module_record_of(module)
    return found is not None and found.window is not None and found.window.open


class StepTracker:
    """The rule for undeclared accumulation, for one model: whether its keyed optimizer has
    stepped, and whether it has since the model's previous backward (one whose end raised, a
    refused step, needs no step after it)."""

    def __init__(self, window: Window) -> None:
        self.window = window
        self.ever_stepped = False
        self.stepped_since_backward = False
        self.previous_raised = False  # the rounds at the end of the model's previous backward raised
        self.optimizers: weakref.WeakSet = weakref.WeakSet()  # the model's keyed optimizers
        self.deferred: contextlib.ExitStack | None = None  # the window a deferred step (TorchRec's wrapper) opened

    def stepped(self) -> None:
        """From the keyed optimizer's ``step()``.

        Raises:
            RuntimeError: TorchRec's gradient accumulation wrapper steps while the window it opened
                holds micro-batches (its flush when the data ends inside a window): nothing steps a
                window but the backward of its last micro-batch.
        """
        if self.deferred is not None and self.window.pending:
            raise RuntimeError(
                "TorchRec's GradientAccumulationWrapper stepped the optimizer (its flush when the data ends inside "
                "a window) while the micro-batches of an unfinished window are held: overlap_optim steps a window's "
                "summed gradient in the backward of its last micro-batch, and this window had none. Make the "
                "number of micro-batches a multiple of num_steps, or pass is_last_batch=True to progress() with "
                "the last one. The held micro-batches were not applied"
            )
        self.ever_stepped = self.stepped_since_backward = True

    def before_forward(self, model: nn.Module, _inputs: object) -> None:
        """Before each forward of the model: under TorchRec's ``GradientAccumulationWrapper`` around one
        of its keyed optimizers, a micro-batch after which the wrapper does not step runs in the model's
        window, as inside :func:`no_step`; the window closes before the micro-batch after which it does."""
        holds = next((h for h in map(_private.torchrec_holds_step, list(self.optimizers)) if h is not None), None)
        if holds is None and self.deferred is not None and self.window.pending and torch.is_grad_enabled():
            raise RuntimeError(
                "a window of micro-batches that TorchRec's GradientAccumulationWrapper opened is unfinished (its "
                "last micro-batch never ran), and this forward runs outside the wrapper: its backward would be "
                "held with them and nothing would step. Finish the window through the wrapper (or pass "
                "is_last_batch=True), then train on"
            )
        if holds and self.deferred is None and not self.window.open:
            self.deferred = contextlib.ExitStack()
            self.deferred.enter_context(_window(model, ddp_sync_ours=False))  # the wrapper syncs DDP itself
        elif holds is False and self.deferred is not None:
            self.deferred.close()
            self.deferred = None

    def backward_started(self) -> None:
        """At the start of each backward of the model (its output's gradient hook), on every rank
        before the model's first collective."""
        if self.window.open:
            self.window.pending = True
            return
        # A backward whose end raised (a refused step) needs no step() after it: a loop skips the batch.
        if self.ever_stepped and not self.stepped_since_backward and not self.previous_raised:
            raise RuntimeError(
                "this backward found no step() of the model's optimizer since its previous backward. Each "
                "backward updates every annotated parameter, so a loop that accumulates micro-batches this way "
                "trains on each micro-batch instead of their sum. Run the micro-batches that must not update "
                "inside overlap_optim.no_step(model) (their forward and backward), and the last one outside it; "
                "or call step() after every backward (it does nothing but keep schedulers in order)"
            )
        self.stepped_since_backward = False
        self.previous_raised = False
        when_raised(self._raised)
        self.window.pending = False

    def _raised(self) -> None:
        self.previous_raised = True

    def _hook_output(self, _module: nn.Module, _inputs: object, output: object) -> None:
        for leaf in _private.tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(self._on_grad)
                return

    def _on_grad(self, _grad: torch.Tensor) -> None:
        self.backward_started()


def track_steps(model: nn.Module) -> StepTracker:
    """The model's :class:`StepTracker`, made and hooked on the model's forward once."""
    found = module_record(model)
    tracker = found.step_tracker
    if tracker is None:
        tracker = found.step_tracker = StepTracker(window_of(model))
        model.register_forward_pre_hook(tracker.before_forward)
        model.register_forward_hook(tracker._hook_output)
    return tracker


@contextlib.contextmanager
def no_step(model: nn.Module) -> Iterator[None]:
    """Micro-batches whose backward updates nothing: gradients accumulate until the first
    backward outside the block, which steps each annotated parameter once on their sum.

    Run each such micro-batch's forward and backward inside the block. Under DDP
    (the model, or a DDP module inside it) it is DDP's ``no_sync`` too; under FSDP2
    (:func:`overlap_optim.fully_shard`), ``set_requires_gradient_sync(False)``: the unsharded
    gradients accumulate, and the last micro-batch reduce-scatters their sum and steps.

    Args:
        model: a plain module, a DDP or FSDP2 module, or a ``DistributedModelParallel``
            with tables of any kind.

    Raises:
        TypeError: ``model`` is not a module.
        ValueError: nothing in ``model`` is annotated.
        RuntimeError: ``no_step`` of the same model is already active (nested).

    Example:
        >>> with overlap_optim.no_step(model):
        ...     (model(batch1) / 2).backward()    # nothing is updated
        >>> (model(batch2) / 2).backward()        # one update, from the summed gradient
    """
    with _window(model):
        yield


@contextlib.contextmanager
def _window(model: nn.Module, ddp_sync_ours: bool = True) -> Iterator[None]:
    """:func:`no_step`; with ``ddp_sync_ours=False`` it leaves the DDP modules of ``model`` as they are
    (a wrapper that enters and leaves their ``no_sync`` itself, such as TorchRec's gradient
    accumulation wrapper; where DDP reduces inside the window, the hook keeps each rank's gradient
    local)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"no_step takes an nn.Module, got {type(model).__name__}")
    params = [p for p in model.parameters() if group_of(p) is not None]
    planned = [m for m in model.modules() if plans.plan_of(m) is not None]
    if not params and not planned:
        raise ValueError(
            "no_step: nothing in this model is annotated with overlap_optim.apply_optimizer_in_backward, so "
            "nothing steps in backward; accumulate as plain torch does"
        )
    window = track_steps(model).window
    if window.open:
        raise RuntimeError("no_step: this model is already inside no_step; nested blocks have no other meaning")
    with contextlib.ExitStack() as stack:
        members = list(model.parameters())  # unannotated ones too: a clipping set must not clip them yet
        for module in planned:
            plan = plans.plan_of(module)
            stack.enter_context(plan.accumulate())  # raises before anything changed, for what it cannot do
            module_record(module).window = window
            members += plan.window_members()
        for module in model.modules():
            if isinstance(module, DistributedDataParallel):
                if ddp_sync_ours:
                    stack.enter_context(_private.no_sync_unless_first_static(module))
            elif isinstance(module, FSDPModule):  # each FSDP group: no reduce-scatter, no hook, until the last
                module.set_requires_gradient_sync(False, recurse=False)
                stack.callback(module.set_requires_gradient_sync, True, recurse=False)
        for member in members:
            record(member).window = window
        window.open = True
        try:
            yield
        finally:
            window.open = False
